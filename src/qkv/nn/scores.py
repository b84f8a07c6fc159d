"""Alignment scores of the attention-based recurrent models, and the attention they define.

A decoder state h_t (the query) is scored against every encoder state h̄_s (the keys,
"annotations" in Bahdanau et al.); the scores are normalised over the source,

    a_t(s) = exp(score(h_t, h̄_s)) / Σ_s' exp(score(h_t, h̄_s'))      (padding excluded)

and the context vector is the weighted average c_t = Σ_s a_t(s) h̄_s.

| name         | score(h_t, h̄_s)                        | source                                   |
| ------------ | --------------------------------------- | ---------------------------------------- |
| dot          | h_tᵀ h̄_s                                | Luong et al. (2015)                      |
| scaled_dot   | h_tᵀ h̄_s / √d                           | Vaswani et al. (2017), eq. 1             |
| general      | h_tᵀ W_a h̄_s                            | Luong et al. (2015), "general"           |
| additive     | v_aᵀ tanh(W_a h_t + U_a h̄_s)            | Bahdanau et al. (2015), "concat" in Luong |
| cosine       | β_t · cos(h_t, h̄_s)                     | Graves et al. (2014), content addressing |
| location     | (W_a h_t)_s                             | Luong et al. (2015), location-based      |

Every score is a module with ``keys(memory)`` — the part that depends on the source only,
computed once per sentence (``U_a h̄_s``, ``W_a h̄_s``, the normalised keys) — and
``forward(query (B, T, d), keys) -> scores (B, T, S)``. Masks come from :mod:`qkv.masks`
(True = may attend).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import ATTENTION_SCORES

SCORES = tuple(name for name in ATTENTION_SCORES if name != "none")  # the names are declared in qkv.config


class Score(nn.Module):
    """Base class: ``keys(memory)`` once per sentence, then ``forward(query, keys)`` per step."""

    def keys(self, memory: Tensor) -> Tensor:
        """``memory (B, S, d)`` -> what :meth:`forward` scores against (default: the memory itself)."""
        return memory

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class DotScore(Score):
    """score(h_t, h̄_s) = h_tᵀ h̄_s  (Luong et al., 2015, "dot")."""

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        return query @ keys.transpose(1, 2)  # (B, T, S)


class ScaledDotScore(Score):
    """score(h_t, h̄_s) = h_tᵀ h̄_s / √d  (the Transformer's scaling, Vaswani et al., 2017, eq. 1)."""

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        return query @ keys.transpose(1, 2) / math.sqrt(query.size(-1))  # (B, T, S)


class GeneralScore(Score):
    """score(h_t, h̄_s) = h_tᵀ W_a h̄_s  (Luong et al., 2015, "general"); W_a h̄_s is computed once."""

    def __init__(self, d_query: int, d_key: int):
        super().__init__()
        self.W_a = nn.Linear(d_key, d_query, bias=False)

    def keys(self, memory: Tensor) -> Tensor:
        return self.W_a(memory)  # (B, S, d_query)

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        return query @ keys.transpose(1, 2)  # (B, T, S)


class AdditiveScore(Score):
    """score(h_t, h̄_s) = v_aᵀ tanh(W_a h_t + U_a h̄_s)  (Bahdanau et al., 2015, eq. 6 and appendix A.1.2;
    Luong's "concat"). U_a h̄_s is computed once per sentence."""

    def __init__(self, d_query: int, d_key: int, d_attn: int | None = None):
        super().__init__()
        d_attn = d_attn or d_query
        self.W_a = nn.Linear(d_query, d_attn, bias=False)
        self.U_a = nn.Linear(d_key, d_attn, bias=True)
        self.v_a = nn.Linear(d_attn, 1, bias=False)

    def keys(self, memory: Tensor) -> Tensor:
        return self.U_a(memory)  # (B, S, d_attn)

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        q = self.W_a(query)  # (B, T, d_attn)
        return self.v_a(torch.tanh(q[:, :, None, :] + keys[:, None, :, :])).squeeze(-1)  # (B, T, S)


class CosineScore(Score):
    """Content-based addressing of the Neural Turing Machine (Graves et al., 2014, eq. 5-6):

        score(h_t, h̄_s) = β_t · K(h_t, h̄_s),   K(u, v) = u·v / (‖u‖ ‖v‖),   β_t = softplus(w_βᵀ h_t + b_β) ≥ 0

    The key strength β_t is emitted by the controller (here: the decoder state) and sharpens
    (β large) or flattens (β → 0) the focus; the cosine itself is bounded in [−1, 1].
    """

    def __init__(self, d_query: int, eps: float = 1e-8):
        super().__init__()
        self.beta = nn.Linear(d_query, 1)
        self.eps = eps
        with torch.no_grad():  # start with a usefully sharp focus: β ≈ 5
            self.beta.weight.zero_()
            self.beta.bias.fill_(5.0)

    def keys(self, memory: Tensor) -> Tensor:
        return memory / memory.norm(dim=-1, keepdim=True).clamp_min(self.eps)  # (B, S, d) unit rows

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        q = query / query.norm(dim=-1, keepdim=True).clamp_min(self.eps)  # (B, T, d)
        beta = F.softplus(self.beta(query))  # (B, T, 1)
        return beta * (q @ keys.transpose(1, 2))  # (B, T, S)


class LocationScore(Score):
    """Location-based (Luong et al., 2015, eq. 8): a_t = softmax(W_a h_t), the scores computed from
    the decoder state alone, one per source position: score(h_t, h̄_s) = (W_a h_t)_s.
    W_a has a row per position up to ``max_positions``; a source of S tokens uses the first S."""

    def __init__(self, d_query: int, max_positions: int):
        super().__init__()
        self.W_a = nn.Linear(d_query, max_positions)

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        s = keys.size(1)
        if s > self.W_a.out_features:
            raise ValueError(f"location-based attention covers {self.W_a.out_features} source positions "
                             f"(max_positions), got a source of {s}")
        return self.W_a(query)[..., :s]  # (B, T, S)


def build_score(name: str, d_query: int, d_key: int, max_positions: int = 1024) -> Score:
    """The score module called ``name`` (one of :data:`SCORES`)."""
    if name in ("dot", "scaled_dot", "cosine") and d_query != d_key:
        raise ValueError(f"the {name} score needs queries and keys of one size, got {d_query} and {d_key}")
    if name == "dot":
        return DotScore()
    if name == "scaled_dot":
        return ScaledDotScore()
    if name == "general":
        return GeneralScore(d_query, d_key)
    if name == "additive":
        return AdditiveScore(d_query, d_key)
    if name == "cosine":
        return CosineScore(d_query)
    if name == "location":
        return LocationScore(d_query, max_positions)
    raise ValueError(f"unknown score {name!r}; choose one of {', '.join(SCORES)}")


def attention_weights(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax over the source of ``scores (B, T, S)``; ``mask`` (True = may attend) broadcastable to
    ``(B, T, S)``, e.g. ``padding_mask(src)[:, 0]`` ``(B, 1, S)``. Masked positions get weight 0."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)  # (B, T, S)


def attend(score: Score, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Context vectors c_t = Σ_s a_t(s) h̄_s ``(B, T, d_v)`` and the weights a ``(B, T, S)``."""
    a = attention_weights(score(query, keys), mask)  # (B, T, S)
    return a @ values, a


__all__ = ["SCORES", "Score", "DotScore", "ScaledDotScore", "GeneralScore", "AdditiveScore", "CosineScore",
           "LocationScore", "build_score", "attention_weights", "attend"]
