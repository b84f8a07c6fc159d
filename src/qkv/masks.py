"""Attention masks — the only place masks are built.

One convention across qkv: a boolean tensor, ``True`` = the query may attend to that key
(the polarity of :func:`torch.nn.functional.scaled_dot_product_attention`), broadcastable to
``(B, h, T_q, T_k)``.

* padding mask: keys that are padding are hidden from every query;
* causal mask: position i sees positions j <= i only ("masking out (setting to -inf) all values in
  the input of the softmax which correspond to illegal connections", section 3.2.3).
"""

from __future__ import annotations

import torch

from qkv.config import PAD


def padding_mask(tokens: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """``(B, T)`` token ids -> ``(B, 1, 1, T)`` mask, True on real tokens."""
    return (tokens != pad_id)[:, None, None, :]  # (B, 1, 1, T)


def causal_mask(t_q: int, t_k: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """``(1, 1, T_q, T_k)`` lower-triangular mask: query i sees keys j <= i + (T_k - T_q).

    With ``T_k > T_q`` the queries are the last ``T_q`` positions of a longer sequence (as in
    incremental decoding with a cache).
    """
    t_k = t_q if t_k is None else t_k
    q = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)
    k = torch.arange(t_k, device=device)[None, :]
    return (k <= q)[None, None]  # (1, 1, T_q, T_k)


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of the given masks (``None`` = no restriction); broadcasting applies."""
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out & m
    return out
