"""benchmarks/gpu_train.py: its FLOP formula against torch's own FLOP counter, and the whole script at tiny
shapes on the CPU (the GPU figures themselves come from running it on a GPU: docs/gpu.md). Also the
GPU-side choices it measures: the fused loss on the CPU only, and a Transformer that compiles."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.config import ModelConfig, TrainConfig
from qkv.models import build_model
from qkv.nn import attention
from qkv.tasks import base

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "gpu_train.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_train", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_train"] = mod  # dataclasses look their module up
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    return mod


def tiny_model():
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                      attention_dropout=0.0, src_vocab_size=100, tgt_vocab_size=100).validate()
    torch.manual_seed(0)
    return build_model(cfg)


def test_model_flops_match_torch_flop_counter(monkeypatch):
    """The docstring's formula, summed over sentences of different lengths, equals what torch counts for
    the same model run on each sentence alone (no padding): forward, and forward + backward = 3x.
    Attention goes through eq. 1 written out, so that its two matrix products are counted too."""
    gt = load_bench()
    monkeypatch.setattr(attention, "scaled_dot_product_attention",
                        lambda q, k, v, mask=None, p=0.0, causal=False, need=False, scale=None, bias=None:
                        attention.attention_reference(q, k, v, mask, p, causal, scale, bias))
    shapes = gt.Shapes(d_model=32, n_heads=4, d_ff=64, layers=2, vocab=100, max_tokens=0, max_len=64)
    model = tiny_model()
    lengths = [(7, 9), (12, 5), (1, 1)]
    fwd = full = 0
    for s, t in lengths:
        src, tgt = torch.randint(4, 100, (1, s)), torch.randint(4, 100, (1, t))
        with FlopCounterMode(display=False) as fc:
            model(src, tgt)
        fwd += fc.get_total_flops()
        with FlopCounterMode(display=False) as fc:
            model(src, tgt).sum().backward()
        full += fc.get_total_flops()
    src_l, tgt_l = np.array([s for s, _ in lengths]), np.array([t for _, t in lengths])
    assert gt.model_flops(src_l, tgt_l, shapes) == fwd
    assert 3 * gt.model_flops(src_l, tgt_l, shapes) == full


def test_base_model_flops_by_hand():
    """One sentence of 10 source and 10 target positions at the base shapes, counted by hand."""
    gt = load_bench()
    d, f, v = 512, 2048, 37_000
    enc = 6 * (10 * (8 * d * d + 4 * d * f) + 4 * d * 100)
    dec = 6 * (10 * (8 * d * d + 4 * d * f) + 4 * d * 100 + 10 * 4 * d * d + 10 * 4 * d * d + 4 * d * 100)
    assert gt.model_flops(np.array([10]), np.array([10]), gt.BASE) == enc + dec + 2 * d * v * 10


def test_wmt_like_lengths_have_the_stated_shape():
    gt = load_bench()
    src, tgt = gt.wmt_like_lengths(200_000, 256, seed=1)
    assert abs(np.median(src) - 24) <= 1 and 26 < src.mean() < 30
    assert 1 <= src.min() and src.max() <= 256 and 1 <= tgt.min() and tgt.max() <= 256
    assert abs(np.median(tgt / src) - 1.06) < 0.02


def test_fused_loss_on_the_cpu_only(monkeypatch):
    """fused_loss fuses on the devices of FUSED_LOSS_DEVICES (the CPU); elsewhere the loss is taken from
    the logits, with the same value."""
    model = tiny_model()
    src, tgt_in, tgt_out = torch.randint(4, 100, (3, 6)), torch.randint(4, 100, (3, 5)), torch.randint(4, 100, (3, 5))
    tgt_out[0, 3:] = 0
    calls = []
    fused = base.linear_label_smoothed_nll_loss
    monkeypatch.setattr(base, "linear_label_smoothed_nll_loss", lambda *a, **k: calls.append(1) or fused(*a, **k))
    cfg = TrainConfig(label_smoothing=0.1)
    on_cpu = base.token_loss(model, (src, tgt_in), tgt_out, cfg)
    assert calls == [1]
    monkeypatch.setattr(base, "FUSED_LOSS_DEVICES", ())
    elsewhere = base.token_loss(model, (src, tgt_in), tgt_out, cfg)
    assert calls == [1]
    torch.testing.assert_close(on_cpu[0], elsewhere[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_cpu[1], elsewhere[1], rtol=1e-5, atol=1e-5)


def test_transformer_stack_hashes_by_identity():
    """torch 2.11's dynamo hashes the stack it builds while tracing, before its fields exist: a field hash
    failed there ("no attribute 'embed'"); an identity hash needs no field."""
    model = tiny_model()
    a, b = model.encoder, model.encoder
    assert a != b and hash(a) == object.__hash__(a)
    stack = object.__new__(type(a))
    hash(stack)  # what dynamo did, on an object whose __init__ has not run


def test_compiled_training_forward_equals_eager():
    """The training forward through torch.compile (the graph dynamo captures, run eagerly: backend
    "eager", no C++ compiler needed) gives the eager loss and gradients."""
    model = tiny_model()
    src, tgt_in, tgt_out = torch.randint(4, 100, (2, 6)), torch.randint(4, 100, (2, 5)), torch.randint(4, 100, (2, 5))
    cfg = TrainConfig(label_smoothing=0.1)
    loss, _ = base.token_loss(model, (src, tgt_in), tgt_out, cfg)
    loss.backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_c, _ = base.token_loss(torch.compile(model, backend="eager", fullgraph=True), (src, tgt_in), tgt_out, cfg)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss)
    for g, p in zip(eager, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_the_device_run_rehearses_every_section_on_the_cpu(tmp_path):
    """benchmarks/gpu_run.sh --dry-run: the script the GPU machine runs, every section at tiny shapes on
    the CPU (the sync-free update, torch.compile's tracing by dynamo). Every setting trains
    on the same batches, every ablation has both sides and a speedup, the sides of the ablations that
    change no arithmetic agree on the loss, decoding writes fixed-length outputs eager and compiled."""
    out = tmp_path / "r.json"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {row["setting"]: row for row in r["settings"]}
    have_hf = importlib.util.find_spec("transformers") is not None
    assert set(rows) == {"fp32", "bf16", "bf16+compile"} | (
        {"hf-fp32", "hf-bf16", "hf-bf16+compile"} if have_hf else set())
    for row in rows.values():
        if row["setting"].startswith("hf-") and not have_hf:
            continue
        assert "skipped" not in row, row
        assert len(row["step_s"]) == 2 and row["target_tokens_per_s"] > 0 and all(np.isfinite(row["loss"]))
        assert row["projected_hours_100k_steps"] == pytest.approx(row["median_step_s"] * 100_000 / 3600)
    assert rows["bf16"]["sync_free"] and rows["bf16+compile"]["sync_free"]  # the CUDA update, rehearsed
    assert rows["bf16"]["host_syncs"].startswith("not checked (CPU")
    # the same batches: qkv's fp32 and bf16 start from the same weights, so their first losses agree closely
    assert rows["fp32"]["loss"][0] == pytest.approx(rows["bf16"]["loss"][0], rel=0.02)
    ablations = {a["measure"]: a for a in r["ablations"]}
    assert set(ablations) == {"bf16", "tf32", "sdpa", "fused-adam", "sync-free", "loss-upcast", "fused-loss",
                              "compile"}
    for a in ablations.values():
        assert "speedup" in a and a["speedup"] > 0, a
    for name in ("sdpa", "sync-free", "loss-upcast", "fused-loss"):  # the same update, computed another way
        without, with_row = ablations[name]["without"], rows["bf16"]
        np.testing.assert_allclose(without["loss"], with_row["loss"], rtol=2e-3, err_msg=name)
    assert ablations["sync-free"]["without"]["sync_free"] is False
    assert ablations["fused-adam"]["with"] == "bf16 read every update" and not ablations["fused-adam"]["with_row"][
        "sync_free"]
    assert r["mean_real_tokens_per_update"]["target"] <= r["mean_padded_tokens_per_update"]["target"] <= 600
    dec = r["decoding"]
    assert {(d["engine"], d["beam"]) for d in dec} == {(e, b) for e in ("qkv eager", "qkv --compile") for b in (1, 4)}
    for d in dec:
        assert "skipped" not in d, d
        assert d["output_tokens"] == 64 * 6
    assert "| fp32 |" in proc.stdout and "| hf-bf16+compile |" in proc.stdout
