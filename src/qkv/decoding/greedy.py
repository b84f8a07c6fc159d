"""Greedy decoding: at every step emit the most probable next token.

    y_t = argmax_v log p(v | y_<t, x)

Decoding is incremental: ``model.start(src)`` encodes the source once and each
``model.step(tokens, state)`` feeds only the last emitted token (BOS first), so a step costs
one position, not the whole prefix. Sentences that have emitted EOS are dropped from the
batch (``state.reorder`` with the indices of the rows still running).

Shared conventions (also used by :mod:`qkv.decoding.beam_search`):

* the model returns unnormalised logits; beam search takes ``log_softmax`` in float32, greedy
  needs no normalisation (the argmax is the same; :func:`greedy_choice`);
* special tokens are never emitted: PAD, UNK, BOS, and ``<cls>``, ``[MASK]``, ``<sep>`` where the
  tokenizer has them (``banned``, :func:`banned_ids` of the output tokenizer; the default
  :data:`NEVER_EMITTED` are the ids special in every tokenizer). Their log-probs are set to -inf
  after the softmax, so the scores stay the model's own log-probs. EOS only ends an output. UNK
  is refused too: it stands for a piece the tokenizer cannot write, so it would print as
  ``<unk>`` (a source's unknown piece is not copied either);
* ``max_len[i]`` is the number of tokens (EOS excluded) sentence ``i`` may produce: at step
  ``t = max_len[i]`` every token but EOS is masked, so EOS is forced there and its log-prob
  is the model's own ``log p(EOS | y_<t, x)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from qkv.config import BOS, EOS, MAX_OUTPUT_LEN, PAD, UNK


class DecoderState(Protocol):
    """Incremental decoding state: opaque to the decoders except for ``reorder`` (and, optional,
    ``expand_beams(k)``: ``k`` rows per sentence for beam search, see
    :class:`qkv.models.transformer.TransformerState`)."""

    def reorder(self, indices: Tensor) -> "DecoderState":
        """Select / reorder batch rows: row ``j`` of the result is row ``indices[j]``."""
        ...


class IncrementalDecoder(Protocol):
    """What a model offers to greedy and beam search (see SPEC "Model decoding interface")."""

    def start(self, src: Tensor) -> Any:
        """Encode ``src`` (B, S) and return the initial state (B rows)."""
        ...

    def step(self, tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
        """Feed ``tokens`` (B,) and return ``(logits (B, V), new state)``."""
        ...


NEVER_EMITTED = (PAD, UNK, BOS)  # special in every tokenizer (EOS only ends an output)


def banned_ids(tokenizer, ends: bool = True) -> tuple[int, ...]:
    """The ids a decoder never emits in ``tokenizer``'s pieces: its special ids
    (:attr:`qkv.data.tokenizer.Tokenizer.special_ids`) but EOS, which ends an output. ``ends=False``
    for an output that has no end to mark (a ``[MASK]``'s fill): EOS is banned with the others."""
    return tuple(i for i in tokenizer.special_ids if i != EOS or not ends)


def ban(logits: Tensor, banned: Sequence[int]) -> Tensor:
    """Set the columns ``banned`` of ``logits`` (N, V) to -inf, in place; returns ``logits``."""
    return logits.index_fill_(1, _ids(tuple(banned), logits.device), -math.inf)


@functools.lru_cache(maxsize=16)
def _ids(ids: tuple[int, ...], device: torch.device) -> Tensor:
    """``ids`` as a LongTensor on ``device``, made once (every decoding step bans the same ids)."""
    return torch.tensor(ids, dtype=torch.long, device=device)


def max_output_len(src_lengths: Tensor, a: float, b: int, limit: Tensor | int | None = None) -> Tensor:
    """Per-sentence output budget ``min(floor(a * |x| + b), MAX_OUTPUT_LEN, limit)`` (the paper:
    ``|x| + 50``, a=1, b=50).

    ``src_lengths`` is a LongTensor (B,) of source lengths in tokens (the caller chooses what
    it counts, e.g. the non-PAD tokens of ``src``). ``limit`` (an int or a LongTensor (B,)) is
    what the model can emit at all: what its learned position table leaves (``model.max_steps``
    less the step that emits EOS). Returns a LongTensor (B,) for ``max_len``.
    """
    src_lengths = torch.as_tensor(src_lengths)
    # in float64 and capped before the cast: a huge a or b (1e300, 10**30) cannot overflow
    budget = torch.floor(float(a) * src_lengths.double() + float(b)).clamp(0, MAX_OUTPUT_LEN).long()
    if limit is not None:
        budget = torch.minimum(budget, torch.as_tensor(limit, device=budget.device).clamp(min=0))
    return budget


def log_probs(logits: Tensor, banned: Sequence[int] = NEVER_EMITTED) -> Tensor:
    """``log_softmax`` over the vocabulary in float32, with the ``banned`` ids set to -inf.

    log p(v | y_<t, x) = z_v - log sum_u exp(z_u), for logits z (N, V).

    The mask is applied after the softmax (as fairseq does), so scores stay the model's own
    log-probs: the remaining tokens are not renormalised.
    """
    return ban(torch.log_softmax(logits.float(), dim=-1), banned)  # (N, V)


def force_eos(logp: Tensor, at_limit: Tensor, before_min_len: bool = False) -> Tensor:
    """The length limits: where ``at_limit`` (N,) is True keep only EOS (every other token gets
    -inf); elsewhere, while ``before_min_len``, forbid EOS. The maximum wins over the minimum."""
    only_eos = torch.full_like(logp, -math.inf)
    only_eos[:, EOS] = logp[:, EOS]
    if before_min_len:
        logp = logp.clone()
        logp[:, EOS] = -math.inf
    return torch.where(at_limit.unsqueeze(1), only_eos, logp)  # (N, V)


def greedy_choice(logits: Tensor, at_limit: Tensor, before_min_len: bool = False,
                  banned: Sequence[int] = NEVER_EMITTED) -> Tensor:
    """``argmax_v force_eos(log_probs(logits, banned))[:, v]`` without normalising: log_softmax only
    subtracts a constant per row, so the argmax of the logits (``banned`` masked, EOS masked
    before ``min_len``) is the same token; rows ``at_limit`` (N,) get EOS. ``logits`` (N, V) are
    overwritten in those columns."""
    ban(logits, banned)
    if before_min_len:
        logits[:, EOS] = -math.inf
    return logits.argmax(dim=-1).masked_fill(at_limit, EOS)  # (N,)


def as_max_len(max_len: Tensor | int, batch_size: int, device: torch.device) -> Tensor:
    """``max_len`` as a LongTensor (B,) on ``device`` (an int is broadcast to every sentence)."""
    max_len = torch.as_tensor(max_len, dtype=torch.long, device=device)
    if max_len.dim() == 0:
        max_len = max_len.expand(batch_size)
    if max_len.shape != (batch_size,):
        raise ValueError(f"max_len must have shape ({batch_size},), got {tuple(max_len.shape)}")
    return max_len


@torch.inference_mode()
def greedy(
    model: IncrementalDecoder, src: Tensor, max_len: Tensor | int, min_len: int = 0, *,
    banned: Sequence[int] = NEVER_EMITTED, drop_finished: bool = True, scripted: bool = False,
) -> list[list[int]]:
    """Greedy-decode a batch; returns one token list per sentence, without BOS/EOS.

    src: LongTensor (B, S) padded with PAD. max_len: LongTensor (B,) (or an int), the number
    of tokens each sentence may emit before EOS is forced. min_len: EOS is not allowed before
    this many tokens (``min_len = max_len`` makes every output exactly that long, as speed
    benchmarks of random-weight models need). banned: ids never emitted (:func:`banned_ids` of the
    target tokenizer). Decoding stops when every sentence has emitted
    EOS; finished sentences are removed from the batch as they end.

    drop_finished: only for measuring what that removal saves (``benchmarks/means.py``):
    ``False`` keeps finished rows in the batch, fed EOS, as a naive implementation would. The
    output is the same either way.

    scripted: run the loop in TorchScript where it applies (:mod:`qkv.decoding.scripted`: a
    Transformer on the CPU; elsewhere, and with ``drop_finished=False``, this eager loop). The
    same outputs with less Python per step; :func:`qkv.decoding.batch.decode_sentences` asks for
    it unless ``DecodeConfig.scripted_greedy`` is off.
    """
    return _greedy(model, src, max_len, min_len, banned, drop_finished, scored=False, scripted=scripted)[0]


@torch.inference_mode()
def greedy_scored(
    model: IncrementalDecoder, src: Tensor, max_len: Tensor | int, min_len: int = 0, *,
    banned: Sequence[int] = NEVER_EMITTED, scripted: bool = False,
) -> tuple[list[list[int]], list[float]]:
    """:func:`greedy`'s outputs and the log-probability of each (EOS included): the sum of the
    model's own ``log p(y_t | y_<t, x)`` (:func:`log_probs`: the softmax over the whole vocabulary,
    as beam search and forced scoring take it), in float64. The tokens are :func:`greedy`'s
    (``scripted`` as there)."""
    return _greedy(model, src, max_len, min_len, banned, True, scored=True, scripted=scripted)


def _greedy(model, src: Tensor, max_len, min_len: int, banned: Sequence[int], drop_finished: bool,
            scored: bool, scripted: bool = False) -> tuple[list[list[int]], list[float]]:
    batch_size = src.size(0)
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    logprobs = [0.0] * batch_size
    if batch_size == 0:
        return outputs, logprobs
    limit = as_max_len(max_len, batch_size, src.device)  # (N,) the budget of each active row
    if scripted and drop_finished:
        from qkv.decoding.scripted import scripted_greedy, scripted_greedy_applies

        if scripted_greedy_applies(model):
            return scripted_greedy(model, src, limit, min_len, tuple(banned), scored)
    state = model.start(src)
    rows = list(range(batch_size))  # sentence id of each active row
    tokens = torch.full((batch_size,), BOS, dtype=torch.long, device=src.device)  # (N,)
    ended = torch.zeros(batch_size, dtype=torch.bool, device=src.device)  # drop_finished=False only
    total = torch.zeros(batch_size, dtype=torch.float64, device=src.device) if scored else None  # (N,)
    for t in range(int(limit.max()) + 1):
        logits, state = model.step(tokens, state)
        logp = torch.log_softmax(logits.float(), dim=-1) if scored else None  # before greedy_choice masks logits
        tokens = greedy_choice(logits, limit <= t, t < min_len, banned)  # (N,)
        if scored:
            total += logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if not drop_finished:  # rows that ended earlier are fed EOS and their output ignored
            tokens = tokens.masked_fill(ended, EOS)
            ended |= tokens == EOS
        chosen = tokens.tolist()
        running = [i for i, tok in enumerate(chosen) if tok != EOS]  # rows still going
        for i in running:
            outputs[rows[i]].append(chosen[i])
        if scored and len(running) < len(chosen):
            done = [i for i, tok in enumerate(chosen) if tok == EOS]
            for i, v in zip(done, total[done].tolist()):
                logprobs[rows[i]] = v
        if not running:
            break
        if drop_finished and len(running) < len(chosen):
            keep = torch.tensor(running, device=src.device)  # (N',)
            state = state.reorder(keep)
            rows, tokens, limit = [rows[i] for i in running], tokens[keep], limit[keep]
            if scored:
                total = total[keep]
    return outputs, logprobs
