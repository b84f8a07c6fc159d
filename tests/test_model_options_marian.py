"""The ModelConfig fields Marian and GPT-2 need: sinusoid_layout, final_norm, output_bias, each
against an independent reference, and the paper's defaults unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import ConfigError
from qkv.models import build_model
from qkv.nn.positional import sinusoidal_table

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
            attention_dropout=0.0, src_vocab_size=20, tgt_vocab_size=20)


def test_halves_layout_is_marians_formula():
    """PE[pos, i] = sin(pos / 10000^(2i/d)), PE[pos, d/2 + i] = cos(...), written out; the interleaved
    table is the paper's: the same numbers, the dimensions in another order."""
    d, n = 8, 5
    halves, inter = sinusoidal_table(n, d, "halves"), sinusoidal_table(n, d)
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert halves[pos, i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert halves[pos, d // 2 + i] == pytest.approx(math.cos(angle), abs=1e-6)
            assert inter[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert inter[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def test_halves_layout_equals_transformers_marian_positions():
    marian = pytest.importorskip("transformers.models.marian.modeling_marian")
    emb = marian.MarianSinusoidalPositionalEmbedding(64, 16)
    emb.weight.data = emb.create_weight() if hasattr(emb, "create_weight") else emb.weight.data
    if hasattr(emb, "_init_weight"):
        emb._init_weight()
    want = emb.weight.detach()
    assert torch.allclose(sinusoidal_table(64, 16, "halves"), want, atol=1e-6)


def test_final_norm_settings():
    post = build_model(ModelConfig(**TINY))
    assert isinstance(post.encoder_norm, torch.nn.Identity)  # the paper's post-norm: none, as before
    pre = build_model(ModelConfig(**TINY, norm_first=True))
    assert isinstance(pre.encoder_norm, torch.nn.LayerNorm)  # pre-norm: one, as before (GPT-2's ln_f)
    on = build_model(ModelConfig(**TINY, final_norm="on"))
    assert isinstance(on.decoder_norm, torch.nn.LayerNorm)
    off = build_model(ModelConfig(**TINY, norm_first=True, final_norm="off"))
    assert isinstance(off.decoder_norm, torch.nn.Identity)
    with pytest.raises(ConfigError, match="final_norm"):
        ModelConfig(**TINY, final_norm="yes").validate()
    with pytest.raises(ConfigError, match="sinusoid_layout"):
        ModelConfig(**TINY, sinusoid_layout="split").validate()


def test_output_bias_adds_to_every_logit():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, output_bias=True)).eval()
    assert "output_bias" in dict(model.named_parameters())
    src, tgt = torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7, 8]])
    before = model(src, tgt)
    with torch.no_grad():
        model.output_bias.copy_(torch.arange(20.0))
    assert torch.allclose(model(src, tgt) - before, torch.arange(20.0).expand_as(before), atol=1e-5)
    assert "output_bias" not in dict(build_model(ModelConfig(**TINY)).named_parameters())  # the paper's: none
