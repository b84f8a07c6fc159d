"""The family switches of the one Transformer stack (ModelConfig's rotary and relative positions, RMSNorm,
gated FFN, grouped-query attention, bias and scale switches), each against an independent reference:
torch's own modules, transformers' functions, or the formula written out; and each trainable from
scratch with ``qkv train``, named by ``qkv info``, its decoding with a cache equal to the full forward."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

from qkv.config import PAD, ModelConfig
from qkv.errors import ConfigError

HAS_HF = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA_STYLE = dict(positional="rotary", norm="rmsnorm", norm_bias=False, ffn_gated=True, activation="silu",
                   n_kv_heads=1, norm_first=True, qkv_bias=False, out_bias=False, ffn_bias=False)
LLAMA_FLAGS = ["--positional", "rotary", "--norm", "rmsnorm", "--no-norm-bias", "--ffn-gated", "--activation", "silu",
               "--n-kv-heads", "1", "--norm-first", "--no-qkv-bias", "--no-out-bias", "--no-ffn-bias"]


def tiny(**switches) -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                       attention_dropout=0.0, src_vocab_size=40, tgt_vocab_size=40, **switches).validate()


def test_rmsnorm_equals_torch_rmsnorm():
    from qkv.nn.norm import RMSNorm

    x = torch.randn(3, 5, 16) * 4 + 1
    ours = RMSNorm(16, eps=1e-6)
    ref = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        ref.weight.copy_(ours.weight)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ours(x).abs().mean() > 0.1 and not torch.allclose(ours(x), torch.nn.functional.layer_norm(x, (16,)))


def test_layernorm_without_bias_has_no_bias_and_defaults_are_the_papers():
    from qkv.nn.norm import make_norm

    assert make_norm("layernorm", 8, 1e-5, bias=False).bias is None
    paper = make_norm("layernorm", 8, 1e-5)
    assert type(paper) is torch.nn.LayerNorm and paper.bias is not None


def test_rotary_scores_depend_on_the_distance_only():
    """q_m·k_n after RoPE depends on m - n only: the same vectors at (m, n) and (m + s, n + s) score the same."""
    from qkv.nn.rotary import RotaryPositions, apply_rotary

    rope = RotaryPositions(64, 16, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> float:
        cq, sq = rope.attention_inputs(torch.tensor([[m]]), None, torch.float32)["rope"]
        ck, sk = rope.attention_inputs(torch.tensor([[n]]), None, torch.float32)["rope"]
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert math.isclose(score(5, 2), score(105, 102), rel_tol=1e-4, abs_tol=1e-4)
    assert not math.isclose(score(5, 2), score(5, 3), rel_tol=1e-3)
    assert math.isclose(score(0, 0), float((q * k).sum()), rel_tol=1e-5)  # position 0: no rotation


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_rotary_equals_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from qkv.nn.rotary import RotaryPositions, apply_rotary

    rope = RotaryPositions(64, 16, theta=500.0)
    pos = torch.tensor([[0, 3, 7, 100]])
    cos, sin = rope.attention_inputs(pos, None, torch.float32)["rope"]
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    emb = torch.cat([pos[..., None].float() * inv_freq] * 2, dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    assert torch.allclose(apply_rotary(q, cos, sin), want_q, atol=1e-6)
    assert torch.allclose(apply_rotary(k, cos, sin), want_k, atol=1e-6)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_equal_t5s(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    from qkv.nn.relative import relative_bucket

    rel = torch.arange(-300, 300)[None]
    want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert torch.equal(relative_bucket(rel, bidirectional, 32, 128), want)
    assert len(set(want.tolist()[0])) == (31 if bidirectional else 32)  # a distance of +0 is bucket 0, not 16


def test_grouped_query_attention_equals_heads_sharing_keys_and_values():
    """n_kv_heads = 2 under 4 query heads: heads 0, 1 read K/V head 0, heads 2, 3 K/V head 1 (eq. 1 written out)."""
    from qkv.nn.attention import MultiHeadAttention

    torch.manual_seed(0)
    att = MultiHeadAttention(32, 4, n_kv_heads=2, qkv_bias=False, out_bias=False).eval()
    assert att.in_proj.weight.shape == (32 + 2 * 16, 32) and att.in_proj.bias is None and att.out_proj.bias is None
    x = torch.randn(2, 5, 32)
    got, _, weights = att.self_attention(x, causal=True, need_weights=True)
    wq, wk, wv = att.in_proj.weight.split((32, 16, 16))
    q = (x @ wq.T).view(2, 5, 4, 8).transpose(1, 2)
    k = (x @ wk.T).view(2, 5, 2, 8).transpose(1, 2)
    v = (x @ wv.T).view(2, 5, 2, 8).transpose(1, 2)
    heads = []
    for h in range(4):
        s = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(8)
        s = s.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
        heads.append(s.softmax(-1) @ v[:, h // 2])
    want = torch.cat(heads, dim=-1) @ att.out_proj.weight.T
    assert torch.allclose(got, want, atol=1e-5)
    fast, _, _ = att.self_attention(x, causal=True)  # the fused kernel's path
    assert torch.allclose(fast, want, atol=1e-5)


def test_attention_without_scale_is_t5s():
    from qkv.nn.attention import MultiHeadAttention

    torch.manual_seed(0)
    att = MultiHeadAttention(16, 2, scale=False).eval()
    x = torch.randn(1, 4, 16)
    _, _, w = att.self_attention(x, need_weights=True)
    q, k, _ = att.in_proj(x).chunk(3, dim=-1)
    q, k = q.view(1, 4, 2, 8).transpose(1, 2), k.view(1, 4, 2, 8).transpose(1, 2)
    assert torch.allclose(w, (q @ k.transpose(-1, -2)).softmax(-1), atol=1e-6)  # no 1/sqrt(d_k)


@pytest.mark.parametrize("activation, fn", [("silu", torch.nn.functional.silu), ("gelu", torch.nn.functional.gelu)])
def test_gated_ffn_is_swiglu_and_geglu(activation, fn):
    from qkv.nn.feed_forward import PositionwiseFeedForward

    ffn = PositionwiseFeedForward(8, 12, activation=activation, gated=True, bias=False)
    assert ffn.w_1.bias is None and ffn.w_3 is not None
    x = torch.randn(3, 8)
    want = (fn(x @ ffn.w_1.weight.T) * (x @ ffn.w_3.weight.T)) @ ffn.w_2.weight.T
    assert torch.allclose(ffn(x), want, atol=1e-6) and torch.allclose(ffn.eval_forward(x), want, atol=1e-6)


def test_the_papers_switches_add_no_parameters():
    from qkv.models import build_model

    paper = build_model(tiny())
    names = set(paper.state_dict())
    assert not any(".w_3." in n for n in names) and all(n.endswith(("weight", "bias", "output_bias")) for n in names)
    assert names == set(build_model(tiny(norm="layernorm", norm_bias=True, n_kv_heads=4)).state_dict())


@pytest.mark.parametrize("task, switches", [
    ("translate", LLAMA_STYLE),
    ("translate", dict(positional="relative", norm="rmsnorm", norm_bias=False, attention_scale=False, n_kv_heads=2,
                       ffn_gated=True, activation="gelu_tanh", norm_first=True)),
    ("lm", LLAMA_STYLE),
    ("lm", dict(positional="relative", n_kv_heads=2, qkv_bias=False)),
])
def test_cached_decoding_equals_the_full_forward(task, switches):
    """start/step (keys and values cached, rotated or biased at their positions) give the logits of the full
    forward at every position, for the encoder-decoder and the decoder-only model, on right-padded rows."""
    from qkv.models import build_model

    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny(**switches), task=task)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from 1 and 0
            p.add_(0.2 * torch.randn_like(p))
    tgt = torch.randint(7, 40, (3, 6))
    with torch.inference_mode():
        if task == "translate":
            src = torch.tensor([[9, 10, 11, 12, 3], [13, 14, 3, PAD, PAD], [15, 16, 17, 3, PAD]])
            full = model(src, tgt)  # (B, T, V)
            state = model.start(src)
            for t in range(tgt.size(1)):
                logits, state = model.step(tgt[:, t], state)
                assert torch.allclose(logits, full[:, t], atol=1e-5), t
        else:
            lengths = [4, 2, 3]
            prefix = torch.tensor([row[:n].tolist() + [PAD] * (4 - n) for row, n in zip(tgt, lengths)])
            state = model.start(prefix)
            for step in range(2):
                tokens = torch.tensor([int(row[n + step]) for row, n in zip(tgt, lengths)])
                logits, state = model.step(tokens, state)
                for b, n in enumerate(lengths):
                    want = model(tgt[b : b + 1, : n + step + 1])[0, -1]
                    assert torch.allclose(logits[b], want, atol=1e-5), (b, step)


def test_invalid_switches_are_refused_by_field():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        tiny(n_kv_heads=3)
    with pytest.raises(ConfigError, match="norm"):
        tiny(norm="batchnorm")
    with pytest.raises(ConfigError, match="rotary"):
        ModelConfig(d_model=24, n_heads=8, positional="rotary").validate()  # d_k = 3: no pairs to rotate


def test_qkv_train_llama_style_from_scratch_on_the_default_task(tmp_path, capsys):
    """Rotary + RMSNorm + SwiGLU + multi-query attention, bias-free, trained from scratch by ``qkv train`` on
    the embedded task: the run's checkpoint has the switches, ``qkv info`` names them, the loss falls."""
    import json

    import qkv
    from qkv.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--out", str(out), "--preset", "tiny", "--max-steps", "30", "--eval-every", "30",
               "--eval-bleu-samples", "4", "--max-tokens", "1024", "--threads", "1", "--warmup-steps", "10",
               *LLAMA_FLAGS])
    assert rc == 0, capsys.readouterr().err
    cfg = qkv.load(out / "best").model.cfg
    assert {k: getattr(cfg, k) for k in LLAMA_STYLE} == LLAMA_STYLE
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r["train_loss"] for r in records if "train_loss" in r)  # step 1, before any update counts
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert valid and valid[-1] < first - 1.0, (first, valid)
    capsys.readouterr()
    assert main(["info", str(out / "best")]) == 0
    info = capsys.readouterr().out
    for name in ("rotary positions", "RMSNorm without bias", "SwiGLU", "multi-query attention", "no Q/K/V biases"):
        assert name in info


def test_info_names_switches_from_flags(capsys):
    from qkv.cli import main

    assert main(["info", "--preset", "tiny", "--vocab-size", "100", "--positional", "relative", "--no-attention-scale",
                 "--n-kv-heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "relative positions (T5 buckets: 32" in out and "no 1/√d_k" in out and "multi-query" in out
    assert main(["info", "--preset", "tiny", "--vocab-size", "100"]) == 0
    assert "switches" not in capsys.readouterr().out  # the paper's model has none to name


def test_switches_from_a_config_file(tmp_path):
    """A [model] table sets the switches as the flags do (preset < file < flags); a wrong one names its field."""
    from qkv.config import DecodeConfig, layered, load_toml, preset

    path = tmp_path / "llama.toml"
    path.write_text('[model]\npositional = "rotary"\nrope_theta = 500.0\nnorm = "rmsnorm"\nnorm_bias = false\n'
                    'ffn_gated = true\nactivation = "silu"\nn_kv_heads = 1\nqkv_bias = false\nout_bias = false\n')
    model, train = preset("tiny")
    cfg, _, _ = layered((model, train, DecodeConfig()), load_toml(path), str(path), {"model": {"out_bias": True}})
    assert (cfg.positional, cfg.rope_theta, cfg.norm, cfg.norm_bias, cfg.ffn_gated, cfg.kv_heads, cfg.qkv_bias) == \
        ("rotary", 500.0, "rmsnorm", False, True, 1, False)
    assert cfg.out_bias is True  # the flag over the file
    path.write_text('[model]\nn_kv_heads = "two"\n')
    with pytest.raises(ConfigError, match="n_kv_heads"):
        layered((model, train, DecodeConfig()), load_toml(path), str(path), {})
