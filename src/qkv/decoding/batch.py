"""Decode many source sentences: sorted by length, batched, greedy or beam search.

The loop every translation front-end runs (:class:`qkv.frontends.Translator`, the validation
BLEU of the translate task): token ids in, hypotheses out, in input order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qkv.config import DecodeConfig
from qkv.data.batching import collate
from qkv.decoding.beam_search import Hypothesis, _norm, beam_search
from qkv.decoding.greedy import NEVER_EMITTED, greedy, greedy_scored, max_output_len
from qkv.masks import real_tokens


@torch.inference_mode()
def decode_sentences(model: torch.nn.Module, src_ids: list[list[int]], cfg: DecodeConfig,
                     banned: Sequence[int] = NEVER_EMITTED, scores: bool = True,
                     limits: Sequence[int] | None = None) -> list[list[Hypothesis]]:
    """The ``cfg.nbest`` best hypotheses of each source (token ids without EOS), best first.

    Greedy when ``beam_size == nbest == 1`` (its loop in TorchScript where ``cfg.scripted_greedy``
    and :mod:`qkv.decoding.scripted` apply), else beam search; a greedy output is scored as a beam
    of one scores it (:func:`greedy_hypothesis`; ``scores=False``: not scored, NaN, for callers that
    keep the tokens only: a log-softmax a step). Output lengths
    follow ``max_len_a · src_len + max_len_b``, capped where the model's positions end. The model
    is put in eval mode for the call and restored after. ``banned``: ids never emitted
    (:func:`~qkv.decoding.greedy.banned_ids` of the target tokenizer). ``limits``: a further cap on
    each sentence's output length, in input order (validation's: relative to the reference).
    """
    if limits is not None and len(limits) != len(src_ids):
        raise ValueError(f"limits: {len(limits)} caps for {len(src_ids)} sentences")
    device = next(model.parameters()).device
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))  # similar lengths batch together
    results: list[list[Hypothesis]] = [[] for _ in src_ids]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            batch = collate([src_ids[i] for i in idx], None).to(device)
            src_len = real_tokens(batch.src).sum(dim=1)
            steps = model.max_steps(src_len)  # the last step emits EOS
            max_len = max_output_len(src_len, cfg.max_len_a, cfg.max_len_b,
                                     None if steps is None else torch.as_tensor(steps) - 1)
            if limits is not None:
                max_len = torch.minimum(max_len, torch.tensor([limits[i] for i in idx], device=max_len.device))
            if cfg.beam_size == 1 and cfg.nbest == 1:
                if scores:
                    outputs, logprobs = greedy_scored(model, batch.src, max_len, cfg.min_len, banned=banned,
                                                      scripted=cfg.scripted_greedy)
                else:
                    outputs = greedy(model, batch.src, max_len, cfg.min_len, banned=banned,
                                     scripted=cfg.scripted_greedy)
                    logprobs = [math.nan] * len(outputs)
                hyps = [[greedy_hypothesis(t, lp, cfg)] for t, lp in zip(outputs, logprobs)]
            else:
                hyps = beam_search(model, batch.src, cfg.beam_size, cfg.length_penalty, max_len, cfg.nbest,
                                   cfg.min_len, length_norm=cfg.length_norm, early_stopping=cfg.early_stopping,
                                   banned=banned)
            for i, nbest in zip(idx, hyps):
                results[i] = nbest
    finally:
        model.train(was_training)
    return results


def greedy_hypothesis(tokens: list[int], logprob: float, cfg: DecodeConfig) -> Hypothesis:
    """A greedy output as a :class:`Hypothesis`: its ``logprob`` (EOS included) and the ``score`` beam
    search would give it, ``logprob / lp(len(tokens) + 1)`` with ``cfg``'s length penalty and norm
    (beam search with one beam is greedy search)."""
    return Hypothesis(tokens, logprob / _norm(len(tokens) + 1, cfg.length_penalty, cfg.length_norm), logprob)


__all__ = ["decode_sentences", "greedy_hypothesis"]
