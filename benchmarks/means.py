"""Measure qkv's speed techniques ("the means"), each against its absence.

    python benchmarks/means.py [--threads 2] [--rounds 5] [--only fused,kvcache,...] [--quick]

Every mean is timed against the same computation without it, on the same machine, in the same
process, in interleaved rounds (A B, B A, ... so that drift in the machine's speed falls on both);
a row reports the median and the min-max over the rounds. "ratio" is how many times better the
mean is (baseline time / time with the mean; for throughputs with / baseline; for the padding
fraction baseline / with); the BLEU row gives the difference instead.

Sections (``--only``):

  fused     one (3d x d) Q/K/V projection vs three (d x d) ones with the same weights: self-attention
            forward+backward, and a whole training step (forward, loss, backward, clip, Adam) with
            every MultiHeadAttention switched to separate projections (cross-attention's fused K/V
            too) by replacing its entry points on the instance (benchmark only; the library is untouched)
  loss      the output projection and the label-smoothed loss fused, chunk by chunk
            (``linear_label_smoothed_nll_loss``, ``TrainConfig.fused_loss``) vs logits then loss:
            the projection + loss alone, and a whole training step, at the paper's vocabulary
            (``--loss-vocab``, 37,000) and at 8,000
  kvcache   cross-attention K/V projected once per sentence (``model.start``) vs re-projected from
            the encoder output at every step; and the self-attention KV cache vs re-running the
            decoder over the whole prefix at every step (greedy, fixed output length, tokens/s)
  beam      beam search / greedy that drop finished sentences from the batch vs keeping them
            (``drop_finished=False``), on the Multi30k model and test sentences (varied lengths)
  beamshare beam search (fixed output length, random weights; vocabulary base 37,000, small 8,000) whose
            k hypotheses of a sentence share its cross-attention K/V (``TransformerState.expand_beams``:
            the k rows attend as k queries of one sentence) vs a copy per hypothesis re-selected at
            every step; and the top 2k tokens per row before adding the beam scores vs scoring the
            whole (N, k*V) table with the length limits applied to every row (``force_eos``)
  bucket    length-bucketed token-budget batches (``token_budget_batches``) vs random batches cut by
            the same budget rule: padding fraction over a Multi30k epoch, training tokens/s
  inference ``torch.inference_mode`` vs ``torch.no_grad`` vs grad-enabled decoding
  int8      dynamic int8 quantisation (``qkv.load(..., quantize="int8")``): decoding speed (greedy and
            beam 5) and test_2016 BLEU of the Multi30k model, float32 vs int8 (with and without the
            tied output projection quantised); and fixed-length greedy at the base shapes
  amp       bf16 autocast vs float32: a training step and greedy decoding
  dropout   qkv's CPU dropout (``qkv.nn.dropout``: masks from 16-bit lanes of 64-bit random words) vs
            torch's ``F.dropout`` (and, for attention, SDPA's own dropout): one residual branch
            forward+backward, and a whole training step of recipes/multi30k/en-de.toml's model
            (d 128, 4+4 layers, dropout 0.3, attention dropout 0.1, vocabulary 6,000) on a batch of
            about 4,096 target tokens, torch's dropout put back by replacing the library's names
            during the baseline's calls (benchmark only)
  chunk     the fused projection + loss in chunks of about 2M logits (``qkv.losses.default_chunk``)
            vs 16M (before): forward+backward at V 6,000 (d 128, the recipe) and at ``--loss-vocab``
            (d 512), and the recipe's training step as in ``dropout``

Shapes: ``base`` is the paper's base model (d 512, h 8, d_ff 2048, 6+6 layers), ``small`` the
``small`` preset (d 256, 3+3), both with random weights and a vocabulary of 8,000 (the
speed of the means does not depend on what the weights learned; output lengths are fixed with
``min_len``). Trained-model rows use ``--model`` (runs/m30k-ende/best: d 128, h 4, d_ff 256,
4+4 layers, joint BPE 6,000) on Multi30k test_2016 (1,000 sentences; ``--sents`` takes fewer for
the speed rows). Results go to benchmarks/results/means-DATE.json (rows of the sections run
replace the same sections' rows in an existing file) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock


def _threads_from_argv() -> int:
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1 if "--quick" in sys.argv else 2


os.environ.setdefault("OMP_NUM_THREADS", str(_threads_from_argv()))  # before torch starts its pool

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import qkv  # noqa: E402
from qkv.frontends import quantize_int8  # noqa: E402
from qkv.config import BOS, EOS, ModelConfig, TrainConfig  # noqa: E402
from qkv.data.batching import Batch, collate, padding_fraction, token_budget_batches  # noqa: E402
from qkv.data.corpus import read_lines  # noqa: E402
from qkv.decoding import beam_search, greedy, max_output_len  # noqa: E402
from qkv.decoding.greedy import force_eos, log_probs  # noqa: E402
from qkv.metrics import bleu  # noqa: E402
from qkv.models import build_model  # noqa: E402
from qkv.models.transformer import TransformerState  # noqa: E402
from qkv.masks import causal_mask, combine  # noqa: E402
from qkv.nn.attention import KVCache, MultiHeadAttention, attention_reference  # noqa: E402
from qkv.tasks.base import token_loss  # noqa: E402
from qkv.losses import label_smoothed_nll_loss, linear_label_smoothed_nll_loss  # noqa: E402

beam_search_module = importlib.import_module("qkv.decoding.beam_search")  # the name qkv.decoding.beam_search is the function

SECTIONS = ("fused", "loss", "kvcache", "beam", "beamshare", "bucket", "inference", "int8", "amp", "dropout", "chunk")
SHAPES = {
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3),
    "tiny": dict(d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2),  # --quick
}
VOCAB = 8000
DECODE_VOCAB = {"base": 37000, "small": 8000}  # beamshare: the presets' vocabularies (as benchmarks/speed.py)
DATA = Path("/work/shared/data/multi30k")


# --- timing and rows ---------------------------------------------------------------------------------


def interleaved(cases: dict[str, callable], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each case over ``rounds`` rounds; the order rotates every round."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    names = list(cases)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        if r % 2:
            order = order[::-1]
        for k in order:
            t0 = time.perf_counter()
            cases[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def stat(values: list[float], unit: str, label: str, scale: float = 1.0) -> dict:
    v = [x * scale for x in values]
    return {"label": label, "unit": unit, "median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


ROWS: list[dict] = []


def add_row(section: str, what: str, shape: str, base: dict, with_: dict, kind: str = "time", note: str = "") -> dict:
    """kind: time (lower is better), rate (higher is better), padding (lower), bleu (difference)."""
    b, w = base["median"], with_["median"]
    if kind == "time":
        ratio = b / w
    elif kind == "rate":
        ratio = w / b
    elif kind == "padding":
        ratio = b / w if w else float("inf")
    else:
        ratio = w - b
    row = {"section": section, "what": what, "shape": shape, "baseline": base, "with": with_, "ratio": ratio,
           "ratio_kind": {"time": "speed-up", "rate": "speed-up", "padding": "x less padding",
                          "bleu": "BLEU difference"}[kind], "note": note}
    ROWS.append(row)
    print(f"  {what} [{shape}]: {fmt(base)} -> {fmt(with_)}  ({fmt_ratio(row)}){'  ' + note if note else ''}",
          file=sys.stderr, flush=True)
    return row


def fmt(s: dict) -> str:
    def num(x: float) -> str:
        if s["unit"] in ("%", "BLEU"):
            return f"{x:.2f}"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{num(s['median'])} {s['unit']}"
    return f"{num(s['median'])} {s['unit']} ({num(s['min'])}–{num(s['max'])})"


def fmt_ratio(row: dict) -> str:
    if row["ratio_kind"] == "BLEU difference":
        return f"{row['ratio']:+.2f} BLEU"
    return f"{row['ratio']:.2f}×"


def time_row(section, what, shape, times, base_key, with_key, base_label, with_label, note="") -> dict:
    return add_row(section, what, shape, stat(times[base_key], "ms", base_label, 1e3),
                   stat(times[with_key], "ms", with_label, 1e3), "time", note)


def rate_row(section, what, shape, times, base_key, with_key, base_label, with_label, work, note="",
             work_with=None) -> dict:
    """Throughput rows: ``work`` units (tokens) per call; ``work_with`` if the mean's case differs."""
    wb, ww = work, work if work_with is None else work_with
    return add_row(section, what, shape, stat([wb / t for t in times[base_key]], "tokens/s", base_label),
                   stat([ww / t for t in times[with_key]], "tokens/s", with_label), "rate", note)


# --- models and data -----------------------------------------------------------------------------------


def random_model(shape: str, vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(**SHAPES[shape], dropout=0.1, attention_dropout=0.1, src_vocab_size=vocab, tgt_vocab_size=vocab)
    return build_model(cfg)


def random_batch(batch: int, src_len: int, tgt_len: int, vocab: int = VOCAB, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (batch, src_len), generator=g).tolist()
    tgt = torch.randint(4, vocab, (batch, tgt_len), generator=g).tolist()
    return collate(src, tgt)


def train_step_fn(model: nn.Module, batch: Batch, amp: bool = False, fused_loss: bool = True):
    """One update as the trainer does it: forward, label-smoothed loss (by default fused with the
    output projection, as ``TrainConfig.fused_loss``), backward, clip, Adam."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    n = batch.n_tgt_tokens
    cfg = TrainConfig(label_smoothing=0.1, fused_loss=fused_loss)

    def step():
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = token_loss(model, (batch.src, batch.tgt_in), batch.tgt_out, cfg)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def load_trained(args) -> qkv.frontends.Translator | None:
    if not Path(args.model, "config.json").is_file():
        print(f"  (no trained model at {args.model}: skipped)", file=sys.stderr)
        return None
    return qkv.load(args.model)


def test_batches(translator, sentences: list[str], batch_size: int = 64) -> list[tuple[Tensor, Tensor]]:
    """The API's batching: tokenize, sort by length, cut into ``batch_size`` sentences."""
    ids = translator.tokenizers.src.encode(sentences)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = []
    cfg = translator.decode_cfg
    for start in range(0, len(order), batch_size):
        src = collate([ids[i] for i in order[start: start + batch_size]], None).src
        out.append((src, max_output_len((src != 0).sum(dim=1), cfg.max_len_a, cfg.max_len_b)))
    return out


class CountRows:
    """Passes start/step through and counts the rows fed to the model (row-steps)."""

    def __init__(self, model):
        self.model, self.rows, self.steps = model, 0, 0

    def start(self, src):
        return self.model.start(src)

    def step(self, tokens, state):
        self.rows += tokens.size(0)
        self.steps += 1
        return self.model.step(tokens, state)


# --- fused QKV (benchmark-only unfused attention) ---------------------------------------------------------


def _unfused_self_attention(self, x, mask=None, causal=False, cache=None, need_weights=False):
    """MultiHeadAttention.self_attention with three (d x d) projections instead of one (3d x d)."""
    q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
    if cache is not None:
        k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        cache = KVCache(k, v)
    out, weights = self._attend(q, k, v, mask, causal, need_weights)
    return out, cache, weights


def _unfused_cross_attention(self, x, memory_kv, mask=None, need_weights=False, beam=1):
    """MultiHeadAttention.cross_attention with its own W^Q (one row per sentence: no beam sharing)."""
    assert beam == 1, "the unfused benchmark attention decodes greedily"
    return self._attend(self._split(self.q_proj(x)), memory_kv.k, memory_kv.v, mask, False, need_weights)


def _unfused_project_kv(self, memory):
    return KVCache(self._split(self.k_proj(memory)), self._split(self.v_proj(memory)))


def unfuse(model: nn.Module) -> nn.Module:
    """A copy whose attention layers use separate W^Q, W^K, W^V (the same values) and no in_proj."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            d = m.d_model
            for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
                lin = nn.Linear(d, d)
                with torch.no_grad():
                    lin.weight.copy_(m.in_proj.weight[i * d: (i + 1) * d])
                    lin.bias.copy_(m.in_proj.bias[i * d: (i + 1) * d])
                setattr(m, name, lin)
            del m.in_proj
            m.self_attention = types.MethodType(_unfused_self_attention, m)
            m.cross_attention = types.MethodType(_unfused_cross_attention, m)
            m.project_kv = types.MethodType(_unfused_project_kv, m)
    return model


def bench_fused(args) -> None:
    for shape in args.shapes:
        d, h = SHAPES[shape]["d_model"], SHAPES[shape]["n_heads"]
        torch.manual_seed(0)
        mha = MultiHeadAttention(d, h, dropout=0.0).train()
        sep = unfuse(nn.ModuleList([mha]))[0]
        x = torch.randn(args.train_batch, args.train_len, d)
        with torch.no_grad():
            assert torch.allclose(mha.self_attention(x)[0], sep.self_attention(x)[0], atol=1e-5), \
                "unfused attention differs"
        reps = args.attn_reps

        def fwd_bwd(m):
            def run():
                for _ in range(reps):
                    xi = x.detach().requires_grad_()
                    out, _, _ = m.self_attention(xi, causal=True)
                    out.sum().backward()
                    m.zero_grad(set_to_none=True)
            return run

        t = interleaved({"sep": fwd_bwd(sep), "fused": fwd_bwd(mha)}, args.rounds)
        t = {k: [v / reps for v in vs] for k, vs in t.items()}
        time_row("fused", f"fused QKV: self-attention forward+backward, x ({args.train_batch}, {args.train_len}, {d})",
                 shape, t, "sep", "fused", "3 projections (d x d)", "1 projection (3d x d)")

        model = random_model(shape)
        un = unfuse(model)
        batch = random_batch(args.train_batch, args.train_len, args.train_len)
        model.eval(), un.eval()
        with torch.no_grad():
            assert torch.allclose(model(batch.src, batch.tgt_in), un(batch.src, batch.tgt_in), atol=1e-4)
        t = interleaved({"sep": train_step_fn(un, batch), "fused": train_step_fn(model, batch)},
                        args.train_rounds)
        rate_row("fused", f"fused QKV: training step, {args.train_batch} x {args.train_len} tokens per side", shape,
                 t, "sep", "fused", "3 projections", "fused", batch.n_tgt_tokens,
                 note="tokens/s = target tokens per second")

        # decoding: one position per step, so each projection is a small (B x d) matmul
        model = random_model(shape).eval()  # fresh: the training steps above moved the two apart
        un = unfuse(model).eval()
        src = random_batch(args.dec_batch, args.dec_src_len, 1, seed=1).src
        assert greedy(un, src, args.dec_len, min_len=args.dec_len) == greedy(model, src, args.dec_len,
                                                                             min_len=args.dec_len)
        t = interleaved({"sep": fixed_greedy(un, src, args.dec_len), "fused": fixed_greedy(model, src, args.dec_len)},
                        args.rounds)
        rate_row("fused", f"fused QKV: greedy, {args.dec_batch} x {args.dec_src_len} -> {args.dec_len} tokens", shape,
                 t, "sep", "fused", "3 projections", "fused", args.dec_batch * args.dec_len, note="identical outputs")


# --- K/V caches (benchmark-only recomputing decoders) -----------------------------------------------------


@dataclass
class _MemoryState:
    inner: TransformerState  # its cross_kv is empty: re-projected at every step
    memory: Tensor  # (B, S, d)

    def reorder(self, idx: Tensor) -> "_MemoryState":
        return _MemoryState(self.inner.reorder(idx), self.memory.index_select(0, idx))


class RecomputeCrossKV:
    """The model with cross-attention K/V re-projected from the encoder output at every step."""

    def __init__(self, model):
        self.model = model

    def start(self, src: Tensor) -> _MemoryState:
        memory, mask, _ = self.model.encode(src)
        b, cfg = src.size(0), self.model.cfg
        empty = memory.new_zeros(b, cfg.n_heads, 0, cfg.d_k)
        return _MemoryState(TransformerState(mask, [], [KVCache(empty, empty)] * cfg.n_decoder_layers, 0), memory)

    def step(self, tokens: Tensor, state: _MemoryState):
        cross = [layer.cross_attn.project_kv(state.memory) for layer in self.model.decoder_layers]
        logits, inner = self.model.step(tokens, replace(state.inner, cross_kv=cross))
        return logits, _MemoryState(replace(inner, cross_kv=[]), state.memory)


@dataclass
class _PrefixState:
    memory_mask: Tensor
    cross_kv: list[KVCache]
    prefix: Tensor  # (B, t) tokens fed so far, BOS first

    def reorder(self, idx: Tensor) -> "_PrefixState":
        return _PrefixState(self.memory_mask.index_select(0, idx), [kv.reorder(idx) for kv in self.cross_kv],
                            self.prefix.index_select(0, idx))


class RecomputePrefix:
    """No self-attention cache: every step re-runs the decoder over the whole prefix (cross-attention
    K/V still computed once), and projects only the last position to the vocabulary."""

    def __init__(self, model):
        self.model = model

    def start(self, src: Tensor) -> _PrefixState:
        st = self.model.start(src)
        return _PrefixState(st.memory_mask, st.cross_kv, src.new_zeros(src.size(0), 0))

    def step(self, tokens: Tensor, state: _PrefixState):
        m = self.model
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # (B, t+1)
        x, _, _ = m.decoder(prefix, memory_kv=state.cross_kv, memory_mask=state.memory_mask)  # causal over it
        logits = m._logits(x[:, -1:])[:, 0]
        return logits, _PrefixState(state.memory_mask, state.cross_kv, prefix)


def fixed_greedy(model, src: Tensor, length: int, fn=greedy, **kw):
    return lambda: fn(model, src, length, min_len=length, **kw)


def bench_kvcache(args) -> None:
    for shape in args.shapes:
        model = random_model(shape).eval()
        src = random_batch(args.dec_batch, args.dec_src_len, 1, seed=1).src
        n_tok = args.dec_batch * args.dec_len
        ref = greedy(model, src, args.dec_len, min_len=args.dec_len)
        for wrapper in (RecomputeCrossKV(model), RecomputePrefix(model)):
            same = greedy(wrapper, src, args.dec_len, min_len=args.dec_len) == ref
            assert same, f"{type(wrapper).__name__} decodes differently"
        t = interleaved({"cross_re": fixed_greedy(RecomputeCrossKV(model), src, args.dec_len),
                         "self_re": fixed_greedy(RecomputePrefix(model), src, args.dec_len),
                         "cached": fixed_greedy(model, src, args.dec_len)}, args.rounds)
        desc = f"greedy, {args.dec_batch} sentences x {args.dec_src_len} source -> {args.dec_len} tokens"
        rate_row("kvcache", f"cached cross-attention K/V ({desc})", shape, t, "cross_re", "cached",
                 "re-projected every step", "projected once", n_tok, note="identical outputs")
        rate_row("kvcache", f"self-attention KV cache ({desc})", shape, t, "self_re", "cached",
                 "decoder re-run over the prefix", "KV cache", n_tok, note="identical outputs")


# --- beam search dropping finished hypotheses --------------------------------------------------------------


def bench_beam(args) -> None:
    tr = load_trained(args)
    if tr is None:
        return
    sents = read_lines(args.src_test)[: args.sents]
    batches = test_batches(tr, sents)
    model, alpha = tr.model, tr.decode_cfg.length_penalty

    def run(beam: int, drop: bool, m=model):
        def go():
            out = []
            for src, max_len in batches:
                if beam == 1:
                    out += greedy(m, src, max_len, drop_finished=drop)
                else:
                    out += [h[0].tokens for h in beam_search(m, src, beam, alpha, max_len, drop_finished=drop)]
            return out
        return go

    for beam in (args.beam, 1):
        counts = {}
        outs = {}
        for drop in (False, True):
            c = CountRows(model)
            outs[drop] = run(beam, drop, c)()
            counts[drop] = c.rows
        same = sum(a == b for a, b in zip(outs[False], outs[True]))
        t = interleaved({"keep": run(beam, False), "drop": run(beam, True)}, args.beam_rounds)
        n_tok = sum(len(o) + 1 for o in outs[True])  # emitted tokens, EOS included
        name = "greedy" if beam == 1 else f"beam {beam}"
        rate_row("beam", f"{name} drops finished sentences (Multi30k test_2016, {len(sents)} sentences, batches of 64)",
                 "m30k", t, "keep", "drop", "kept in the batch", "dropped", n_tok,
                 note=f"row-steps {counts[False]:,} -> {counts[True]:,} ({counts[True] / counts[False]:.0%}); "
                      f"identical output {same}/{len(sents)}")


# --- beam search: the source side kept per sentence, candidates without the k x V table ------------------


@dataclass
class _PerRowState:
    """A Transformer state without ``expand_beams``: beam search then gives every hypothesis its own
    copy of the cross-attention keys/values and source mask (``reorder(repeat_interleave)``), which
    every ``reorder`` copies again, as before the mean."""

    inner: TransformerState

    def reorder(self, idx: Tensor) -> "_PerRowState":
        return _PerRowState(self.inner.reorder(idx))


class PerRowCrossKV:
    """The model, with the per-hypothesis copies of the source side (see :class:`_PerRowState`)."""

    def __init__(self, model):
        self.model = model

    def start(self, src: Tensor) -> _PerRowState:
        return _PerRowState(self.model.start(src))

    def step(self, tokens: Tensor, state: _PerRowState):
        logits, inner = self.model.step(tokens, state.inner)
        return logits, _PerRowState(inner)


def full_table_candidates(scores: Tensor, logits: Tensor, n_cand: int, at_limit: Tensor, before_min_len: bool):
    """Before the mean: the length limits applied to the whole (N*k, V) log-prob table (greedy's
    ``force_eos``), every extension scored, the top ``n_cand`` of the (N, k*V) table."""
    n, k = scores.shape
    logp = force_eos(log_probs(logits), at_limit.repeat_interleave(k), before_min_len)  # (N*k, V)
    total = (scores.unsqueeze(2) + logp.view(n, k, -1)).view(n, -1)  # (N, k*V)
    top, idx = total.topk(min(n_cand, total.size(1)), dim=1)
    return beam_search_module._Candidates(top, idx // logp.size(1), idx % logp.size(1))


def bench_beamshare(args) -> None:
    for shape in args.shapes:
        vocab = DECODE_VOCAB.get(shape, VOCAB)
        model = random_model(shape, vocab).eval()
        src = random_batch(args.dec_batch, args.dec_src_len, 1, vocab, seed=1).src
        n, k = args.dec_len, args.beam

        def run(m, full_table: bool = False):
            def go():
                with (mock.patch.object(beam_search_module, "_top_candidates", full_table_candidates)
                      if full_table else contextlib.nullcontext()):
                    return [h[0].tokens for h in beam_search(m, src, k, 0.6, n, min_len=n)]
            return go

        cases = {"before": run(PerRowCrossKV(model), full_table=True), "per_row": run(PerRowCrossKV(model)),
                 "shared": run(model)}
        outs = {name: fn() for name, fn in cases.items()}
        same = sum(a == b == c for a, b, c in zip(*outs.values()))
        t = interleaved(cases, args.beam_rounds)
        desc = f"beam {k}, {args.dec_batch} sentences x {args.dec_src_len} source -> {n} tokens, vocab {vocab:,}"
        note = f"identical output {same}/{args.dec_batch}"
        n_tok = args.dec_batch * (n + 1)
        rate_row("beamshare", f"cross-attention K/V once per sentence, not per hypothesis ({desc})", shape, t,
                 "per_row", "shared", "copied per hypothesis", "per sentence", n_tok, note=note)
        rate_row("beamshare", f"top 2k tokens per row, not the k x V table ({desc})", shape, t,
                 "before", "per_row", "k x V table", "top 2k per row", n_tok, note=note)
        rate_row("beamshare", f"both ({desc})", shape, t, "before", "shared", "before", "both", n_tok, note=note)


# --- length-bucketed batching ------------------------------------------------------------------------------


def random_budget_batches(src_lens, tgt_lens, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """The same cut rule as token_budget_batches (padded size <= max_tokens per side), no sort."""
    order = list(range(len(src_lens)))
    random.Random(seed).shuffle(order)
    batches, batch, ls, lt = [], [], 0, 0
    for i in order:
        s, t = max(ls, src_lens[i] + 1), max(lt, tgt_lens[i] + 1)
        if batch and ((len(batch) + 1) * s > max_tokens or (len(batch) + 1) * t > max_tokens):
            batches.append(batch)
            batch, s, t = [], src_lens[i] + 1, tgt_lens[i] + 1
        batch.append(i)
        ls, lt = s, t
    if batch:
        batches.append(batch)
    return batches


def bench_bucket(args) -> None:
    if not Path(args.model, "config.json").is_file():
        print(f"  (no trained model at {args.model} for its tokenizer and shape: skipped)", file=sys.stderr)
        return
    tr = qkv.load(args.model)
    src_txt, tgt_txt = read_lines(DATA / "train.en.gz"), read_lines(DATA / "train.de.gz")
    src_ids, tgt_ids = tr.tokenizers.src.encode(src_txt), tr.tokenizers.tgt.encode(tgt_txt)
    src_lens, tgt_lens = [len(s) for s in src_ids], [len(t) for t in tgt_ids]
    budget = args.max_tokens
    bucketed = token_budget_batches(src_lens, tgt_lens, budget, shuffle=True, seed=1)
    rand = random_budget_batches(src_lens, tgt_lens, budget, seed=1)
    pb, pr = padding_fraction(bucketed, src_lens, tgt_lens), padding_fraction(rand, src_lens, tgt_lens)
    one = lambda p, label: {"label": label, "unit": "%", "median": 100 * p, "min": 100 * p, "max": 100 * p, "n": 1}  # noqa: E731
    add_row("bucket", f"length-bucketed batching: padding fraction, Multi30k train ({len(src_lens):,} pairs), "
            f"token budget {budget}", "m30k", one(pr, f"random ({len(rand)} batches)"),
            one(pb, f"bucketed ({len(bucketed)} batches)"), "padding",
            note="share of PAD among all batch positions, source and target")

    # training throughput on a sample of each scheme's batches (a fresh model of the trained one's shape)
    torch.manual_seed(0)
    model = build_model(tr.model.cfg)
    rng = random.Random(0)
    samples = {"random": rng.sample(rand, args.bucket_batches), "bucketed": rng.sample(bucketed, args.bucket_batches)}
    data = {k: [collate([src_ids[i] for i in b], [tgt_ids[i] for i in b]) for b in v] for k, v in samples.items()}
    steps = {k: [train_step_fn(model, b) for b in v] for k, v in data.items()}
    work = {k: sum(b.n_tgt_tokens for b in v) for k, v in data.items()}
    t = interleaved({k: (lambda fs=fs: [f() for f in fs]) for k, fs in steps.items()}, args.bucket_rounds)
    rate_row("bucket", f"length-bucketed batching: training tokens/s, {args.bucket_batches} batches of each "
             f"(budget {budget})", "m30k", t, "random", "bucketed", "random batches", "bucketed",
             work["random"], work_with=work["bucketed"],
             note=f"target tokens per batch {work['random'] / args.bucket_batches:.0f} vs "
                  f"{work['bucketed'] / args.bucket_batches:.0f}")


# --- inference mode ----------------------------------------------------------------------------------------


def bench_inference(args) -> None:
    raw = greedy.__wrapped__  # greedy without its @torch.inference_mode()

    def under(ctx, model, src):
        def go():
            with ctx():
                return raw(model, src, args.dec_len, min_len=args.dec_len)
        return go

    for shape in args.shapes:
        model = random_model(shape).eval()
        src = random_batch(args.dec_batch, args.dec_src_len, 1, seed=1).src
        n_tok = args.dec_batch * args.dec_len
        t = interleaved({"grad": under(torch.enable_grad, model, src), "no_grad": under(torch.no_grad, model, src),
                         "inference": under(torch.inference_mode, model, src)}, args.rounds)
        desc = f"greedy, {args.dec_batch} x {args.dec_src_len} -> {args.dec_len} tokens"
        rate_row("inference", f"torch.inference_mode vs grad-enabled decoding ({desc})", shape, t, "grad", "inference",
                 "grad enabled", "inference_mode", n_tok)
        rate_row("inference", f"torch.inference_mode vs torch.no_grad ({desc})", shape, t, "no_grad", "inference",
                 "no_grad", "inference_mode", n_tok)


# --- int8 ------------------------------------------------------------------------------------------------


def bench_int8(args) -> None:
    for shape in args.shapes:
        model = random_model(shape).eval()
        q = quantize_int8(copy.deepcopy(model))
        q_lin = quantize_int8(copy.deepcopy(model), output_projection=False)
        src = random_batch(args.dec_batch, args.dec_src_len, 1, seed=1).src
        n_tok = args.dec_batch * args.dec_len
        t = interleaved({"fp32": fixed_greedy(model, src, args.dec_len), "int8": fixed_greedy(q, src, args.dec_len),
                         "int8_lin": fixed_greedy(q_lin, src, args.dec_len)}, args.rounds)
        what = f"int8 dynamic quantisation: greedy, {args.dec_batch} x {args.dec_src_len} -> {args.dec_len} tokens"
        rate_row("int8", what + " (all linears + tied output projection)", shape, t, "fp32", "int8", "float32",
                 "int8", n_tok)
        rate_row("int8", what + " (nn.Linear layers only)", shape, t, "fp32", "int8_lin", "float32",
                 "int8, output projection float", n_tok)

    tr = load_trained(args)
    if tr is None:
        return
    float_model = tr.model
    full = quantize_int8(copy.deepcopy(float_model))
    linear_only = quantize_int8(copy.deepcopy(float_model), output_projection=False)
    sents = read_lines(args.src_test)[: args.sents]
    batches = test_batches(tr, sents)
    alpha = tr.decode_cfg.length_penalty

    def run(m, beam):
        def go():
            n = 0
            for src, max_len in batches:
                if beam == 1:
                    n += sum(len(o) + 1 for o in greedy(m, src, max_len))
                else:
                    n += sum(len(h[0].tokens) + 1 for h in beam_search(m, src, beam, alpha, max_len))
            return n
        return go

    for beam in (1, args.beam):
        n_tok = run(float_model, beam)()
        t = interleaved({"fp32": run(float_model, beam), "int8": run(full, beam), "int8_lin": run(linear_only, beam)},
                        args.beam_rounds)
        name = "greedy" if beam == 1 else f"beam {beam}"
        what = f"int8 dynamic quantisation: {name}, Multi30k test_2016, {len(sents)} sentences, batches of 64"
        rate_row("int8", what + " (all linears + tied output projection)", "m30k", t, "fp32", "int8",
                 "float32", "int8", n_tok, note="tokens/s counted on the float model's output")
        rate_row("int8", what + " (nn.Linear layers only)", "m30k", t, "fp32", "int8_lin", "float32",
                 "int8, output projection float", n_tok)

    # BLEU of the whole test set, the model's own decoding settings
    src_all, refs = read_lines(args.src_test)[: args.bleu_sents], read_lines(args.ref_test)[: args.bleu_sents]
    scores, secs = {}, {}
    for name, m in (("fp32", float_model), ("int8", full), ("int8_lin", linear_only)):
        tr.model = m
        t0 = time.perf_counter()
        hyps = tr.translate(src_all)
        secs[name] = time.perf_counter() - t0
        scores[name] = bleu(hyps, refs)
    tr.model = float_model
    cfg = tr.decode_cfg
    one = lambda name, label: {"label": label, "unit": "BLEU", "median": scores[name].score,  # noqa: E731
                               "min": scores[name].score, "max": scores[name].score, "n": 1,
                               "seconds": secs[name], "summary": scores[name].summary,
                               "signature": scores[name].signature}
    for key, label in (("int8", "int8 (all linears + output projection)"), ("int8_lin", "int8 (nn.Linear only)")):
        add_row("int8", f"int8 BLEU cost: Multi30k test_2016 ({len(src_all)} sentences), beam {cfg.beam_size}, "
                f"alpha {cfg.length_penalty}", "m30k", one("fp32", "float32"), one(key, label), "bleu",
                note=f"sacreBLEU {scores['fp32'].signature}; translate() wall time {secs['fp32']:.0f} s -> "
                     f"{secs[key]:.0f} s (one run each)")


# --- fused output projection + loss ---------------------------------------------------------------------


def bench_loss(args) -> None:
    for shape in args.shapes:
        d = SHAPES[shape]["d_model"]
        for vocab in (args.loss_vocab, VOCAB):
            torch.manual_seed(0)
            n = args.loss_tokens
            hidden = torch.randn(n, d, requires_grad=True)
            weight = (torch.randn(vocab, d) * d**-0.5).requires_grad_()
            target = torch.randint(4, vocab, (n,))

            def block(fused: bool):
                def run():
                    if fused:
                        loss, _ = linear_label_smoothed_nll_loss(hidden, weight, target, 0.1)
                    else:
                        loss, _ = label_smoothed_nll_loss(F.linear(hidden, weight), target, 0.1)
                    (loss / n).backward()
                    hidden.grad = weight.grad = None
                return run

            t = interleaved({"logits": block(False), "fused": block(True)}, args.train_rounds)
            time_row("loss", f"fused projection + loss, forward+backward, {n} tokens x V {vocab:,}", shape, t,
                     "logits", "fused", "logits, then log_softmax loss", "fused, chunked")
            model = random_model(shape, vocab=vocab)
            batch = random_batch(args.train_batch, args.train_len, args.train_len, vocab=vocab)
            t = interleaved({"logits": train_step_fn(model, batch, fused_loss=False),
                             "fused": train_step_fn(model, batch, fused_loss=True)}, args.train_rounds)
            rate_row("loss", f"fused projection + loss: training step, {args.train_batch} x {args.train_len} tokens "
                     f"per side, V {vocab:,}", shape, t, "logits", "fused", "logits, then loss", "fused",
                     batch.n_tgt_tokens, note="tokens/s = target tokens per second")


# --- dropout masks (benchmark-only: torch's dropout put back) ---------------------------------------------


def _torch_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    return F.dropout(x, p, training)


def _sdpa_with_torch_dropout(q, k, v, mask=None, dropout_p=0.0, is_causal=False, need_weights=False):
    """qkv.nn.attention.scaled_dot_product_attention as it was before qkv's CPU dropout: SDPA draws
    the attention dropout itself."""
    if need_weights:
        return attention_reference(q, k, v, mask, dropout_p, is_causal)
    if is_causal and (mask is not None or q.size(-2) != k.size(-2)):
        mask, is_causal = combine(mask, causal_mask(q.size(-2), k.size(-2), q.device)), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal), None


@contextlib.contextmanager
def torch_dropout():
    """The library's dropout calls made with torch's own while inside."""
    patches = [mock.patch(f"qkv.nn.{m}.dropout", _torch_dropout) for m in ("layers", "stack", "feed_forward", "attention")]
    patches.append(mock.patch("qkv.nn.attention.scaled_dot_product_attention", _sdpa_with_torch_dropout))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def recipe_model_and_batch(args) -> tuple[nn.Module, Batch]:
    """recipes/multi30k/en-de.toml's model (random weights) and a batch of about 4,096 target tokens."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_heads=4, d_ff=256, n_encoder_layers=4, n_decoder_layers=4, dropout=0.3,
                      attention_dropout=0.1, src_vocab_size=6000, tgt_vocab_size=6000, init="fairseq")
    return build_model(cfg), random_batch(args.drop_batch, args.drop_len, args.drop_len, vocab=6000)


def bench_dropout(args) -> None:
    from qkv.nn.dropout import dropout

    x = torch.randn(args.drop_batch, args.drop_len, 128, requires_grad=True)
    g = torch.randn_like(x)

    def branch(fn):
        def run():
            for _ in range(args.attn_reps):
                fn(x, 0.3).backward(g)
        return run

    t = interleaved({"torch": branch(_torch_dropout), "qkv": branch(dropout)}, args.rounds)
    t = {k: [v / args.attn_reps for v in vs] for k, vs in t.items()}
    time_row("dropout", f"dropout p 0.3, forward+backward, x ({args.drop_batch}, {args.drop_len}, 128)", "recipe", t,
             "torch", "qkv", "F.dropout", "qkv.nn.dropout")

    model, batch = recipe_model_and_batch(args)
    step = train_step_fn(model, batch)

    def baseline():
        with torch_dropout():
            step()

    with mock.patch("qkv.nn.dropout.keep_mask", side_effect=AssertionError("qkv's dropout ran in the baseline")):
        baseline()  # every dropout of the baseline is torch's
    t = interleaved({"torch": baseline, "qkv": step}, args.train_rounds)
    rate_row("dropout", f"dropout: training step, {args.drop_batch} x {args.drop_len} tokens per side", "recipe",
             t, "torch", "qkv", "torch's dropout", "qkv's", batch.n_tgt_tokens, note="tokens/s = target tokens per second")


# --- loss chunks sized for the cache ------------------------------------------------------------------------


def bench_chunk(args) -> None:
    from qkv import losses

    old = lambda vocab, d: max(1, losses.CHUNK_MAX_ELEMENTS // vocab)  # noqa: E731  before: 2^24 logits a chunk
    for vocab, d, n in ((6000, 128, 4000), (args.loss_vocab, 512, args.loss_tokens)):
        torch.manual_seed(0)
        hidden = torch.randn(n, d, requires_grad=True)
        weight = (torch.randn(vocab, d) * d**-0.5).requires_grad_()
        target = torch.randint(4, vocab, (n,))

        def block(chunk):
            def run():
                loss, _ = linear_label_smoothed_nll_loss(hidden, weight, target, 0.1, chunk=chunk)
                (loss / n).backward()
                hidden.grad = weight.grad = None
            return run

        t = interleaved({"old": block(old(vocab, d)), "new": block(losses.default_chunk(vocab, d))}, args.train_rounds)
        time_row("chunk", f"fused projection + loss, forward+backward, {n} tokens x V {vocab:,}, d {d}", "-", t, "old", "new",
                 f"{old(vocab, d)} rows a chunk", f"{losses.default_chunk(vocab, d)} rows (default_chunk)")

    model, batch = recipe_model_and_batch(args)
    step = train_step_fn(model, batch)

    def before():
        with mock.patch("qkv.losses.default_chunk", old):
            step()

    t = interleaved({"old": before, "new": step}, args.train_rounds)
    rate_row("chunk", f"loss chunks: training step, {args.drop_batch} x {args.drop_len} tokens per side", "recipe",
             t, "old", "new", f"{old(6000, 128)} rows", f"{losses.default_chunk(6000, 128)} rows", batch.n_tgt_tokens,
             note="tokens/s = target tokens per second")


# --- mixed precision -----------------------------------------------------------------------------------------


def bench_amp(args) -> None:
    for shape in args.shapes:
        model = random_model(shape)
        batch = random_batch(args.train_batch, args.train_len, args.train_len)
        t = interleaved({"fp32": train_step_fn(model, batch), "bf16": train_step_fn(model, batch, amp=True)},
                        args.train_rounds)
        rate_row("amp", f"bf16 autocast: training step, {args.train_batch} x {args.train_len} tokens per side", shape,
                 t, "fp32", "bf16", "float32", "bf16 autocast", batch.n_tgt_tokens)
        model.eval()
        src = random_batch(args.dec_batch, args.dec_src_len, 1, seed=1).src

        def dec(amp):
            def go():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    return greedy(model, src, args.dec_len, min_len=args.dec_len)
            return go

        same = sum(a == b for a, b in zip(dec(False)(), dec(True)()))
        t = interleaved({"fp32": dec(False), "bf16": dec(True)}, args.rounds)
        rate_row("amp", f"bf16 autocast: greedy, {args.dec_batch} x {args.dec_src_len} -> {args.dec_len} tokens",
                 shape, t, "fp32", "bf16", "float32", "bf16 autocast", args.dec_batch * args.dec_len,
                 note=f"identical greedy output {same}/{args.dec_batch} (random weights)")


# --- main -------------------------------------------------------------------------------------------------------


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) so far: the difference
    over a section shows whether other processes competed for the cores meanwhile."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system


def machine() -> dict:
    flags, name = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx": any(f.startswith("amx") for f in flags), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "quantized_engine": torch.backends.quantized.engine, "loadavg_at_start": os.getloadavg()}


def markdown(rows: list[dict]) -> str:
    lines = ["| what | shape | baseline | with the mean | ratio |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['shape']} | {r['baseline']['label']}: {fmt(r['baseline'])} | "
                     f"{r['with']['label']}: {fmt(r['with'])} | {fmt_ratio(r)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2; 1 with --quick)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds for the cheap cases")
    ap.add_argument("--train-rounds", type=int, default=5, help="rounds for training steps")
    ap.add_argument("--beam-rounds", type=int, default=5, help="rounds for the Multi30k decoding passes")
    ap.add_argument("--bucket-rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default="base,small", help="random-weight shapes: base, small")
    ap.add_argument("--model", default="runs/m30k-ende/best", help="the trained Multi30k checkpoint")
    ap.add_argument("--src-test", default=str(DATA / "test_2016_flickr.en.gz"))
    ap.add_argument("--ref-test", default=str(DATA / "test_2016_flickr.de.gz"))
    ap.add_argument("--sents", type=int, default=1000, help="test sentences for the decoding-speed rows (all: 1000)")
    ap.add_argument("--bleu-sents", type=int, default=None, help="test sentences for BLEU (default: all)")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--train-batch", type=int, default=32)
    ap.add_argument("--loss-vocab", type=int, default=37000, help="vocabulary of the loss rows (the paper's En-De)")
    ap.add_argument("--loss-tokens", type=int, default=3072, help="target tokens of the projection + loss rows")
    ap.add_argument("--train-len", type=int, default=25)
    ap.add_argument("--attn-reps", type=int, default=10)
    ap.add_argument("--dec-batch", type=int, default=16)
    ap.add_argument("--dec-src-len", type=int, default=24)
    ap.add_argument("--dec-len", type=int, default=32)
    ap.add_argument("--drop-batch", type=int, default=256, help="sentences of the dropout rows' batch")
    ap.add_argument("--drop-len", type=int, default=16, help="tokens per side of the dropout rows' sentences")
    ap.add_argument("--max-tokens", type=int, default=4096, help="token budget for the bucketing rows")
    ap.add_argument("--bucket-batches", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny shapes, one round, few sentences")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/means-DATE.json)")
    args = ap.parse_args()
    if args.quick:
        args.shapes = "tiny"
        args.rounds = args.train_rounds = args.beam_rounds = args.bucket_rounds = 1
        args.loss_vocab, args.loss_tokens = 500, 64
        args.drop_batch = 16
        args.sents, args.train_batch, args.attn_reps, args.dec_batch, args.dec_len, args.bucket_batches = 32, 8, 2, 4, 8, 2
        args.bleu_sents = args.bleu_sents or 50
    args.threads = args.threads or (1 if args.quick else 2)
    args.shapes = args.shapes.split(",")
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine()
    print(f"machine: {info}", file=sys.stderr)
    started = time.perf_counter()
    foreign = {}
    for section in only:
        print(f"[{section}]", file=sys.stderr, flush=True)
        t0, c0 = time.perf_counter(), cpu_seconds()
        globals()[f"bench_{section}"](args)
        wall, (busy, mine) = time.perf_counter() - t0, [b - a for a, b in zip(c0, cpu_seconds())]
        foreign[section] = max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))
        print(f"  ({wall:.0f} s; CPU used by other processes meanwhile: {foreign[section]:.0%} of the machine)",
              file=sys.stderr, flush=True)

    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    default = "/tmp/means-quick.json" if args.quick else f"benchmarks/results/means-{today}.json"
    out = Path(args.out or default)
    for r in ROWS:
        r["foreign_cpu"] = round(foreign[r["section"]], 3)
    rows = ROWS
    old_foreign, old_runs = {}, []
    this_run = {"command": " ".join(["python", *sys.argv]), "sections": only, "commit": commit,
                "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if out.is_file() and not args.quick:  # keep the other sections' rows of an earlier run
        old = json.loads(out.read_text(encoding="utf-8"))
        old_foreign, old_runs = old.get("foreign_cpu_by_section", {}), old.get("runs", [])
        rows = [r for r in old.get("rows", []) if r["section"] not in only] + ROWS
        rows.sort(key=lambda r: SECTIONS.index(r["section"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": today, "commit": commit,
        "machine": info, "settings": {k: v for k, v in vars(args).items()}, "rows": rows,
        "seconds": time.perf_counter() - started, "loadavg_at_end": os.getloadavg(),
        "foreign_cpu_by_section": {**old_foreign, **foreign}, "runs": old_runs + [this_run],
    }, indent=1) + "\n", encoding="utf-8")
    print(markdown(rows))
    print(f"\n{len(ROWS)} rows in {time.perf_counter() - started:.0f} s -> {out}; machine {info['cpu']}, "
          f"{info['threads']} threads, torch {info['torch']}; date {today}; commit {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
