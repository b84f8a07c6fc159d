"""T5's relative position bias (Raffel et al., 2020, section 2.1; ``ModelConfig.positional = "relative"``).

Nothing is added to the token embeddings. Each head learns one scalar per *bucket* of the distance
``key position - query position``, added to its attention logits before the softmax; one table
``(buckets, h)`` serves every layer of a stack. Near distances get a bucket each, far ones share
logarithmically wider buckets up to ``max_distance``, beyond which all distances share the last:

    encoder (bidirectional): half the buckets for keys before the query, half for keys after;
    decoder (causal):        every bucket for keys before the query (later ones are masked anyway).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each ``key - query`` distance (``transformers``' ``_relative_position_bucket``)."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out = out + (relative > 0).long() * buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    max_exact = buckets // 2
    is_small = relative < max_exact
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (buckets - max_exact)).long()
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(is_small, relative, large)


class RelativePositions(nn.Module):
    """The positional module of a stack with relative positions: adds zeros to the embeddings and gives
    each self-attention the bias ``(B or 1, h, T_q, T_k)`` of its query and key positions."""

    def __init__(self, d_model: int, n_heads: int, buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True):
        super().__init__()
        self.d_model, self.buckets, self.max_distance, self.bidirectional = d_model, buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.randn(buckets, n_heads) * n_heads ** -0.5)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        return self.weight.new_zeros(1, length, self.d_model)

    def attention_inputs(self, q_positions: torch.Tensor, k_positions: torch.Tensor | None,
                         dtype: torch.dtype) -> dict:
        """``position_bias (B or 1, h, T_q, T_k)`` for queries at ``q_positions (B or 1, T_q)`` and keys
        at ``k_positions (B or 1, T_k)`` (None: the queries' own)."""
        k_positions = q_positions if k_positions is None else k_positions
        rel = k_positions[:, None, :] - q_positions[:, :, None]  # (B, T_q, T_k)
        bucket = relative_bucket(rel, self.bidirectional, self.buckets, self.max_distance)
        return {"position_bias": self.weight[bucket].permute(0, 3, 1, 2).to(dtype)}  # (B, h, T_q, T_k)

    def extra_repr(self) -> str:
        return (f"buckets={self.buckets}, max_distance={self.max_distance}, "
                f"{'bidirectional' if self.bidirectional else 'causal'}")


__all__ = ["RelativePositions", "relative_bucket"]
