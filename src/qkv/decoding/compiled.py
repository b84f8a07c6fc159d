"""Compiled decoding: the Transformer's step with static shapes, compiled by ``torch.compile``.

Eager decoding (:meth:`qkv.models.transformer.Transformer.step`) grows each self-attention cache
by one position per step, so no two steps have the same shapes, and compiled code, which is
specialised to shapes, would be recompiled or made generic. :class:`CompiledDecoder` decodes with
:meth:`~qkv.models.transformer.Transformer.static_step` instead:

* the self-attention keys/values live in buffers of a fixed capacity C (64 positions, doubled when
  full), each step's position written into them; the query attends to the whole buffer under an
  additive mask that opens one more position per step (a key under -inf gets weight exactly 0);
* the source keys/values are padded to a multiple of 16 positions, masked the same way.

Batch size, capacity and source length are compiled as dynamic dimensions, so a run compiles a
few graphs (batch 1 is specialised), not one per shape. Greedy and beam search run unchanged on it
(it offers ``start``/``step``, and its state ``reorder``/``expand_beams``). A state is used once:
on the CPU a step writes into its buffers (greedy and beam search only ever step the newest state).

How it compiles (:func:`compile_options`):

* GPU: ``mode="reduce-overhead"``, CUDA graphs: a step is one graph replay instead of a kernel
  launch per operation. A replay may not change its inputs, so the step writes the new position
  into copies of the buffers, and what a step keeps (logits, buffers) is cloned out of the graph's
  memory before the next replay overwrites it.
* CPU: inductor with ``freezing`` (the weights become constants) and ``max_autotune`` with its
  C++ GEMM template; the buffers are written in place. Needs a C++ compiler. It measured slower
  than the eager step on a 2-core EPYC (``docs/results.md``, "Compiled decoding").

The first batch of each shape compiles (seconds on a GPU, tens of seconds on a small CPU). The
weights are read when it compiles: a model changed afterwards needs a new :class:`CompiledDecoder`.
Outputs equal eager decoding's token for token on the tests and on test_2016_flickr
(``benchmarks/decode_compile.py``); the logits agree to float32 rounding, not bit for bit, as the
generated kernels add in another order. ``compile=False`` runs the same static-shape step eagerly
(what the tests check the bookkeeping with).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.models.transformer import Transformer, TransformerState
from qkv.nn.attention import KVCache

CAPACITY = 64  # self-attention positions a first buffer holds; doubled when full
SOURCE_MULTIPLE = 16  # source positions are padded to a multiple of this


def compile_options(device: torch.device) -> dict:
    """The ``torch.compile`` arguments for a step on ``device`` (see the module's docstring). The
    shapes are dynamic: a search meets more batch sizes, capacities and source lengths than dynamo
    would compile graphs for one by one (its recompile limit)."""
    if device.type == "cpu":
        return {"fullgraph": True, "dynamic": True, "options": {"freezing": True, "max_autotune": True,
                                                                "max_autotune_gemm_backends": "CPP,ATEN"}}
    return {"fullgraph": True, "dynamic": True, "mode": "reduce-overhead"}


class CompiledDecoder(torch.nn.Module):
    """A Transformer's ``start``/``step`` with static shapes, the step compiled: what greedy and
    beam search decode with (:func:`qkv.decoding.batch.decode_sentences`). Its parameters, and
    ``train``/``eval``, are the model's."""

    def __init__(self, model: Transformer, compile: bool = True, capacity: int = CAPACITY):
        super().__init__()
        if not isinstance(model, Transformer):
            raise TypeError(f"compiled decoding runs a Transformer encoder-decoder, not {type(model).__name__}")
        if not model.has_static_step:
            from qkv.errors import QkvError

            raise QkvError("compiled decoding runs the paper's attention with added positions; this model's rotary or "
                           "relative positions or grouped-query attention decode without --compile")
        self.model, self.capacity = model, capacity
        device = next(model.parameters()).device
        self._step = torch.compile(model.static_step, **compile_options(device)) if compile else model.static_step
        self._in_place = device.type == "cpu"  # CUDA graphs (GPU) replay only steps that change no input
        self._positions = torch.arange(capacity, device=device)  # pos as a (1,) view: no tensor made per step

    def max_steps(self, src_lengths: Tensor):
        return self.model.max_steps(src_lengths)

    def max_source_len(self):
        return self.model.max_source_len()

    def start(self, src: Tensor) -> TransformerState:
        return self.model.start_static(src, self.capacity, SOURCE_MULTIPLE)

    def step(self, tokens: Tensor, state: TransformerState) -> tuple[Tensor, TransformerState]:
        """One step: ``tokens (B,)`` -> logits ``(B, V)``; the keys/values go into ``state``'s buffers."""
        p = state.position
        if p == state.self_bias.size(-1):
            state = _grow(state)
            if self._positions.numel() < 2 * p:
                self._positions = torch.arange(2 * p, device=self._positions.device)
        state.self_bias[..., p] = 0.0  # position p may now be attended to
        pos_enc = self.model.tgt_pos(1, p)[0]  # (1, d)
        if not self._in_place:  # CUDA graphs: the outputs of one replay are overwritten by the next
            torch.compiler.cudagraph_mark_step_begin()
        logits, ks, vs = self._step(tokens, pos_enc, self._positions[p : p + 1], state.self_bias,
                                    [kv.k for kv in state.self_kv], [kv.v for kv in state.self_kv],
                                    [kv.k for kv in state.cross_kv], [kv.v for kv in state.cross_kv],
                                    state.memory_bias, state.beam, self._in_place)
        if not self._in_place:  # kept past the next replay: copied out of the graph's memory
            logits, ks, vs = logits.clone(), [k.clone() for k in ks], [v.clone() for v in vs]
        return logits, replace(state, self_kv=[KVCache(k, v) for k, v in zip(ks, vs)], position=p + 1)


def _grow(state: TransformerState) -> TransformerState:
    """``state`` with buffers of twice the capacity (the new positions zero and masked)."""
    c = state.self_bias.size(-1)
    self_kv = [KVCache(F.pad(kv.k, (0, 0, 0, c)), F.pad(kv.v, (0, 0, 0, c))) for kv in state.self_kv]
    return replace(state, self_kv=self_kv, self_bias=F.pad(state.self_bias, (0, c), value=float("-inf")))


__all__ = ["CompiledDecoder", "compile_options", "CAPACITY", "SOURCE_MULTIPLE"]
