"""Rotary position embeddings, RoPE (Su et al., 2021, "RoFormer"; ``ModelConfig.positional = "rotary"``).

Nothing is added to the token embeddings. Inside every self-attention the query and the key of the
token at position m are rotated, pair of dimensions by pair, by the angles m·θ_i:

    θ_i = θ^(-2i / d_k),  i = 0 .. d_k/2 - 1                 (θ = ``ModelConfig.rope_theta``, 10000)
    RoPE(x, m) = x · cos(mθ) + rotate_half(x) · sin(mθ)
    rotate_half([x_1, x_2]) = [-x_2, x_1]                     (x_1, x_2: the two halves of x)

so that q_mᵀ k_n depends on the positions only through m - n. This is the "rotate-half" layout
of GPT-NeoX, Llama and transformers (dimension i is paired with i + d_k/2, not with i + 1 as in the
RoFormer paper); the two are the same model up to a permutation of W^Q's and W^K's rows.

Keys are rotated once, before they enter a :class:`~qkv.nn.attention.KVCache`: incremental
decoding rotates only the new position's query and key, at that position.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x (B, h, T, d_k)`` with ``cos``, ``sin`` ``(B or 1, 1, T, d_k)``."""
    return x * cos + rotate_half(x) * sin


class RotaryPositions(nn.Module):
    """The positional module of a rotary stack: adds zeros to the embeddings (:meth:`forward`, so the
    stack is run as every other) and gives each self-attention its rotation (:meth:`attention_inputs`)."""

    def __init__(self, d_model: int, d_k: int, theta: float = 10000.0):
        super().__init__()
        self.d_model, self.d_k, self.theta = d_model, d_k, theta
        # as transformers computes it (float32 powers), so that the angles are the same numbers
        inv_freq = 1.0 / (theta ** (torch.arange(0, d_k, 2, dtype=torch.int64).float() / d_k))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        return self.inv_freq.new_zeros(1, length, self.d_model)

    def attention_inputs(self, q_positions: torch.Tensor, k_positions: torch.Tensor | None,
                         dtype: torch.dtype) -> dict:
        """``rope=(cos, sin)`` each ``(B or 1, 1, T, d_k)`` for the queries' (and new keys') positions
        ``q_positions (B or 1, T)``."""
        freqs = q_positions[..., None].float() * self.inv_freq  # (B, T, d_k/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, d_k)
        return {"rope": (emb.cos().to(dtype), emb.sin().to(dtype))}

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, theta={self.theta:g}"


__all__ = ["RotaryPositions", "apply_rotary", "rotate_half"]
