"""Attention masks — the only place masks are built.

One convention across qkv: a boolean tensor, ``True`` = the query may attend to that key
(the polarity of :func:`torch.nn.functional.scaled_dot_product_attention`), broadcastable to
``(B, h, T_q, T_k)``.

* padding mask: keys that are padding are hidden from every query;
* causal mask: position i sees positions j <= i only ("masking out (setting to -inf) all values in
  the input of the softmax which correspond to illegal connections", section 3.2.3);
* local (band) mask: position i sees positions j with |i - j| <= r, the "restricted" self-attention
  of Table 1 (section 4), dense (``local_mask``) or cut into blocks of r queries (``local_block_mask``).

Which tokens are real (:func:`real_tokens`) and which positions a length covers (:func:`length_mask`)
are asked here too, so that PAD is compared with in one place.
"""

from __future__ import annotations

import torch

from qkv.config import PAD


def real_tokens(tokens: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """``(B, T)`` token ids -> ``(B, T)`` bool, True on real tokens (not padding)."""
    return tokens != pad_id


def length_mask(lengths: torch.Tensor, t: int) -> torch.Tensor:
    """``(B,)`` lengths -> ``(B, T)`` bool, True at the positions ``< length`` of each row."""
    return torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]  # (B, T)


def key_padding_mask(real: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool, True on real keys -> ``(B, 1, 1, T)`` mask: every query may attend to those."""
    return real[:, None, None, :]  # (B, 1, 1, T)


def padding_mask(tokens: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """``(B, T)`` token ids -> ``(B, 1, 1, T)`` mask, True on real tokens."""
    return key_padding_mask(real_tokens(tokens, pad_id))  # (B, 1, 1, T)


def causal_mask(t_q: int, t_k: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """``(1, 1, T_q, T_k)`` lower-triangular mask: query i sees keys j <= i + (T_k - T_q).

    With ``T_k > T_q`` the queries are the last ``T_q`` positions of a longer sequence (as in
    incremental decoding with a cache).
    """
    t_k = t_q if t_k is None else t_k
    q = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)
    k = torch.arange(t_k, device=device)[None, :]
    return (k <= q)[None, None]  # (1, 1, T_q, T_k)


def prefix_mask(tokens: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """``(B, P)`` right-padded prefixes -> ``(B, 1, P, P)``: causal, and padding keys hidden.

    Every position also sees itself, so that a padded query's row is never empty (its output is
    unused, and no later query sees it): a softmax over nothing would be NaN.
    """
    p = tokens.size(1)
    itself = torch.eye(p, dtype=torch.bool, device=tokens.device)[None, None]  # (1, 1, P, P)
    return combine(causal_mask(p, device=tokens.device), padding_mask(tokens, pad_id)) | itself  # (B, 1, P, P)


def local_mask(n: int, r: int, device: torch.device | None = None) -> torch.Tensor:
    """``(1, 1, n, n)`` band mask: query i sees keys j with ``|i - j| <= r`` (a window of 2r + 1).

    Applied to dense attention it still costs n² score computations (the masked ones too); see
    :func:`local_block_mask` for the layout that does only O(r·n) of them.
    """
    if r < 0:
        raise ValueError(f"local_mask: the radius r must be >= 0, got {r}")
    i = torch.arange(n, device=device)
    return ((i[:, None] - i[None, :]).abs() <= r)[None, None]  # (1, 1, n, n)


def local_block_mask(n: int, r: int, device: torch.device | None = None) -> torch.Tensor:
    """The band ``|i - j| <= r`` for queries cut into blocks of r, ``(n_blocks, r, 3r)``.

    Block b holds queries ``p = b·r + i`` (i < r) and reads the 3r keys ``s = (b - 1)·r + j``
    (j < 3r): the previous, its own and the next block, which hold every key within r of its
    queries. True where ``|p - s| <= r`` and ``0 <= s < n`` (keys outside the sequence are padding).
    Every query, padded ones included, keeps at least one key, so no softmax row is empty.
    """
    if r < 1:
        raise ValueError(f"local_block_mask: the radius r must be >= 1, got {r}")
    n_blocks = -(-n // r)
    b = torch.arange(n_blocks, device=device)[:, None, None]
    p = b * r + torch.arange(r, device=device)[None, :, None]  # query positions (n_blocks, r, 1)
    s = (b - 1) * r + torch.arange(3 * r, device=device)[None, None, :]  # key positions (n_blocks, 1, 3r)
    return ((p - s).abs() <= r) & (s >= 0) & (s < n)  # (n_blocks, r, 3r)


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of the given masks (``None`` = no restriction); broadcasting applies."""
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out & m
    return out
