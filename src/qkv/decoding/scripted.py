"""Greedy decoding of a Transformer with the loop in TorchScript: the same search, less Python.

:func:`qkv.decoding.greedy.greedy` runs each step through Python: the state's dataclasses and
caches, the per-layer calls, the bookkeeping of finished sentences. With a small model on a CPU
that costs as much as the arithmetic. Here the whole loop runs in the TorchScript interpreter:

* the step is :meth:`~qkv.models.transformer.Transformer.static_step` traced once per model
  (``torch.jit.trace``) with ``self_bias=None``: the self-attention keys/values live in buffers of
  as many positions as the batch may decode, and step ``t`` reads views of positions ``0 .. t``,
  the position written in place. Those are the tensors and operations of the eager step
  (:meth:`~qkv.models.transformer.Transformer.step`), so the logits are the same bit for bit;
* the loop around it (:class:`_GreedyLoop`, ``torch.jit.script``) is that of
  :func:`~qkv.decoding.greedy._greedy`: the banned ids, ``min_len``, the length limits, the sum of
  the log-probabilities in float64, and finished sentences dropped from the batch as they end. The
  tokens and scores are the eager loop's.

The encoder runs eagerly (:meth:`~qkv.models.transformer.Transformer.start`), once per batch.

It applies (:func:`scripted_greedy_applies`) to a :class:`~qkv.models.transformer.Transformer`
encoder-decoder on the CPU in eval mode, with plain (not quantised) weights; anything else — a GPU,
a recurrent or decoder-only model, an ensemble, the compiled step
(:class:`qkv.decoding.compiled.CompiledDecoder`), a quantised model, ``drop_finished=False`` —
decodes with the eager loop. ``DecodeConfig.scripted_greedy = False`` turns it off.

TorchScript is deprecated in recent torch releases but present (from 2.4, the oldest qkv supports,
to 2.13, the one tested here): ``torch.jit.trace`` and ``torch.jit.script`` warn so
(``DeprecationWarning``) when called; those warnings, and the tracer's, are silenced here, the one
place that uses them, while a model's loop is built (once per model and weights). Running the
built loop warns nothing.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import List, Tuple

import torch
from torch import Tensor

from qkv.config import BOS, EOS
from qkv.models.transformer import Transformer


class _Step(torch.nn.Module):
    """The eval-mode decoding step as a module to trace: ``static_step`` with ``self_bias=None``."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, pos_enc: Tensor, pos: Tensor, memory_bias: Tensor, self_k: List[Tensor],
                self_v: List[Tensor], cross_k: List[Tensor], cross_v: List[Tensor]) -> Tensor:
        return self.model.static_step(tokens, pos_enc, pos, None, self_k, self_v, cross_k, cross_v, memory_bias,
                                      1, True)[0]


def _rows(buf: Tensor, keep: Tensor, filled: int) -> Tensor:
    """Rows ``keep`` of a self-attention buffer ``(N, h, C, d_k)``, of which the first ``filled``
    positions are written (and copied); the others are written before they are read."""
    out = buf.new_empty([keep.size(0), buf.size(1), buf.size(2), buf.size(3)])
    out[:, :, :filled].copy_(buf[:, :, :filled].index_select(0, keep))
    return out


class _GreedyLoop(torch.nn.Module):
    """:func:`qkv.decoding.greedy._greedy` (``drop_finished=True``) around a traced step, to script."""

    def __init__(self, step: torch.nn.Module):
        super().__init__()
        self.step = step
        self.eos = EOS
        self.bos = BOS

    def forward(self, pos_table: Tensor, self_k: List[Tensor], self_v: List[Tensor], cross_k: List[Tensor],
                cross_v: List[Tensor], memory_bias: Tensor, limit: Tensor, min_len: int, banned: Tensor,
                scored: bool) -> Tuple[Tensor, Tensor, Tensor]:
        n = limit.size(0)
        steps = int(limit.max()) + 1
        device = limit.device
        out = torch.full([n, steps], self.eos, dtype=torch.long, device=device)  # (B, T) tokens, by sentence
        lengths = torch.zeros([n], dtype=torch.long, device=device)  # (B,) tokens before EOS
        logprobs = torch.zeros([n], dtype=torch.float64, device=device)  # (B,)
        total = torch.zeros([n], dtype=torch.float64, device=device)  # (N,) of the active rows
        rows = torch.arange(n, device=device)  # (N,) sentence of each active row
        tokens = torch.full([n], self.bos, dtype=torch.long, device=device)  # (N,)
        positions = torch.arange(steps, device=device)
        for t in range(steps):
            ks = [k[:, :, : t + 1] for k in self_k]  # (N, h, t + 1, d_k) views: position t is written
            vs = [v[:, :, : t + 1] for v in self_v]
            logits = self.step(tokens, pos_table[t : t + 1], positions[t : t + 1], memory_bias, ks, vs,
                               cross_k, cross_v)  # (N, V)
            logp = torch.log_softmax(logits.float(), dim=-1) if scored else logits  # before the masks
            logits.index_fill_(1, banned, -math.inf)
            if t < min_len:
                logits.select(1, self.eos).fill_(-math.inf)
            tokens = logits.argmax(dim=-1).masked_fill(limit <= t, self.eos)  # (N,)
            if scored:
                total += logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
            out.select(1, t).index_copy_(0, rows, tokens)
            ended = tokens == self.eos
            n_ended = int(ended.sum())
            if n_ended > 0:
                done = rows.masked_select(ended)
                lengths.index_fill_(0, done, t)
                if scored:
                    logprobs.index_copy_(0, done, total.masked_select(ended))
                if n_ended == rows.size(0):
                    break
                keep = (~ended).nonzero().squeeze(1)  # (N',)
                rows, tokens, limit = rows[keep], tokens[keep], limit[keep]
                total, memory_bias = total[keep], memory_bias.index_select(0, keep)
                self_k = [_rows(k, keep, t + 1) for k in self_k]
                self_v = [_rows(v, keep, t + 1) for v in self_v]
                cross_k = [k.index_select(0, keep) for k in cross_k]
                cross_v = [v.index_select(0, keep) for v in cross_v]
        return out, lengths, logprobs


# model -> (its parameters' storage, dtypes and devices when scripted, the scripted loop)
_loops: "weakref.WeakKeyDictionary[Transformer, tuple[tuple, torch.jit.ScriptModule]]" = weakref.WeakKeyDictionary()


def scripted_greedy_applies(model) -> bool:
    """Whether :func:`scripted_greedy` can decode with ``model``: a Transformer encoder-decoder
    (the class itself) in eval mode on the CPU, with floating-point weights (not quantised)."""
    if type(model) is not Transformer or model.training or not model.has_static_step:
        return False
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or not p.is_floating_point() for p in params):
        return False
    return not any(type(m).__module__.startswith("torch.ao") for m in model.modules())


def _signature(model: Transformer) -> tuple:
    return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())


def _build(model: Transformer) -> torch.jit.ScriptModule:
    """Trace the step and script the loop around it (a fraction of a second for a small model)."""
    d = model.cfg.d_model
    dtype = next(model.parameters()).dtype
    b, s, t = 2, 3, 2  # example shapes; the traced sizes stay symbolic (any batch, source, position)
    heads = [(layer.self_attn.n_heads, layer.self_attn.d_k) for layer in model.decoder_layers]
    with warnings.catch_warnings():  # torch.jit's deprecation warnings ("switch to torch.compile") and the tracer's
        warnings.filterwarnings("ignore", r".*torch\.jit\.", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: the trace writes into them
            example = (torch.full((b,), BOS, dtype=torch.long), torch.zeros(1, d, dtype=dtype),
                       torch.tensor([t - 1]), torch.zeros(b, 1, 1, s, dtype=dtype),
                       [torch.zeros(b, h, t, k, dtype=dtype) for h, k in heads],
                       [torch.zeros(b, h, t, k, dtype=dtype) for h, k in heads],
                       [torch.zeros(b, h, s, k, dtype=dtype) for h, k in heads],
                       [torch.zeros(b, h, s, k, dtype=dtype) for h, k in heads])
            step = torch.jit.trace(_Step(model).eval(), example, check_trace=False)
            return torch.jit.script(_GreedyLoop(step))


def _loop(model: Transformer) -> torch.jit.ScriptModule:
    sig = _signature(model)
    cached = _loops.get(model)
    if cached is None or cached[0] != sig:
        cached = (sig, _build(model))
        _loops[model] = cached
    return cached[1]


def scripted_greedy(model: Transformer, src: Tensor, limit: Tensor, min_len: int, banned: tuple[int, ...],
                    scored: bool) -> tuple[list[list[int]], list[float]]:
    """:func:`qkv.decoding.greedy._greedy` with the loop in TorchScript (the module's docstring):
    ``limit`` a LongTensor (B,) of output budgets. Returns the outputs (without BOS/EOS) and, with
    ``scored``, their log-probabilities (else zeros)."""
    loop = _loop(model)
    state = model.start(src)
    steps = int(limit.max()) + 1
    pos_table = model.tgt_pos(steps, 0)[0]  # (T, d): the rows the eager step reads one by one
    self_k, self_v = [], []
    for layer, kv in zip(model.decoder_layers, state.cross_kv):
        attn = layer.self_attn
        k = kv.k.new_empty(src.size(0), attn.n_heads, steps, attn.d_k)  # position t written at step t, then read
        self_k.append(k)
        self_v.append(torch.empty_like(k))
    banned_t = torch.tensor(banned, dtype=torch.long)
    out, lengths, logprobs = loop(pos_table, self_k, self_v, [kv.k for kv in state.cross_kv],
                                  [kv.v for kv in state.cross_kv], state.memory_bias, limit, int(min_len), banned_t,
                                  bool(scored))
    outputs = [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]
    return outputs, logprobs.tolist()


__all__ = ["scripted_greedy", "scripted_greedy_applies"]
