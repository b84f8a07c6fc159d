"""Beam search with the GNMT length penalty, as used by the paper (beam 4, alpha 0.6, Sec. 6.1),
and fairseq's length normalisation and stopping rule as options.

Every sentence keeps ``k = beam_size`` live hypotheses; the batch runs as ``N * k`` rows of
the model (N = sentences still being searched), laid out sentence-major: row ``i * k + j`` is
beam ``j`` of active sentence ``i`` (fairseq's "batch x beam" layout).

One step, for each active sentence (all sentences at once, as tensors):

1. score every extension of every live hypothesis:
       s(y_1..t, v) = s(y_1..t) + log p(v | y_1..t, x)         (k x V candidates)
2. keep the top ``2k`` of them. At most ``k`` of these end in EOS (one per beam), so at
   least ``k`` do not: the beam can always be refilled. (They are found without building the
   k x V table: each is among the top ``2k`` tokens of its own row, see :func:`_top_candidates`.)
3. EOS candidates ranked within the top ``k`` become finished hypotheses, scored
       score(Y) = log P(Y | x) / lp(Y),   lp(Y) = ((5 + |Y|) / 6) ** alpha,
   with |Y| counting the EOS (see :func:`length_penalty`). ``length_norm="length"`` uses
   ``lp(Y) = |Y| ** alpha`` instead: fairseq's ``--lenpen`` (default 1) and Hugging Face's
   ``length_penalty``.
4. the best ``k`` non-EOS candidates are the new live hypotheses; ``state.reorder`` follows
   their back-pointers (the beam each came from). Each group of ``k`` rows passed to it comes
   from one sentence (``rows = sentence * k + beam``), which lets a state keep what the
   hypotheses of a sentence share once per sentence (``state.expand_beams(k)`` where the model
   offers it, e.g. the Transformer's cross-attention keys/values; otherwise ``k`` copies of
   every row by ``state.reorder``).

At the first step all ``k`` rows hold the same prefix (BOS), so only beam 0 is live (the
others start at -inf) — otherwise the beam would fill with ``k`` copies of each candidate.

Each sentence keeps its ``k`` best finished hypotheses. Stopping rule: a sentence is done
when it has ``k`` finished hypotheses and its best live hypothesis, normalised with the current
length, cannot beat the worst of them:

    done  <=>  |finished| = k  and  s_live / lp(t + 1) <= min score(finished)

or when it reaches ``max_len`` (at step ``max_len[i]`` only EOS is allowed, so every live
hypothesis is finished with the model's log-prob of EOS). For ``alpha = 0`` the bound is exact
(log-probs only fall as a hypothesis grows), so the result is the best the beam can find; for
``alpha > 0`` it is the heuristic of Hugging Face's ``BeamHypotheses``. fairseq's simpler rule
(done as soon as ``k`` hypotheses have finished; Hugging Face's ``early_stopping=True``) is
only an option, ``early_stopping=True``: a few short, poor hypotheses that end early (even the
empty one at step 0) can fill the list and cut off the best live hypothesis one step before its
EOS, so it favours short outputs. As in fairseq, a sentence then keeps the *first* ``k``
hypotheses to finish (at the step its list fills, those ranked higher among the candidates)
rather than the ``k`` best: a longer one finishing late does not evict a shorter one. With
either rule ``beam_size=1`` is exactly greedy decoding. Done sentences are removed from the
batch (``state.reorder`` with fewer rows), so they cost nothing in later steps
(``drop_finished=False`` keeps them, to measure the saving).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.config import BOS, EOS
from qkv.decoding.greedy import NEVER_EMITTED, IncrementalDecoder, as_max_len, log_probs
from qkv.errors import ConfigError


@dataclass(frozen=True)
class Hypothesis:
    """A finished translation: ``tokens`` without BOS/EOS, its length-normalised ``score``
    (``logprob / lp(len(tokens) + 1)``) and ``logprob`` (sum of token log-probs, EOS included)."""

    tokens: list[int]
    score: float
    logprob: float


def length_penalty(length: int | float | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty (Wu et al., 2016, "Google's Neural Machine Translation System", Sec. 7):

        lp(Y) = (5 + |Y|)**alpha / (5 + 1)**alpha = ((5 + |Y|) / 6) ** alpha

    Beam search ranks finished hypotheses by ``log P(Y | x) / lp(Y)``: since log-probs are
    negative, dividing by a larger lp favours longer outputs. ``alpha = 0`` gives lp = 1
    (raw log-probs); the paper uses ``alpha = 0.6``.
    """
    return ((5 + length) / 6) ** alpha


LENGTH_NORMS = ("gnmt", "length")


def _norm(length: int, alpha: float, length_norm: str) -> float:
    """The divisor of a hypothesis' log-prob: :func:`length_penalty` (``"gnmt"``) or
    ``length ** alpha`` (``"length"``: fairseq's ``--lenpen``, Hugging Face's ``length_penalty``)."""
    return length_penalty(length, alpha) if length_norm == "gnmt" else float(length) ** alpha


@dataclass
class _Beams:
    """The live hypotheses of the N sentences still being searched."""

    sents: Tensor  # (N,) index of each active sentence in the input batch
    max_len: Tensor  # (N,) its output budget
    scores: Tensor  # (N, k) cumulative log-prob of each live hypothesis
    prefixes: Tensor  # (N, k, t) tokens emitted so far (no BOS)


@dataclass
class _Candidates:
    """The top 2k extensions of each active sentence, best first."""

    scores: Tensor  # (N, 2k) cumulative log-prob
    beams: Tensor  # (N, 2k) the live hypothesis (0..k-1) each extends
    tokens: Tensor  # (N, 2k) the token it appends


def _initial_beams(max_len: Tensor, beam_size: int) -> _Beams:
    """Beam 0 live with score 0, beams 1..k-1 at -inf (all rows start from the same BOS)."""
    batch_size = max_len.size(0)
    scores = torch.full((batch_size, beam_size), -math.inf, dtype=torch.float64, device=max_len.device)  # sums of many terms
    scores[:, 0] = 0.0
    return _Beams(
        sents=torch.arange(batch_size, device=max_len.device),
        max_len=max_len,
        scores=scores,
        prefixes=torch.empty((batch_size, beam_size, 0), dtype=torch.long, device=max_len.device),
    )


def _top_candidates(
    scores: Tensor, logits: Tensor, n_cand: int, at_limit: Tensor, before_min_len: bool,
    banned: Sequence[int] = NEVER_EMITTED,
) -> _Candidates:
    """Top ``n_cand`` of ``scores[i, j] + log p(v | hypothesis j of sentence i)`` over (j, v).

    scores (N, k); logits (N*k, V), the model's, row ``i * k + j`` for hypothesis ``j`` of
    sentence ``i``; at_limit (N,): sentences at their ``max_len`` (only EOS allowed);
    before_min_len: EOS not allowed yet; banned: ids never emitted. The log-probs are those of
    :func:`~qkv.decoding.greedy.log_probs` and :func:`~qkv.decoding.greedy.force_eos`, but the
    (N, k*V) table of every extension is never built. Since ``scores[i, j]`` is the same for
    every token ``v`` of row ``j``, a candidate among the top ``n_cand`` of sentence ``i`` is
    among the top ``n_cand`` tokens of its own row (otherwise ``n_cand`` extensions of that row
    would beat it). So:

    1. ``log_softmax`` of each row (one pass over the vocabulary), with ``banned`` (and EOS before
       ``min_len``) set to -inf afterwards, as :func:`log_probs` does: columns only;
    2. the top ``n_cand`` tokens of each row (a second pass): (N, k, n_cand);
    3. add ``scores`` and keep the top ``n_cand`` of these ``k * n_cand`` per sentence.

    A row of a sentence at its limit has one candidate, EOS with the model's own log p(EOS) (the
    maximum wins over the minimum), and -inf for the rest. The candidates and their scores are
    those of the whole table (ties aside, which ``topk`` may break either way).
    """
    n, k = scores.shape
    logp = log_probs(logits, banned)  # (N*k, V), banned ids at -inf
    limited = bool(at_limit.any())
    eos_logp = logp[:, EOS].clone() if limited else None  # (N*k,) the model's log p(EOS), for rows at their limit
    if before_min_len:
        logp[:, EOS] = -math.inf
    row_scores, row_tokens = logp.topk(min(n_cand, logp.size(1)), dim=1)  # (N*k, c) each, best first
    row_scores, row_tokens = row_scores.view(n, k, -1), row_tokens.view(n, k, -1)  # (N, k, c)
    if limited:  # only EOS: its own log-prob first, the rest -inf
        row_scores[at_limit] = -math.inf
        row_scores[at_limit, :, 0] = eos_logp.view(n, k)[at_limit]
        row_tokens[at_limit] = EOS
    c = row_scores.size(2)
    total = (scores.unsqueeze(2) + row_scores).view(n, k * c)  # (N, k*c)
    top_scores, top_idx = total.topk(min(n_cand, k * c), dim=1)  # (N, 2k)
    return _Candidates(top_scores, top_idx // c, row_tokens.view(n, k * c).gather(1, top_idx))


def _finalize(
    cand: _Candidates, beams: _Beams, step: int, alpha: float, finished: list[list[Hypothesis]],
    searching: Tensor | None = None, length_norm: str = "gnmt", first_k: bool = False,
) -> None:
    """Move EOS candidates ranked within the top k into their sentence's finished list, which
    keeps the k best by score (best first; ``first_k``: the first k to arrive, in rank order).
    Their length is ``step + 1`` (EOS included).
    ``searching`` (N,) bool, if given: only these sentences (the others are done but kept)."""
    k = beams.scores.size(1)
    is_eos = (cand.tokens[:, :k] == EOS) & torch.isfinite(cand.scores[:, :k])  # (N, k)
    if searching is not None:
        is_eos &= searching.unsqueeze(1)
    if not is_eos.any():
        return
    lp = _norm(step + 1, alpha, length_norm)
    for i, rank in is_eos.nonzero().tolist():
        hyps = finished[int(beams.sents[i])]
        if first_k and len(hyps) >= k:
            continue
        logprob = float(cand.scores[i, rank])
        tokens = beams.prefixes[i, cand.beams[i, rank]].tolist()
        hyps.append(Hypothesis(tokens=tokens, score=logprob / lp, logprob=logprob))
        hyps.sort(key=lambda h: h.score, reverse=True)
        del hyps[k:]


def _select_live(cand: _Candidates, k: int) -> Tensor:
    """Positions (N, k) of the best k non-EOS candidates, in rank order.

    EOS candidates are pushed behind all others by adding ``2k`` to their rank."""
    n_cand = cand.tokens.size(1)
    rank = torch.arange(n_cand, device=cand.tokens.device) + n_cand * (cand.tokens == EOS)  # (N, 2k)
    return rank.topk(k, dim=1, largest=False).indices  # (N, k), ascending rank


def _done(
    beams: _Beams, live_scores: Tensor, step: int, alpha: float, finished: list[list[Hypothesis]],
    length_norm: str = "gnmt", early_stopping: bool = False,
) -> Tensor:
    """Stopping rule (module docstring): k finished hypotheses none of which the best live one
    can still beat (``early_stopping``: k finished hypotheses), or the step budget is spent, or
    nothing is live."""
    k = live_scores.size(1)
    worst = [finished[s][-1].score if len(finished[s]) >= k else -math.inf for s in beams.sents.tolist()]
    worst_kept = torch.tensor(worst, device=live_scores.device)  # (N,), -inf: fewer than k finished
    if early_stopping:
        full = torch.isfinite(worst_kept)
    else:
        full = live_scores[:, 0] / _norm(step + 1, alpha, length_norm) <= worst_kept  # (N,)
    return full | (beams.max_len <= step) | ~torch.isfinite(live_scores[:, 0])


def _advance(beams: _Beams, cand: _Candidates, live: Tensor, keep: Tensor) -> tuple[_Beams, Tensor, Tensor]:
    """Follow back-pointers for the sentences in ``keep`` (N',).

    Returns the new beams, the state rows to keep (N'*k,) and the next input tokens (N'*k,)."""
    k = live.size(1)
    live = live[keep]  # (N', k) positions among the candidates
    from_beam = cand.beams[keep].gather(1, live)  # (N', k)
    tokens = cand.tokens[keep].gather(1, live)  # (N', k)
    # (N'*k,) rows of the current state; each group of k comes from one sentence (state.reorder relies on it)
    rows = (keep.unsqueeze(1) * k + from_beam).view(-1)
    prefixes = beams.prefixes[keep.unsqueeze(1), from_beam]  # (N', k, t)
    new = _Beams(
        sents=beams.sents[keep],
        max_len=beams.max_len[keep],
        scores=cand.scores[keep].gather(1, live),  # (N', k)
        prefixes=torch.cat([prefixes, tokens.unsqueeze(2)], dim=2),  # (N', k, t+1)
    )
    return new, rows, tokens.view(-1)


@torch.inference_mode()
def beam_search(
    model: IncrementalDecoder,
    src: Tensor,
    beam_size: int,
    length_penalty: float,
    max_len: Tensor | int,
    nbest: int = 1,
    min_len: int = 0,
    *,
    length_norm: str = "gnmt",
    early_stopping: bool = False,
    banned: Sequence[int] = NEVER_EMITTED,
    drop_finished: bool = True,
) -> list[list[Hypothesis]]:
    """Beam-search a batch; returns, per sentence, its ``nbest`` best hypotheses (best first).

    src: LongTensor (B, S) padded with PAD. length_penalty: alpha of :func:`length_penalty`.
    max_len: LongTensor (B,) (or an int), tokens each sentence may emit before EOS is forced.
    min_len: EOS is not allowed before this many tokens.
    Hypotheses are ranked by ``score = logprob / lp(|Y|)``. See the module docstring for
    the algorithm and the stopping rule.
    length_norm: ``"gnmt"``, lp = ((5+|Y|)/6)**alpha, or ``"length"``, lp = |Y|**alpha (fairseq).
    early_stopping: a sentence is done once ``k`` hypotheses have finished (fairseq's rule).
    fairseq's own decoding is ``length_norm="length", early_stopping=True`` with alpha 1.
    banned: ids never emitted (:func:`~qkv.decoding.greedy.banned_ids` of the target tokenizer).

    drop_finished: only for measuring what removing done sentences saves
    (``benchmarks/means.py``): ``False`` keeps their ``k`` rows in the batch until every
    sentence is done, fed EOS, as a naive implementation would. The result is the same either way.
    """
    if beam_size < 1:
        raise ConfigError(f"invalid config field 'beam_size': must be >= 1, got {beam_size}")
    if not 1 <= nbest <= beam_size:
        raise ConfigError(f"invalid config field 'nbest': must be in [1, beam_size={beam_size}], got {nbest}")
    if length_norm not in LENGTH_NORMS:
        raise ConfigError(f"invalid config field 'length_norm': must be one of {', '.join(LENGTH_NORMS)}, "
                          f"got {length_norm!r}")
    alpha, k = length_penalty, beam_size
    batch_size = src.size(0)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    if batch_size == 0:
        return []
    beams = _initial_beams(as_max_len(max_len, batch_size, src.device), k)
    state = model.start(src)
    if hasattr(state, "expand_beams"):  # k decoder rows per sentence, the source side kept per sentence
        state = state.expand_beams(k)
    else:  # k copies of every row
        state = state.reorder(torch.arange(batch_size, device=src.device).repeat_interleave(k))
    tokens = torch.full((batch_size * k,), BOS, dtype=torch.long, device=src.device)  # (B*k,)
    ended = torch.zeros(batch_size, dtype=torch.bool, device=src.device)  # drop_finished=False only
    for step in range(int(beams.max_len.max()) + 1):
        logits, state = model.step(tokens, state)
        cand = _top_candidates(beams.scores, logits, 2 * k, beams.max_len <= step, step < min_len,
                               banned)  # (N, 2k)
        _finalize(cand, beams, step, alpha, finished, None if drop_finished else ~ended, length_norm, early_stopping)
        live = _select_live(cand, k)  # (N, k)
        done = _done(beams, cand.scores.gather(1, live), step, alpha, finished, length_norm, early_stopping)  # (N,)
        if not drop_finished:
            ended |= done
            done = ended
        keep = (~done).nonzero().squeeze(1)  # (N',)
        if keep.numel() == 0:
            break
        if not drop_finished:  # done sentences keep their rows (unchanged), fed EOS
            old_rows = torch.arange(batch_size * k, device=src.device)
            beams, rows, new_tokens = _advance(beams, cand, live, torch.arange(batch_size, device=src.device))
            rows = torch.where(ended.repeat_interleave(k), old_rows, rows)
            tokens = new_tokens.masked_fill(ended.repeat_interleave(k), EOS)
            state = state.reorder(rows)
            continue
        beams, rows, tokens = _advance(beams, cand, live, keep)
        state = state.reorder(rows)
    return [hyps[:nbest] for hyps in finished]
