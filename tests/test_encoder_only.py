"""The encoder-only Transformer: shapes, the tied MLM head, parity of its encoder with the
encoder of the encoder-decoder model (same weights -> same states), task/arch dispatch."""

from __future__ import annotations

import pytest
import torch

from qkv.config import CLS, ModelConfig
from qkv.errors import ConfigError
from qkv.models import build_model
from qkv.models.encoder_only import EncoderOnly

CFG = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=1, dropout=0.0,
                  attention_dropout=0.0, src_vocab_size=30, tgt_vocab_size=30)


def test_shapes_and_heads():
    clf = build_model(ModelConfig(**{**CFG.__dict__, "task": "classify", "n_classes": 3}))
    mlm = build_model(ModelConfig(**{**CFG.__dict__, "task": "mlm"}))
    assert isinstance(clf, EncoderOnly) and isinstance(mlm, EncoderOnly)
    x = torch.tensor([[CLS, 8, 9, 10], [CLS, 11, 0, 0]])
    assert clf(x).shape == (2, 3)
    assert mlm(x).shape == (2, 4, 30)
    predict = x >= 8
    assert mlm(x, predict).shape == (4, 30)
    assert torch.allclose(mlm(x, predict), mlm(x)[predict], atol=1e-5)
    assert mlm.mlm_head.embed.weight is mlm.src_embed.weight  # tied to the embeddings
    assert clf.embed(x).shape == (2, 16)


def test_encoder_matches_the_transformers_encoder():
    torch.manual_seed(0)
    seq2seq = build_model(CFG)
    enc = build_model(ModelConfig(**{**CFG.__dict__, "task": "mlm"}))
    missing = enc.load_state_dict(seq2seq.state_dict(), strict=False)
    assert not [k for k in missing.missing_keys if not k.startswith("mlm_head")]
    x = torch.tensor([[CLS, 8, 9, 10, 0]])
    h_ref, _, _ = seq2seq.eval().encode(x)
    h, _, _ = enc.eval().encode(x)
    assert torch.allclose(h, h_ref, atol=1e-6)


def test_classifier_needs_classes_and_dispatch_names_the_field():
    with pytest.raises(ValueError, match="n_classes"):
        build_model(ModelConfig(**{**CFG.__dict__, "task": "classify"}))
    with pytest.raises(ConfigError, match="'task'"):
        ModelConfig(task="summarize").validate()
    with pytest.raises(ConfigError, match="'pooling'"):
        ModelConfig(task="classify", pooling="max").validate()
