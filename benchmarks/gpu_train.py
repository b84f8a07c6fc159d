"""The paper's base model trained on one GPU: speed, memory and MFU, qkv against Hugging Face's MarianMTModel.

    python benchmarks/gpu_train.py --json gpu_train.json            # on a CUDA GPU: every section
    python benchmarks/gpu_train.py --tiny --device cpu --steps 2     # the same code at tiny shapes (a test runs it)

**The model and its training** are those of ``recipes/wmt14/base.toml``: the paper's base model (6 + 6
layers, d_model 512, d_ff 2048, 8 heads, dropout 0.1 on sub-layer outputs and embedding sums, no
attention dropout, one shared vocabulary of 37,000 tied to the output projection), label smoothing
0.1, Adam (0.9, 0.98, 1e-9, fused on CUDA) with the warmup schedule (4,000 steps), no gradient
clipping (the paper clips none), batches of at most 25,000 padded tokens per side, one batch an
update. qkv is timed through ``Trainer.train_step``, the update ``qkv train`` runs (collation, the
host-to-device copy, forward, loss, backward, the gradient norm, the finiteness check, Adam), built
as ``qkv train`` builds it; TF32 matrix products are on for what runs in float32, as ``qkv train``
sets on CUDA (``torch.set_float32_matmul_precision("high")``).

**The data** are synthetic token ids (uniform over the ordinary ids) with WMT 2014 En-De-like
lengths: source lengths log-normal with median 24 and sigma 0.55 (mean about 28 BPE tokens), capped
at 1..256 (the recipe's ``max_len``), target length = source length x a log-normal ratio (median
1.06, sigma 0.2), capped the same. This is an assumed shape, not fitted to the corpus: it is in line
with Europarl v7 De-En's about 25 English words a sentence (the largest part of WMT 2014 En-De) and
the 10-20% more pieces than words a 37,000 BPE makes. ``--lengths-from DIR`` takes the length table
of a corpus that ``qkv preprocess`` wrote (the real WMT 2014, say) instead. The pairs are batched by
the trainer's own length-bucketed batching (``EncodedSplit.batches``), and every setting trains on
the same batches, from the same initial weights.

**Settings**, each from a fresh model: ``fp32`` (TF32 on), ``bf16`` (autocast), ``bf16+compile``
(``--amp bf16 --compile``: the training step compiled whole, ``qkv.training.step``). Hugging Face: ``MarianMTModel`` (the same
architecture: post-norm, ReLU, sinusoidal positions, scaled and shared embeddings, SDPA attention)
built from a ``MarianConfig`` of the same shapes, trained by a plain loop a Hugging Face user writes
(logits, ``F.cross_entropy(label_smoothing=0.1)`` summed over the non-pad targets and divided by their
number, fused Adam, the same schedule), as ``hf-fp32``, ``hf-bf16`` and ``hf-bf16+compile``.

On CUDA qkv's update is sync-free (``qkv.training.step``): the benchmark synchronises after each timed
update itself, and reads the losses back at the end; the last warm-up update of each such setting runs
under ``torch.cuda.set_sync_debug_mode("error")``, and ``host_syncs`` records whether it synchronised.

**Ablations** (``--ablations``): each of qkv's GPU-side choices timed against its absence, one at a time,
in the setting it belongs to (bf16 unless said), the choice undone for the baseline by replacing a
library name during the call (benchmark only) or by another setting:

* ``bf16``: bf16 autocast vs float32 (TF32 products);
* ``tf32``: in the float32 setting, TF32 matrix products (what ``qkv train`` sets on CUDA) vs full float32;
* ``sdpa``: attention through SDPA's fused kernels (flash / memory-efficient) vs its math backend;
* ``fused-adam``: Adam's fused kernel vs its multi-tensor one, both reading the figures back every
  update (the multi-tensor Adam cannot skip an update on the device);
* ``sync-free``: the update that never waits for the GPU vs one that reads its figures back every update;
* ``loss-upcast``: ``log_softmax(logits, dtype=float32)`` vs the logits copied to float32 first;
* ``fused-loss``: on a GPU the logits are made and the loss taken from them (``qkv.tasks.base.
  FUSED_LOSS_DEVICES`` is the CPU alone) vs the CPU's fused, chunked projection + loss;
* ``compile``: the step compiled whole on padded shapes (``bf16+compile``) vs eager ``bf16``.

``--dry-run`` rehearses all of it on the CPU at tiny shapes (``benchmarks/gpu_run.sh --dry-run``, which a
test runs): the sync-free update as on CUDA, ``torch.compile`` through the ``eager`` backend (dynamo's
tracing, fullgraph, without code generation).

**Figures** per setting: target and source tokens/s (real tokens, padding not counted), the median
step time, peak GPU memory (``torch.cuda.max_memory_allocated``), and MFU = model FLOPs per step /
step time / the GPU's dense bf16 peak. The model FLOPs of a batch (real lengths: source s_i
including EOS, target t_i including BOS/EOS shift; d, d_ff, V, N_e, N_d):

    encoder  N_e * [ sum_i s_i * (8 d^2 + 4 d d_ff) + 4 d sum_i s_i^2 ]
    decoder  N_d * [ sum_i t_i * (12 d^2 + 4 d d_ff) + 4 d sum_i s_i + ... ]   (see ``model_flops``)
    output   2 d V sum_i t_i
    forward + backward = 3 x forward

(a matrix product of (m x k) by (k x n) is 2mkn FLOPs; attention scores Q K^T and weights x V are
counted in full, causal or not). The dense bf16 peak: NVIDIA's H100 SXM5 datasheet, 1,979 TFLOP/s
"with sparsity", so 989.4 dense (the H200 has the same); for another GPU give ``--peak-tflops``. The
run also times an 8192^3 bf16 matrix product and reports MFU against that measured rate.

**Projection**: the median step time x 100,000, the paper's base run, against its 12 hours on 8 P100s;
and the same scaled to the paper's 25,000 target tokens an update (linear in the tokens), since a
budget of 25,000 padded tokens a side holds fewer real ones.

**Decoding** (``--decode``): the base model (random weights: the speed of a step does not depend on
what the weights learned) decodes 64 sources of the same length distribution at batch 64, greedy and
beam 4, every output exactly ``--decode-len`` tokens long (``min_len`` = the length limit), qkv eager
and qkv ``--compile``; and CTranslate2 on the GPU (the model converted by the converter of ``qkv export
--format ctranslate2``, with placeholder pieces for its vocabulary) where its wheel runs there. Output tokens/s, median of ``--decode-rounds`` calls after a first.

Writes ``--json`` (every figure and the per-step times) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from peers.common import git_commit  # noqa: E402

H100_DENSE_BF16_TFLOPS = 989.4  # NVIDIA H100 SXM5 datasheet: 1,979 TFLOP/s bf16 "with sparsity", halved
SPECIAL_IDS = (0, 1, 2, 3)  # qkv's PAD, UNK, BOS, EOS: the random models' vocabulary has no others
BANNED = (0, 1, 2)  # never emitted (EOS ends an output), as CTranslate2's export bans them
PAPER_STEPS, PAPER_HOURS = 100_000, 12.0  # section 5.2: base model, 100,000 steps, 12 hours on 8 P100s
PAPER_TARGET_TOKENS = 25_000  # section 5.1: about 25,000 source and 25,000 target tokens a batch


@dataclasses.dataclass(frozen=True)
class Shapes:
    d_model: int
    n_heads: int
    d_ff: int
    layers: int
    vocab: int
    max_tokens: int
    max_len: int


BASE = Shapes(512, 8, 2048, 6, 37_000, 25_000, 256)
TINY = Shapes(32, 4, 64, 2, 300, 600, 64)


# --- data ------------------------------------------------------------------------------------------------

def wmt_like_lengths(n: int, max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (source, target) token lengths of the assumed WMT 2014 En-De-like shape (module docstring)."""
    rng = np.random.default_rng(seed)
    src = np.exp(rng.normal(math.log(24.0), 0.55, n))
    tgt = src * np.exp(rng.normal(math.log(1.06), 0.2, n))
    return (np.clip(np.rint(src), 1, max_len).astype(np.int64), np.clip(np.rint(tgt), 1, max_len).astype(np.int64))


def table_lengths(corpus_dir: Path, n: int, max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` length pairs drawn from the training length table of a ``qkv preprocess`` directory."""
    from qkv.data.binarized import open_corpus

    table = open_corpus(corpus_dir).length_index("train").up_to(max_len).table  # (K, 3): src, tgt, count
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(table), size=n, p=table[:, 2] / table[:, 2].sum())
    return table[rows, 0].astype(np.int64), table[rows, 1].astype(np.int64)


def make_split(src_lens: np.ndarray, tgt_lens: np.ndarray, vocab: int, seed: int):
    """The pairs as the trainer's split: random ordinary token ids of those lengths."""
    from qkv.config import SEP
    from qkv.data.binarized import TokenArray
    from qkv.tasks.translate import EncodedSplit

    rng = np.random.default_rng(seed + 1)
    sides = [TokenArray.from_lists([rng.integers(SEP + 1, vocab, size=int(k)).tolist() for k in lens], vocab)
             for lens in (src_lens, tgt_lens)]
    return EncodedSplit(*sides)


def real_lengths(split, group: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Real positions per sentence of an update's batches: source + EOS, target + EOS (the BOS-shifted input
    has as many)."""
    ix = [i for batch in group for i in batch]
    return split.src.lengths[ix].astype(np.int64) + 1, split.tgt.lengths[ix].astype(np.int64) + 1


def model_flops(src: np.ndarray, tgt: np.ndarray, s: Shapes) -> float:
    """Forward FLOPs of the encoder-decoder on sentences of real lengths ``src``, ``tgt`` (formula in the
    module docstring): every matrix product of every layer, attention scores and values, the output
    projection. Embedding look-ups, layer norms, softmax and the loss's elementwise work are not counted."""
    d, f, v, n = s.d_model, s.d_ff, s.vocab, s.layers
    S, T = float(src.sum()), float(tgt.sum())
    S2, T2, ST = float((src**2).sum()), float((tgt**2).sum()), float((src * tgt).sum())
    encoder = n * (S * (2 * 3 * d * d + 2 * d * d + 2 * 2 * d * f)  # Q K V, W^O, the FFN's two maps
                   + 2 * 2 * d * S2)  # Q K^T and weights x V over each sentence's s x s
    decoder = n * (T * (2 * 3 * d * d + 2 * d * d) + 2 * 2 * d * T2  # masked self-attention
                   + T * (2 * d * d + 2 * d * d) + S * (2 * 2 * d * d) + 2 * 2 * d * ST  # cross: Q, W^O; K V of memory
                   + T * 2 * 2 * d * f)  # FFN
    output = 2 * d * v * T
    return encoder + decoder + output


# --- qkv -------------------------------------------------------------------------------------------------

def qkv_configs(s: Shapes, amp: str, compile: bool, device: str, fused_loss: bool = True):
    from qkv.config import ModelConfig, TrainConfig

    model_cfg = ModelConfig(d_model=s.d_model, n_heads=s.n_heads, d_ff=s.d_ff, n_encoder_layers=s.layers,
                            n_decoder_layers=s.layers, dropout=0.1, attention_dropout=0.0)
    train_cfg = TrainConfig(vocab_size=s.vocab, max_tokens=s.max_tokens, max_len=s.max_len, warmup_steps=4000,
                            label_smoothing=0.1, clip_norm=0.0, amp=amp, compile=compile, device=device,
                            fused_loss=fused_loss, max_steps=100_000)
    return model_cfg, train_cfg


def build_trainer(s: Shapes, split, setting: dict, device: str, out: Path):
    from qkv.config import DecodeConfig
    from qkv.training.trainer import Trainer

    model_cfg, train_cfg = qkv_configs(s, setting["amp"], setting["compile"], device, setting.get("fused_loss", True))
    vocab = types.SimpleNamespace(vocab_size=s.vocab)
    tokenizers = types.SimpleNamespace(src=vocab, tgt=vocab, joint=True)
    return Trainer(model_cfg, train_cfg, DecodeConfig(), tokenizers, split, None, out, log=lambda m: None,
                   device=device, sync_free=setting.get("sync_free"))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_qkv(s: Shapes, split, groups, warmup: int, setting: dict, device: str, first: int) -> dict:
    """Warm-up updates, then each timed update alone, the device synchronised after it (by the benchmark:
    on CUDA the trainer's update is sync-free, its figures read back here at the end). The updates are
    the trainer's own (``Trainer._groups``, the loop ``qkv train`` runs) from the ``first``-th batch of
    the epoch on; they are checked to be ``groups``. On CUDA the last warm-up update of a sync-free
    trainer runs under ``torch.cuda.set_sync_debug_mode("error")``: ``host_syncs`` records the result."""
    with tempfile.TemporaryDirectory() as tmp, setting.get("patch", contextlib.nullcontext)():
        trainer = build_trainer(s, split, setting, device, Path(tmp))
        trainer.batch_in_epoch = first
        own = trainer._groups()
        checked = "not checked (CPU: tests/test_step.py guards the step)" if not device.startswith("cuda") else \
            "not checked (the update reads back every update: not sync-free)" if not trainer.sync_free else None
        t0 = time.perf_counter()
        for i, expected in enumerate(groups[:warmup]):
            group = next(own)
            assert group == expected, "the trainer's batches differ from the benchmark's"
            if checked is None and i == warmup - 1:
                checked = sync_checked_step(trainer, group)
            else:
                trainer.train_step(group)
        sync(device)
        warm = time.perf_counter() - t0
        times, stats = [], []
        for expected in groups[warmup:]:
            group = next(own)
            assert group == expected, "the trainer's batches differ from the benchmark's"
            t = time.perf_counter()
            stats.append(trainer.train_step(group))
            sync(device)
            times.append(time.perf_counter() - t)
        losses = [trainer._read_back(st)["loss"] for st in stats]
        row = {"warmup_s": warm, "step_s": times, "loss": losses, "sync_free": trainer.sync_free,
               "host_syncs": checked}
        del trainer
    return row


def sync_checked_step(trainer, group) -> str:
    """One update of ``trainer`` with CUDA's sync debug mode set to raise at any host synchronisation."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step(group)
        verdict = "none (one update under torch.cuda.set_sync_debug_mode('error'))"
    except RuntimeError as e:
        traceback.print_exc()
        trainer.optimizer.zero_grad(set_to_none=True)
        verdict = f"synchronised: {str(e)[:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return verdict


# --- Hugging Face ----------------------------------------------------------------------------------------

def hf_model(s: Shapes, device: str):
    from transformers import MarianConfig, MarianMTModel

    from qkv.config import BOS, EOS, PAD

    cfg = MarianConfig(vocab_size=s.vocab, d_model=s.d_model, encoder_layers=s.layers, decoder_layers=s.layers,
                       encoder_attention_heads=s.n_heads, decoder_attention_heads=s.n_heads,
                       encoder_ffn_dim=s.d_ff, decoder_ffn_dim=s.d_ff, activation_function="relu", dropout=0.1,
                       attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=1024,
                       scale_embedding=True, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS,
                       share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    torch.manual_seed(1)
    return MarianMTModel(cfg).to(device).train()


def time_hf(s: Shapes, split, groups, warmup: int, setting: dict, device: str) -> dict:
    from qkv.config import PAD
    from qkv.training.schedule import learning_rate

    model = hf_model(s, device)
    step_model = torch.compile(model) if setting["compile"] else model
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                           **({"fused": True} if device.startswith("cuda") else {}))
    dtype = torch.bfloat16 if setting["amp"] == "bf16" else None

    def step(n: int, group) -> float:
        batch = split.collate([i for b in group for i in b]).to(device, non_blocking=True)
        n_tok = int((batch.tgt_out != PAD).sum())
        with torch.autocast(device.split(":")[0], dtype=dtype) if dtype else contextlib.nullcontext():
            logits = step_model(input_ids=batch.src, attention_mask=batch.src != PAD,
                                decoder_input_ids=batch.tgt_in, decoder_attention_mask=batch.tgt_in != PAD).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch.tgt_out.view(-1), ignore_index=PAD,
                                   label_smoothing=0.1, reduction="sum")
        (loss / n_tok).backward()
        for g in opt.param_groups:
            g["lr"] = learning_rate("noam", n, d_model=s.d_model, warmup=4000, scale=1.0, lr=0.0, default_lr=0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach()) / n_tok

    t0 = time.perf_counter()
    for i, group in enumerate(groups[:warmup]):
        step(i + 1, group)
    sync(device)
    warm = time.perf_counter() - t0
    times, losses = [], []
    for i, group in enumerate(groups[warmup:]):
        t = time.perf_counter()
        losses.append(step(warmup + i + 1, group))
        sync(device)
        times.append(time.perf_counter() - t)
    del model, step_model, opt
    return {"warmup_s": warm, "step_s": times, "loss": losses}


# --- ablations (benchmark only: library names replaced during the baseline's calls) -------------------

@contextlib.contextmanager
def fused_on_gpu():
    """The fused, chunked output projection + loss on every device (as on the CPU)."""
    from qkv.tasks import base

    saved = base.FUSED_LOSS_DEVICES
    base.FUSED_LOSS_DEVICES = ("cpu", "cuda")
    try:
        yield
    finally:
        base.FUSED_LOSS_DEVICES = saved


@contextlib.contextmanager
def no_tf32():
    """Float32 matrix products in full float32 (``qkv train`` turns TF32 on for CUDA)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def math_attention():
    """Attention through SDPA's math backend (eq. 1 as separate kernels) instead of its fused ones
    (flash / memory-efficient on a GPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@contextlib.contextmanager
def unfused_adam():
    """Adam's multi-tensor (foreach) implementation instead of its fused kernel; an optimizer that cannot
    skip an update on the device, so the update reads back every update as well."""
    from qkv.training import trainer

    saved = trainer.build_optimizer
    trainer.build_optimizer = lambda params, cfg, fused=False: saved(params, cfg, fused=False)
    try:
        yield
    finally:
        trainer.build_optimizer = saved


@contextlib.contextmanager
def upcast_logits():
    """The loss as qkv took it before: the logits copied to float32, then their float32 log-softmax
    (two float32 tensors of tokens x vocabulary), instead of ``log_softmax(dtype=float32)``."""
    from qkv import losses
    from qkv.tasks import base

    saved = base.label_smoothed_nll_loss

    def old(logits, target, epsilon, ignore_index=0):
        return saved(logits.to(losses.loss_dtype(logits.dtype)), target, epsilon, ignore_index)

    base.label_smoothed_nll_loss = old
    try:
        yield
    finally:
        base.label_smoothed_nll_loss = saved


SETTINGS = {
    "fp32": {"kind": "qkv", "amp": "none", "compile": False},
    "bf16": {"kind": "qkv", "amp": "bf16", "compile": False},
    "bf16+compile": {"kind": "qkv", "amp": "bf16", "compile": True},
    "hf-fp32": {"kind": "hf", "amp": "none", "compile": False},
    "hf-bf16": {"kind": "hf", "amp": "bf16", "compile": False},
    "hf-bf16+compile": {"kind": "hf", "amp": "bf16", "compile": True},
}
BF16 = SETTINGS["bf16"]
ABLATIONS = {  # name: (the setting without the measure, the setting with it; a name is a row of SETTINGS)
    "fused-loss": ({**BF16, "patch": fused_on_gpu}, "bf16"),
    "tf32": ({**SETTINGS["fp32"], "patch": no_tf32}, "fp32"),
    "bf16": ("fp32", "bf16"),  # bf16 autocast against float32 (TF32 products)
    "sdpa": ({**BF16, "patch": math_attention}, "bf16"),  # SDPA's fused kernels against its math backend
    "loss-upcast": ({**BF16, "patch": upcast_logits}, "bf16"),  # log_softmax(dtype=float32) against a copy first
    "sync-free": ("bf16 read every update", "bf16"),  # no host sync in the update against a read every update
    "fused-adam": ({**BF16, "patch": unfused_adam}, "bf16 read every update"),  # both read back every update
    "compile": ("bf16", "bf16+compile"),  # the step compiled whole (padded shapes) against eager
}
#: rows an ablation compares with that are not among SETTINGS
EXTRA_ROWS = {"bf16 read every update": {**BF16, "sync_free": False}}


# --- the GPU's own rate ----------------------------------------------------------------------------------

def matmul_tflops(device: str, n: int = 8192) -> float | None:
    if not device.startswith("cuda"):
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (start.elapsed_time(end) / 1000) / 1e12


def peak_tflops(device: str, given: float | None) -> tuple[float | None, str]:
    if given:
        return given, "given with --peak-tflops"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        if "H100" in name or "H200" in name:
            return H100_DENSE_BF16_TFLOPS, "NVIDIA H100/H200 SXM datasheet: 1,979 TFLOP/s bf16 with sparsity, 989.4 dense"
    return None, "unknown for this device (give --peak-tflops)"


# --- decoding --------------------------------------------------------------------------------------------

def decode_section(s: Shapes, device: str, out_len: int, rounds: int, engines_wanted: list[str],
                   budget_left) -> list[dict]:
    from qkv.config import DecodeConfig
    from qkv.decoding.batch import decode_sentences
    from qkv.decoding.compiled import CompiledDecoder
    from qkv.models import build_model

    model_cfg, train_cfg = qkv_configs(s, "none", False, device)
    model_cfg = dataclasses.replace(model_cfg, src_vocab_size=s.vocab, tgt_vocab_size=s.vocab)
    torch.manual_seed(2)
    model = build_model(model_cfg.validate()).to(device).eval()
    src_lens, _ = wmt_like_lengths(64, 100, seed=7)
    rng = np.random.default_rng(8)
    src = [rng.integers(5, s.vocab, size=int(k)).tolist() for k in src_lens]
    rows = []
    engines = {"qkv eager": model}
    for beam in (1, 4):
        cfg = DecodeConfig(beam_size=beam, batch_size=64, min_len=out_len, max_len_a=0.0, max_len_b=out_len)
        for name in [n for n, key in (("qkv eager", "eager"), ("qkv --compile", "compile")) if key in engines_wanted]:
            if budget_left() < (90 if "compile" in name else 20):
                rows.append({"engine": name, "beam": beam, "skipped": "out of time"})
                continue
            if name not in engines:
                engines[name] = CompiledDecoder(model)
            eng = engines[name]
            t = time.perf_counter()
            out = decode_sentences(eng, src, cfg, BANNED)
            sync(device)
            first = time.perf_counter() - t
            lens = {len(h[0].tokens) for h in out}
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                decode_sentences(eng, src, cfg, BANNED)
                sync(device)
                times.append(time.perf_counter() - t)
            n_tok = sum(len(h[0].tokens) for h in out)
            rows.append({"engine": name, "beam": beam, "batch": 64, "output_tokens": n_tok, "output_lengths": sorted(lens),
                         "first_call_s": first, "s": times, "tokens_per_s": n_tok / statistics.median(times)})
            print(f"decode {name} beam {beam}: {rows[-1]['tokens_per_s']:,.0f} output tokens/s (first call {first:.1f} s)",
                  flush=True)
    if "ct2" in engines_wanted and budget_left() > 30:
        rows += ct2_rows(model, model_cfg, src, out_len, rounds, device)
    return rows


def ct2_rows(model, model_cfg, src, out_len: int, rounds: int, device: str) -> list[dict]:
    """CTranslate2 decoding the same model, where its wheel runs on this device (else why not, recorded)."""
    try:
        import ctranslate2

        if device.startswith("cuda") and ctranslate2.get_cuda_device_count() == 0:
            return [{"engine": "ctranslate2", "skipped": f"ctranslate2 {ctranslate2.__version__} sees no CUDA device"}]
        return _ct2_time(model, model_cfg, src, out_len, rounds, device)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        traceback.print_exc()
        return [{"engine": "ctranslate2", "skipped": f"{type(e).__name__}: {str(e)[:300]}"}]


class _VocabSource:
    """What :func:`qkv.export.ct2.model_spec` reads of a checkpoint, for a model held in memory: its
    config, its weights, and a vocabulary of placeholder pieces (the ids are what is decoded)."""

    def __init__(self, model, model_cfg):
        from qkv.export.source import Source

        self.model, self.task = model_cfg, "translate"
        self.weights = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        self.w, self.has = types.MethodType(Source.w, self), types.MethodType(Source.has, self)
        self.path = Path("in-memory")
        self.tokenizers = types.SimpleNamespace(tgt=types.SimpleNamespace(special_ids=SPECIAL_IDS))
        self.pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(4, model_cfg.tgt_vocab_size)]

    def vocabulary(self, side: str) -> list[str]:
        return self.pieces


def _ct2_time(model, model_cfg, src, out_len, rounds, device):
    import ctranslate2

    from qkv.export.ct2 import converter_class

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = _VocabSource(model, model_cfg)
        converter_class()(source).convert(str(Path(tmp) / "ct2"), force=True)
        tr = ctranslate2.Translator(str(Path(tmp) / "ct2"), device="cuda" if device.startswith("cuda") else "cpu")
        tokens = [[source.pieces[t] for t in s] for s in src]
        for beam in (1, 4):
            kw = dict(beam_size=beam, max_batch_size=64, min_decoding_length=out_len, max_decoding_length=out_len,
                      length_penalty=0.0, return_scores=False)
            t = time.perf_counter()
            res = tr.translate_batch(tokens, **kw)
            first = time.perf_counter() - t
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                tr.translate_batch(tokens, **kw)
                times.append(time.perf_counter() - t)
            n_tok = sum(len(r.hypotheses[0]) for r in res)
            rows.append({"engine": f"ctranslate2 {ctranslate2.__version__}", "beam": beam, "batch": 64,
                         "output_tokens": n_tok, "first_call_s": first, "s": times,
                         "tokens_per_s": n_tok / statistics.median(times)})
            print(f"decode ctranslate2 beam {beam}: {rows[-1]['tokens_per_s']:,.0f} output tokens/s", flush=True)
    return rows


# --- the run ---------------------------------------------------------------------------------------------

def use_backend(backend: str) -> None:
    """Every ``torch.compile`` call of this process (qkv's, Hugging Face's, the benchmark's) through
    ``backend``, without inductor's ``mode`` and ``options``."""
    real = torch.compile

    def compile_with(fn=None, **kw):
        kw.pop("mode", None), kw.pop("options", None)
        return real(fn, **{**kw, "backend": backend}) if fn is not None else \
            (lambda f: real(f, **{**kw, "backend": backend}))

    torch.compile = compile_with


def summarise(name: str, r: dict, flops: float, src_tok: float, tgt_tok: float, peak: float | None,
              measured: float | None, steps: int) -> dict:
    med = statistics.median(r["step_s"])
    total = sum(r["step_s"])
    per_update = tgt_tok / steps
    row = {"setting": name, "median_step_s": med, "target_tokens_per_s": tgt_tok / total,
           # the paper's update holds about 25,000 target tokens: the same run at that size, linear in tokens
           "projected_hours_100k_paper_updates": med * PAPER_STEPS / 3600 * PAPER_TARGET_TOKENS / per_update,
           "source_tokens_per_s": src_tok / total, "model_tflop_per_step": flops / 1e12,
           "achieved_tflops": flops / med / 1e12, "warmup_s": r["warmup_s"], "step_s": r["step_s"],
           "loss": r["loss"], "peak_memory_gib": r.get("peak_memory_gib"),
           "sync_free": r.get("sync_free"), "host_syncs": r.get("host_syncs"),
           "projected_hours_100k_steps": med * PAPER_STEPS / 3600}
    if peak:
        row["mfu"] = flops / med / 1e12 / peak
    if measured:
        row["mfu_of_measured_matmul"] = flops / med / 1e12 / measured
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (d 32, 2 + 2 layers, V 300): a check of the code")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--ablations", default=",".join(ABLATIONS), help="comma-separated, or '' (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="timed updates per setting (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first (compiled settings: +3)")
    ap.add_argument("--max-tokens", type=int, help="padded tokens per side of a batch (default: 25,000, the "
                    "base preset's)")
    ap.add_argument("--pairs", type=int, default=1_000_000,
                    help="synthetic sentence pairs batched: the more, the fuller each length pair's bucket and the "
                         "less padding, as in a corpus of millions (default: %(default)s; the H100 run of "
                         "2026-11-27 used 60,000)")
    ap.add_argument("--lengths-from", type=Path, help="a `qkv preprocess` directory whose length table to draw from")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: known for H100/H200)")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True, help="the decoding section")
    ap.add_argument("--decode-len", type=int, default=32, help="output tokens per sentence (default: %(default)s)")
    ap.add_argument("--decode-rounds", type=int, default=3)
    ap.add_argument("--decode-engines", default="eager,compile,ct2",
                    help="qkv eager, qkv --compile, CTranslate2 (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=540, help="seconds; sections that would start later are skipped")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend for every compiled setting (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="rehearse every section on the CPU at tiny shapes: --tiny --device cpu, 2 timed updates, "
                         "the updates sync-free as on CUDA, torch.compile's tracing (dynamo, fullgraph) without "
                         "code generation (backend eager; inductor's C++ build would take minutes; "
                         "tests/test_step.py traces the compiled step's backward too)")
    args = ap.parse_args()
    if args.dry_run:
        from qkv.training import step as step_mod

        step_mod.SYNC_FREE_DEVICES = ("cpu", "cuda")  # the CPU runs the update CUDA runs
        args.tiny, args.device, args.compile_backend = True, "cpu", "eager"
        args.steps, args.warmup, args.decode_len, args.decode_rounds = 2, 1, 6, 1
        args.budget = math.inf  # every section runs, whatever the CPU's speed
    if args.compile_backend != "inductor":
        use_backend(args.compile_backend)
    started = time.perf_counter()

    def left() -> float:
        return args.budget - (time.perf_counter() - started)

    s = TINY if args.tiny else BASE
    if args.max_tokens:
        s = dataclasses.replace(s, max_tokens=args.max_tokens)
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # as qkv train sets on CUDA: TF32 for float32 products
    n_pairs = min(args.pairs, 3000) if args.tiny else args.pairs
    if args.lengths_from:
        src_lens, tgt_lens = table_lengths(args.lengths_from, n_pairs, s.max_len, seed=1)
    else:
        src_lens, tgt_lens = wmt_like_lengths(n_pairs, s.max_len, seed=1)
    split = make_split(src_lens, tgt_lens, s.vocab, seed=1)
    seed = qkv_configs(s, "none", False, "cpu")[1].seed  # the trainer's batch order: its seed, epoch 0
    order = split.batches(s.max_tokens, shuffle=True, seed=seed, epoch=0)
    compiled_extra = 1 if args.dry_run else 3
    n_groups = args.warmup + compiled_extra + args.steps
    groups = [[order[i]] for i in range(n_groups)]  # one batch an update (one GPU, update_freq 1)
    timed = groups[-args.steps:]
    lens = [real_lengths(split, g) for g in timed]
    src_tok = float(sum(a.sum() for a, _ in lens))
    tgt_tok = float(sum(b.sum() for _, b in lens))
    flops = [3 * model_flops(a, b, s) for a, b in lens]
    padded = [(len(g[0]) * int(split.src.lengths[g[0]].max() + 1), len(g[0]) * int(split.tgt.lengths[g[0]].max() + 1))
              for g in timed]
    step_flops = statistics.median(flops)
    measured = matmul_tflops(args.device)
    peak, peak_source = peak_tflops(args.device, args.peak_tflops)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("QKV_COMMIT") or git_commit(), "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else
        platform.processor() or platform.machine(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "shapes": dataclasses.asdict(s),
        "command": " ".join(sys.argv), "lengths": str(args.lengths_from or "wmt-like log-normal (docstring)"),
        "timed_updates": args.steps, "warmup_updates": args.warmup,
        "mean_real_tokens_per_update": {"source": src_tok / args.steps, "target": tgt_tok / args.steps},
        "mean_padded_tokens_per_update": {"source": statistics.fmean(p[0] for p in padded),
                                          "target": statistics.fmean(p[1] for p in padded)},
        "mean_sentences_per_update": statistics.fmean(len(g[0]) for g in timed),
        "model_tflop_per_step": step_flops / 1e12, "peak_tflops": peak, "peak_source": peak_source,
        "measured_bf16_matmul_tflops": measured, "settings": [], "ablations": [], "decoding": [],
    }
    print(f"{report['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}; {args.steps} timed updates of "
          f"{src_tok / args.steps:,.0f} source + {tgt_tok / args.steps:,.0f} target real tokens "
          f"({report['mean_sentences_per_update']:.0f} sentences); {step_flops / 1e12:.2f} TFLOP an update; "
          f"8192^3 bf16 matmul {measured or 0:.0f} TFLOP/s", flush=True)

    def write():
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    def run(name: str, setting: dict) -> dict | None:
        warm = args.warmup + (compiled_extra if setting["compile"] else 0)
        use = groups[args.warmup + compiled_extra - warm:]  # the timed updates are the same for every setting
        if left() < (150 if setting["compile"] else 30):
            print(f"{name}: skipped (out of time)", flush=True)
            return {"setting": name, "skipped": "out of time"}
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            if setting["kind"] == "qkv":
                r = time_qkv(s, split, use, warm, setting, args.device, args.warmup + compiled_extra - warm)
            else:
                r = time_hf(s, split, use, warm, setting, args.device)
        except Exception as e:  # noqa: BLE001 - a setting that fails is recorded, the others still run
            traceback.print_exc()
            return {"setting": name, "skipped": f"{type(e).__name__}: {str(e)[:300]}"}
        if args.device.startswith("cuda"):
            r["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row = summarise(name, r, step_flops, src_tok, tgt_tok, peak, measured, args.steps)
        print(f"{name}: {row['median_step_s'] * 1000:.1f} ms/update, {row['target_tokens_per_s']:,.0f} target tok/s, "
              f"MFU {100 * row.get('mfu', 0):.1f}%, peak {row['peak_memory_gib'] or 0:.1f} GiB, "
              f"warm-up {row['warmup_s']:.1f} s", flush=True)
        return row

    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS] + [n for n in args.ablations.split(",") if n and n not in ABLATIONS]
    if unknown:
        ap.error(f"unknown setting or ablation: {', '.join(unknown)}")
    rows: dict[str, dict | None] = {}  # every row run, by name: each setting runs once

    def row(name: str, setting: dict | None = None) -> dict | None:
        if name not in rows:
            rows[name] = run(name, setting or SETTINGS.get(name) or EXTRA_ROWS[name])
            if name in SETTINGS:
                report["settings"].append(rows[name])
            write()
        return rows[name]

    def ablate(name: str) -> None:
        without, with_name = ABLATIONS[name]
        base_row = row(without) if isinstance(without, str) else row(f"{with_name} without {name}", without)
        with_row = row(with_name)
        entry = {"measure": name, "without": base_row, "with": with_name}
        if with_name not in SETTINGS:
            entry["with_row"] = with_row
        if base_row and "median_step_s" in base_row and with_row and "median_step_s" in with_row:
            entry["speedup"] = base_row["median_step_s"] / with_row["median_step_s"]
            print(f"ablation {name}: {entry['speedup']:.3f}x", flush=True)
        report["ablations"].append(entry)
        write()

    def compiles(name: str) -> bool:
        return any((SETTINGS.get(side) or {}).get("compile") for side in ABLATIONS[name] if isinstance(side, str))

    eager = [n for n in names if SETTINGS[n]["kind"] == "qkv" and not SETTINGS[n]["compile"]]
    wanted = [n for n in args.ablations.split(",") if n]
    for name in eager:  # qkv's eager settings, the ablations that compile nothing (cheap), what compiles and
        row(name)       # the peer, then the ablations that compare with what compiled
    for name in [n for n in wanted if not compiles(n)]:
        ablate(name)
    for name in [n for n in names if n not in eager]:
        row(name)
    for name in [n for n in wanted if compiles(n)]:
        ablate(name)
    if args.decode:
        report["decoding"] = decode_section(s, args.device, args.decode_len, args.decode_rounds,
                                            args.decode_engines.split(","), left)
        write()
    print_table(report)
    write()
    return 0


def print_table(report: dict) -> None:
    print("\n| setting | ms/update | target tok/s | source tok/s | MFU | peak GiB | 100k updates | 100k of 25k tok |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in report["settings"]:
        if "median_step_s" not in r:
            print(f"| {r['setting']} | {r.get('skipped')} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") else "-"
        print(f"| {r['setting']} | {1000 * r['median_step_s']:.1f} | {r['target_tokens_per_s']:,.0f} | "
              f"{r['source_tokens_per_s']:,.0f} | {mfu} | {mem} | {r['projected_hours_100k_steps']:.2f} h | "
              f"{r['projected_hours_100k_paper_updates']:.2f} h |")
    for a in report["ablations"]:
        print(f"ablation {a['measure']}: {a.get('speedup', float('nan')):.3f}x")
    for d in report["decoding"]:
        print(f"decode {d.get('engine')} beam {d.get('beam')}: "
              + (f"{d['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in d else d.get("skipped", "")))


if __name__ == "__main__":
    sys.exit(main())
