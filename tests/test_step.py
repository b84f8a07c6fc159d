"""The training step as a GPU runs it (qkv.training.step), checked on the CPU: padded shapes give the
loss and gradients of the batch unpadded; the forward and loss compile as one graph (fullgraph, no
graph break) for batches of many lengths; a sync-free update reads nothing back from the device and
makes the update the ordinary one makes; skipped updates and the metrics are read every N updates."""

import contextlib
import dataclasses
import functools
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.config import BOS, EOS, PAD, SEP, DecodeConfig, ModelConfig, TrainConfig
from qkv.data.batching import collate
from qkv.data.binarized import TokenArray
from qkv.errors import TrainingDiverged
from qkv.models import build_model
from qkv.tasks import base
from qkv.tasks.translate import EncodedSplit
from qkv.training import step as step_mod
from qkv.training import trainer as trainer_mod
from qkv.training.step import pad_batch, round_up
from qkv.training.trainer import Trainer

V = 60
MODEL = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(vocab_size=V, max_tokens=320, max_len=64, max_steps=1000, label_smoothing=0.1, warmup_steps=100)


def split(n: int = 600, seed: int = 0) -> EncodedSplit:
    """Pairs of many lengths (1..40 a side, independent), so the batches have many shapes."""
    rng = np.random.default_rng(seed)
    lens = [rng.integers(1, 41, n), rng.integers(1, 41, n)]
    return EncodedSplit(*[TokenArray.from_lists([rng.integers(SEP + 1, V, size=int(k)).tolist() for k in side], V)
                          for side in lens])


def make_trainer(tmp_path: Path, name: str, train_cfg: TrainConfig = TRAIN, model_cfg: ModelConfig = MODEL,
                 **kw) -> Trainer:
    vocab = types.SimpleNamespace(vocab_size=V)
    tokenizers = types.SimpleNamespace(src=vocab, tgt=vocab, joint=True, save=lambda path: None)
    return Trainer(model_cfg, train_cfg, DecodeConfig(), tokenizers, split(), None, tmp_path / name,
                   log=lambda m: None, device="cpu", **kw)


# --- shapes from a fixed set -------------------------------------------------------------------------------

def test_padded_batch_has_the_loss_and_gradients_of_the_batch():
    """Rows and lengths rounded up to multiples of 8 (extra rows: EOS / BOS, all-PAD target): the loss,
    the NLL and every gradient are those of the unpadded batch."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(MODEL, src_vocab_size=V, tgt_vocab_size=V).validate())
    batch = collate([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]], [[20, 21], [22] * 10])  # (2, 10), (2, 11)
    padded = pad_batch(batch)
    assert padded.src.shape == (8, 16) and padded.tgt_in.shape == (8, 16) and padded.tgt_out.shape == (8, 16)
    assert padded.src[2:, 0].eq(EOS).all() and padded.tgt_in[2:, 0].eq(BOS).all() and padded.tgt_out[2:].eq(PAD).all()
    assert torch.equal(padded.src[:2, :10], batch.src) and padded.src[:2, 10:].eq(PAD).all()
    assert padded.n_tgt_tokens == batch.n_tgt_tokens
    cfg = dataclasses.replace(TRAIN, fused_loss=False)
    results = []
    for b in (batch, padded):
        model.zero_grad()
        loss, nll = base.token_loss(model, (b.src, b.tgt_in), b.tgt_out, cfg)
        loss.backward()
        results.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, n0, g0), (l1, n1, g1) = results
    torch.testing.assert_close(l1, l0)
    torch.testing.assert_close(n1, n0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert round_up(1) == 8 and round_up(8) == 8 and round_up(9) == 16
    assert pad_batch(padded) is padded  # already on the set


# --- compiled whole, sync-free -------------------------------------------------------------------------------

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero")


@contextlib.contextmanager
def no_reads():
    """Every way a tensor's value reaches the host raises (torch.nonzero too: its output size is data)."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_nonzero = torch.nonzero

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"host read inside the step: Tensor.{name}")
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, refuse(name))
        torch.nonzero = refuse("torch.nonzero")
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        torch.nonzero = saved_nonzero


def test_the_guard_catches_a_read():
    with no_reads(), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(()).item()
    with no_reads(), pytest.raises(AssertionError, match="__bool__"):
        if torch.ones(()):
            pass
    assert torch.ones(()).item() == 1.0


def guarded_device_update(trainer: Trainer, calls: list):
    """The trainer's device part of each update run under :func:`no_reads`."""
    real = Trainer._device_update

    def update(batches, n_tokens, lr):
        with no_reads():
            out = real(trainer, batches, n_tokens, lr)
        calls.append(n_tokens)
        return out

    trainer._device_update = update


def test_compiled_step_is_one_graph_without_host_reads_and_makes_the_eager_update(tmp_path, monkeypatch):
    """torch.compile(fullgraph=True) of the forward and loss (AOTAutograd's backward; dynamo and the
    eager AOT backend, no C++ build) over 10 updates of many shapes: one graph, compiled once; the
    updates after the first read nothing back (every read raises); the weights after them are those of
    10 ordinary (eager, unpadded, read-every-update) updates."""
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    torch._dynamo.reset()
    cfg = dataclasses.replace(TRAIN, compile=True)
    compiled = make_trainer(tmp_path, "compiled", cfg, sync_free=True)
    plain = make_trainer(tmp_path, "plain", TRAIN, sync_free=False)
    assert compiled.sync_free and compiled.pad_shapes and not plain.sync_free and not plain.pad_shapes
    shapes, calls, losses = set(), [], []
    groups = compiled._groups()
    for i in range(10):
        group = next(groups)
        padded = pad_batch(compiled.train_split.collate(group[0]))
        shapes.add((*padded.src.shape, padded.tgt_in.size(1)))
        if i == 1:
            guarded_device_update(compiled, calls)
        stats = compiled.train_step(group)
        assert stats["deferred"] and isinstance(stats["loss"], torch.Tensor)
        ref = plain.train_step(group)
        losses.append((stats["loss"].clone(), stats["grad_norm"].clone(), ref["loss"], ref["grad_norm"]))
    assert len(calls) == 9  # every update after the first ran guarded
    assert len(shapes) >= 6 and len({s[0] for s in shapes}) >= 2  # rows and lengths of many sizes
    assert len(graphs) == 1, graphs  # one graph for every shape: no recompile
    for loss, norm, ref_loss, ref_norm in losses:  # each update's loss: of the weights the updates before made
        assert float(loss) == pytest.approx(ref_loss, rel=1e-5) and float(norm) == pytest.approx(ref_norm, rel=1e-4)
    read = compiled._read_back(stats)
    assert read["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert compiled.step == plain.step == 10 and compiled.nonfinite == 0
    for (name, a), b in zip(compiled.model.named_parameters(), plain.model.parameters()):
        if name.endswith("in_proj.bias"):  # not the keys' third: softmax ignores a key bias, whose gradient
            a, b = a[torch.arange(96) // 32 != 1], b[torch.arange(96) // 32 != 1]  # is rounding noise Adam scales up
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
    explanation = torch._dynamo.explain(compiled.train_loss.eager)(
        pad_batch(compiled.train_split.collate(next(groups)[0])))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_sync_free_eager_step_reads_nothing_with_dropout_and_clipping(tmp_path):
    """Uncompiled, with dropout (qkv's CPU masks) and gradient clipping, on the CPU: no host read in the
    device part of an update from the first one on; the clipped norm is returned unclipped, as before.
    The loss is taken from the logits, as on a GPU (the CPU's chunked loss, fused_loss, selects the
    positions that count with nonzero)."""
    model_cfg = dataclasses.replace(MODEL, dropout=0.1)
    cfg = dataclasses.replace(TRAIN, clip_norm=0.5, fused_loss=False)
    trainer = make_trainer(tmp_path, "eager", cfg, model_cfg, sync_free=True)
    calls = []
    guarded_device_update(trainer, calls)
    groups = trainer._groups()
    for _ in range(3):
        stats = trainer.train_step(next(groups))
    assert len(calls) == 3
    read = trainer._read_back(stats)
    assert math.isfinite(read["loss"]) and read["grad_norm"] > 0.5  # the norm before clipping


# --- skipped updates and metrics, read every N updates ---------------------------------------------------------

def test_non_finite_updates_are_skipped_on_the_device_and_reported_at_the_next_read(tmp_path, monkeypatch):
    """Updates 3 and 4 get a NaN loss: the device leaves weights and Adam's state as they were (its step
    count too), the run goes on, and the read-back at the next progress line says so."""
    logs = []
    trainer = make_trainer(tmp_path, "nan", sync_free=True)
    trainer.log = logs.append
    real_loss, calls = Trainer.loss, [0]

    def loss(self, batch, train=False):
        value, nll = real_loss(self, batch, train)
        calls[0] += 1
        return (value * float("nan") if calls[0] in (3, 4) else value), nll

    monkeypatch.setattr(Trainer, "loss", loss)
    groups, unchanged = trainer._groups(), []
    for _ in range(6):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_step(next(groups))
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters())))
    assert unchanged == [False, False, True, True, False, False]
    assert int(trainer.optimizer.state[next(trainer.model.parameters())]["step"]) == 4  # skipped: not counted
    assert not logs
    trainer._read_back()
    assert trainer.nonfinite == 0 and len(logs) == 1
    assert logs[0].startswith("warning: steps 1-6: 2 update(s) with a non-finite loss or gradient norm, skipped")


def test_a_sync_free_run_reads_every_n_updates_and_stops_when_it_diverges(tmp_path, monkeypatch):
    """qkv's loop with sync-free updates (as on CUDA): the progress records of metrics.jsonl come at
    step 1 and every READ_EVERY steps, read back from the device only then, and hold the figures of
    those updates; a run whose losses are all NaN stops with TrainingDiverged at the first read
    that sees nonfinite_limit in a row, having saved nothing non-finite."""
    monkeypatch.setattr(step_mod, "READ_EVERY", 4)
    monkeypatch.setattr(trainer_mod, "READ_EVERY", 4)
    monkeypatch.setattr(step_mod, "SYNC_FREE_DEVICES", ("cpu", "cuda"))
    reads = []
    real_read = Trainer._read_back
    monkeypatch.setattr(Trainer, "_read_back", lambda self, stats=None: reads.append(self.step) or real_read(self, stats))
    trainer = make_trainer(tmp_path, "loop", dataclasses.replace(TRAIN, max_steps=10, eval_every=100))
    assert trainer.sync_free
    result = trainer.run()
    assert result.step == 10
    records = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    progress = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in progress] == [1, 4, 8]
    assert all(isinstance(r["train_loss"], float) and math.isfinite(r["train_loss"]) and r["grad_norm"] > 0
               for r in progress)
    assert sorted(set(reads)) == [1, 4, 8, 10]  # step 10: the last update, then the final save

    monkeypatch.setattr(Trainer, "loss", lambda self, batch, train=False: tuple(
        x * float("nan") for x in base.token_loss(self.model, (batch.src, batch.tgt_in), batch.tgt_out,
                                                   self.train_cfg)))
    diverging = make_trainer(tmp_path, "nan", dataclasses.replace(TRAIN, max_steps=50, eval_every=100,
                                                                  nonfinite_limit=3))
    with pytest.raises(TrainingDiverged, match="the last 4 updates had a non-finite loss"):
        diverging.run()
    assert diverging.step == 4  # the first read after 3 in a row: step 4
    saved = torch.load(tmp_path / "nan" / "last" / "trainer_state.pt", weights_only=True)
    assert saved["step"] == 0  # only the start was committed, with finite weights
