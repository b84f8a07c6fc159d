"""Ensemble decoding: several models with one vocabulary decode as one.

At every step each member ``m`` gives its distribution over the next token, and the ensemble's
is their mean (fairseq's ``--path a.pt:b.pt``, OpenNMT-py's ``-model a.pt b.pt``):

    p(v | y_<t, x) = (1 / M) * sum_m p_m(v | y_<t, x)
    log p(v | y_<t, x) = logsumexp_m log p_m(v | y_<t, x) - log M

:class:`Ensemble` offers the incremental interface of one model (``start`` / ``step`` and a
state with ``reorder``; ``expand_beams`` too), so greedy and beam search
(:mod:`qkv.decoding`) decode an ensemble unchanged. Its ``step`` returns the ensemble's log-probs
in place of logits: ``log_softmax`` of a normalised log-distribution is the same distribution,
so the decoders' own normalisation leaves it as it is.

Each member keeps its own decoding state (its own encoder output and caches); a step costs the
sum of the members' steps. The members must share the vocabulary (the same token ids on both
sides): :func:`qkv.frontends.load_ensemble` checks their tokenizers before building one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


class EnsembleState:
    """One decoding state per member, reordered together."""

    def __init__(self, states: list[Any], batch_size: int, device: torch.device):
        self.states = states
        self.batch_size = batch_size  # rows of the states, for members without expand_beams
        self.device = device

    def reorder(self, indices: Tensor) -> "EnsembleState":
        """Row ``j`` of every member's state is its row ``indices[j]``."""
        return EnsembleState([s.reorder(indices) for s in self.states], indices.numel(), self.device)

    def expand_beams(self, k: int) -> "EnsembleState":
        """``k`` rows per sentence in every member (``expand_beams`` where the member has it,
        else ``k`` copies of each row), so the beam search's row layout is the same in all."""
        rows = torch.arange(self.batch_size, device=self.device).repeat_interleave(k)
        expanded = [s.expand_beams(k) if hasattr(s, "expand_beams") else s.reorder(rows) for s in self.states]
        return EnsembleState(expanded, self.batch_size * k, self.device)


class Ensemble(nn.Module):
    """Models with one vocabulary, decoded as one: the mean of their next-token distributions.

    ``models``: modules with ``start(src)`` and ``step(tokens, state)`` (an encoder-decoder
    Transformer or RNN; members may differ in shape). ``step`` returns log-probs (B, V).
    """

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.members = nn.ModuleList(models)

    def __len__(self) -> int:
        return len(self.members)

    def start(self, src: Tensor) -> EnsembleState:
        return EnsembleState([m.start(src) for m in self.members], src.size(0), src.device)

    def max_source_len(self) -> int | None:
        """The longest source every member reads (None: any length)."""
        limits = [m.max_source_len() for m in self.members]
        return min((n for n in limits if n is not None), default=None)

    def max_steps(self, src_lengths: Tensor) -> Tensor | None:
        """The steps every member takes, per row (None: no limit)."""
        limits = [torch.as_tensor(n) for m in self.members if (n := m.max_steps(src_lengths)) is not None]
        return torch.stack(torch.broadcast_tensors(*limits)).amin(dim=0) if limits else None

    def step(self, tokens: Tensor, state: EnsembleState) -> tuple[Tensor, EnsembleState]:
        logps, states = [], []
        for m, s in zip(self.members, state.states):
            logits, s = m.step(tokens, s)
            logps.append(torch.log_softmax(logits.float(), dim=-1))
            states.append(s)
        mean = torch.logsumexp(torch.stack(logps), dim=0) - math.log(len(logps))  # (B, V)
        return mean, EnsembleState(states, tokens.numel(), state.device)


__all__ = ["Ensemble", "EnsembleState"]
