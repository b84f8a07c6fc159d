"""Restricted self-attention: each position attends to a neighbourhood of size r (Table 1, section 4).

    RestrictedAttention(x)_i = Σ_{j : |i - j| <= r} softmax_j(q_i · k_j / √d_k) v_j

"To improve computational performance for tasks involving very long sequences, self-attention
could be restricted to considering only a neighborhood of size r in the input sequence centered
around the respective output position. This would increase the maximum path length to O(n/r)."
Table 1 gives its cost per layer as O(r·n·d).

Two ways to compute the same thing, with the same parameters as :class:`MultiHeadAttention`:

* ``dense``: :class:`MultiHeadAttention` with the band mask :func:`qkv.masks.local_mask`. Simple,
  but the n² scores are still computed (then masked): O(n²·d) work, like full attention.
* blocked (the default): the queries are cut into blocks of r; block b attends only to the 3r keys
  of blocks b-1, b, b+1 (which contain every key within r of its queries), with the in-block band
  :func:`qkv.masks.local_block_mask`. That is (n/r)·r·3r = 3·r·n scores: O(r·n·d) work, as Table 1.

The two agree to rounding (``tests/test_complexity.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.masks import local_block_mask, local_mask
from qkv.nn.attention import MultiHeadAttention


class RestrictedSelfAttention(nn.Module):
    """Multi-head self-attention over the window ``|i - j| <= r``; ``x (B, n, d) -> (B, n, d)``."""

    def __init__(self, d_model: int, n_heads: int, r: int, dense: bool = False):
        super().__init__()
        if r < 1:
            raise ValueError(f"RestrictedSelfAttention: the neighbourhood radius r must be >= 1, got {r}")
        self.r, self.dense = r, dense
        self.attn = MultiHeadAttention(d_model, n_heads)  # W^Q, W^K, W^V, W^O as in full attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        if self.dense:
            return self.attn.self_attention(x, local_mask(n, self.r, x.device))[0]
        if n <= self.r + 1:  # every pair is within r: the window is the whole sequence
            return self.attn.self_attention(x)[0]
        return self._blocked(x)

    def _blocked(self, x: torch.Tensor) -> torch.Tensor:
        a, r = self.attn, self.r
        b, n, _ = x.shape
        q, k, v = a.in_proj(x).chunk(3, dim=-1)  # (B, n, d_model) each
        q, k, v = a._split(q), a._split(k), a._split(v)  # (B, h, n, d_k)
        n_blocks = -(-n // r)
        pad = n_blocks * r - n
        q = F.pad(q, (0, 0, 0, pad))  # (B, h, n_blocks·r, d_k)
        k = F.pad(k, (0, 0, r, pad + r))  # (B, h, (n_blocks + 2)·r, d_k): a block of padding each side
        v = F.pad(v, (0, 0, r, pad + r))
        h, d_k = q.size(1), q.size(-1)
        q = q.reshape(b * h, n_blocks, r, d_k)  # (B·h, n_blocks, r, d_k)
        k = k.unfold(2, 3 * r, r).transpose(-1, -2).reshape(b * h, n_blocks, 3 * r, d_k)  # (B·h, n_blocks, 3r, d_k)
        v = v.unfold(2, 3 * r, r).transpose(-1, -2).reshape(b * h, n_blocks, 3 * r, d_k)
        mask = local_block_mask(n, r, x.device)  # (n_blocks, r, 3r), broadcast over B·h
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B·h, n_blocks, r, d_k)
        out = out.reshape(b, h, n_blocks * r, d_k)[:, :, :n]  # (B, h, n, d_k)
        out = out.transpose(1, 2).reshape(b, n, h * d_k)  # (B, n, h·d_v): Concat(heads)
        return a.out_proj(out)
