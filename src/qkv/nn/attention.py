"""Scaled dot-product attention and multi-head attention (section 3.2).

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V                                   (eq. 1)

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
        head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

with W_i^Q, W_i^K ∈ R^{d_model × d_k}, W_i^V ∈ R^{d_model × d_v}, W^O ∈ R^{h d_v × d_model} and
d_k = d_v = d_model / h.

The fast path is :func:`torch.nn.functional.scaled_dot_product_attention` (fused kernels, flash
attention on GPUs). :func:`attention_reference` is eq. 1 written out; it also returns the weights
when a caller asks for them (``need_weights=True``, e.g. for attention maps), and it is what CPU
training with attention dropout runs, so that the dropout draws :mod:`qkv.nn.dropout`'s cheaper
masks (SDPA's own CPU dropout draws one random number per weight). A test checks the two
agree, and that :class:`MultiHeadAttention` matches :class:`torch.nn.MultiheadAttention`.

:class:`MultiHeadAttention` has two entry points, one per use in Figure 1:

* :meth:`~MultiHeadAttention.self_attention`: queries, keys and values from the same sequence
  (the encoder, the decoder's masked sublayer, the decoder-only model); with a :class:`KVCache`,
  the new positions' keys/values are appended to those of the positions before (incremental
  decoding);
* :meth:`~MultiHeadAttention.cross_attention`: queries from the decoder, keys/values from the
  encoder output, projected once per sentence (:meth:`~MultiHeadAttention.project_kv`) and
  reused at every decoding step.

Masks are boolean, True = may attend (see :mod:`qkv.masks`).

The families' switches (:class:`~qkv.config.ModelConfig`) change the projections, never the
formula: ``n_kv_heads`` fewer key/value heads, each read by ``n_heads / n_kv_heads`` query heads
(grouped-query attention; ``in_proj`` is then ``(d + 2 n_kv d_k, d)``, the caches hold the
``n_kv`` heads); ``qkv_bias`` and ``out_bias`` the biases of ``in_proj`` and ``out_proj``;
``attention_scale = False`` drops eq. 1's 1/√d_k (T5). Rotary positions rotate q and k
(``rope``, :mod:`qkv.nn.rotary`) and relative ones add a bias to the logits (``position_bias``,
:mod:`qkv.nn.relative`), both in :meth:`MultiHeadAttention.self_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qkv.masks import causal_mask, combine
from qkv.nn.dropout import dropout
from qkv.nn.rotary import apply_rotary


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 1 written out. ``q (B, h, T_q, d_k)``, ``k (B, h, T_k, d_k)``, ``v (B, h, T_k, d_v)``;
    ``scale``: the factor of the logits (None: 1/√d_k); ``bias``: added to the logits (relative positions).

    Returns the output ``(B, h, T_q, d_v)`` and the weights ``(B, h, T_q, T_k)`` (after dropout
    is applied to the output's weights, the returned weights are the pre-dropout softmax).
    """
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(d_k) if scale is None else scale)  # (B, h, T_q, T_k)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        mask = combine(mask, causal_mask(q.size(-2), k.size(-2), q.device))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)  # (B, h, T_q, T_k)
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)  # a query that may attend to no key gets output 0, as SDPA's
        if not bool(has_key.all()):
            weights = weights.masked_fill(~has_key, 0.0)
    dropped = dropout(weights, dropout_p) if dropout_p > 0 else weights
    return dropped @ v, weights  # (B, h, T_q, d_v)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    need_weights: bool = False,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eq. 1 through torch's fused kernel; the explicit formula when the weights are wanted.

    ``is_causal``: query i sees keys j <= i + (T_k - T_q), i.e. the queries are the last T_q
    positions of the keys' sequence (as with a cache). ``scale``, ``bias``: see :func:`attention_reference`."""
    if need_weights:
        return attention_reference(q, k, v, mask, dropout_p, is_causal, scale, bias)
    if dropout_p > 0 and q.device.type == "cpu":  # training: qkv's cheaper dropout mask (qkv.nn.dropout)
        return attention_reference(q, k, v, mask, dropout_p, is_causal, scale, bias)[0], None
    if is_causal and (mask is not None or q.size(-2) != k.size(-2) or bias is not None):  # SDPA's own: no mask, T_q == T_k
        mask, is_causal = combine(mask, causal_mask(q.size(-2), k.size(-2), q.device)), False
    if bias is not None:  # the mask folded into the additive bias: -inf where a key may not be attended
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    kwargs = {} if scale is None else {"scale": scale}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)
    return out, None


@dataclass
class _Room:
    """The storage behind a growing :class:`KVCache`: ``(B, h, capacity, d_k)`` buffers, of which
    the first ``filled`` positions hold keys/values."""

    k: torch.Tensor
    v: torch.Tensor
    filled: int


@dataclass
class KVCache:
    """Keys and values of one attention layer kept across decoding steps, ``(B, h, T, d_k)``.

    For self-attention they grow by one position per step (:meth:`append`); for cross-attention
    they are computed once from the encoder output and reused at every step.

    A grown cache's ``k``/``v`` are views of the first T positions of buffers with room for up to
    ``GROW`` more (``room``), so that a step writes its one new position in place instead of
    copying the whole past (``torch.cat``); a reorder (beam search) copies the buffers with their
    room, one copy per step instead of two. Appending to a cache that is not the newest state of
    its buffer (a branch) copies instead, so every state stays valid.
    """

    k: torch.Tensor
    v: torch.Tensor
    room: _Room | None = None

    GROW = 8  # positions of spare room a new buffer gets

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """The cache with ``k``, ``v`` ``(B, h, t, d_k)`` added after its T positions."""
        b, h, t_past, d_k = self.k.shape
        t = t_past + k.size(2)
        room = self.room
        if (room is None or room.filled != t_past or room.k.size(2) < t
                or room.k.dtype != k.dtype or room.k.shape[:2] != k.shape[:2]):
            room = _Room(k.new_empty(b, h, t + self.GROW, d_k), v.new_empty(b, h, t + self.GROW, d_k), t_past)
            room.k[:, :, :t_past] = self.k
            room.v[:, :, :t_past] = self.v
        room.k[:, :, t_past:t] = k
        room.v[:, :, t_past:t] = v
        room.filled = t
        return KVCache(room.k[:, :, :t], room.v[:, :, :t], room)

    def reorder(self, indices: torch.Tensor) -> "KVCache":
        """Rows ``indices`` (beam back-pointers, dropped sentences): row ``j`` is row ``indices[j]``."""
        if self.room is None:
            return KVCache(self.k.index_select(0, indices), self.v.index_select(0, indices))
        t = self.k.size(2)
        room = _Room(self.room.k.index_select(0, indices), self.room.v.index_select(0, indices), t)
        return KVCache(room.k[:, :, :t], room.v[:, :, :t], room)


def eval_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer, without the module call's overhead where it is a plain
    ``nn.Linear`` (a quantised one runs its own forward)."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with h heads, d_k = d_v = d_model / h (section 3.2.2).

    The h projections W_i^Q, W_i^K, W_i^V are stored as one ``(3 d_model, d_model)`` matrix
    (``in_proj``), the layout of :class:`torch.nn.MultiheadAttention`: self-attention projects
    Q, K and V in one matrix multiply; cross-attention projects the queries and the memory's
    keys/values separately (the latter once per sentence when decoding).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, n_kv_heads: int = 0,
                 qkv_bias: bool = True, out_bias: bool = True, scale: bool = True):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        assert n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        self.kv_dim = self.n_kv_heads * self.d_k
        self.dropout = dropout
        self.scale = None if scale else 1.0  # SDPA's scale: None = 1/sqrt(d_k); 1.0 = none (T5)
        self.in_proj = nn.Linear(d_model, d_model + 2 * self.kv_dim, bias=qkv_bias)  # [W^Q; W^K; W^V], all heads
        self.out_proj = nn.Linear(d_model, d_model, bias=out_bias)  # W^O
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for lin in (self.in_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def _split(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads or self.n_heads, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

    def _bias(self, rows: slice) -> torch.Tensor | None:
        return None if self.in_proj.bias is None else self.in_proj.bias[rows]

    def _groups(self, k: torch.Tensor) -> torch.Tensor:
        """Keys or values of the n_kv heads ``(B, n_kv, T, d_k)`` as one per query head ``(B, h, T, d_k)``:
        query head i reads key/value head i // (h / n_kv) (grouped-query attention)."""
        groups = self.n_heads // self.n_kv_heads
        return k if groups == 1 else k.repeat_interleave(groups, dim=1)

    @property
    def plain(self) -> bool:
        """The paper's projections (every head its own keys/values, 1/√d_k): what the eval-mode
        steps :meth:`self_attention_step` and :meth:`self_attention_into` compute."""
        return self.n_kv_heads == self.n_heads and self.scale is None

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
        need_weights: bool, position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eq. 1 for every head, then Concat(heads) W^O: ``(B, h, T_q, d_k)`` -> ``(B, T_q, d_model)``."""
        p = self.dropout if self.training else 0.0
        k, v = self._groups(k), self._groups(v)
        out, weights = scaled_dot_product_attention(q, k, v, mask, p, is_causal, need_weights, self.scale,
                                                    position_bias)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.d_model)  # (B, T_q, h * d_v): Concat(heads)
        return self.out_proj(out), weights

    def empty_cache(self, batch_size: int, like: torch.Tensor) -> KVCache:
        """A cache of no positions ``(B, n_kv, 0, d_k)`` (on ``like``'s device and dtype) to decode from."""
        empty = like.new_zeros(batch_size, self.n_kv_heads, 0, self.d_k)  # (B, n_kv, 0, d_k)
        return KVCache(empty, empty)

    def self_attention(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache | None, torch.Tensor | None]:
        """Q, K and V all from ``x (B, T, d_model)``, in one fused projection.

        With a ``cache`` (incremental decoding) the new keys/values are appended to the cached
        ones, and the queries attend to every cached position and to themselves (``causal``:
        each query sees the positions up to its own, with ``x`` the last T positions).
        ``rope``: the rotary positions' ``(cos, sin)`` of ``x``'s positions, applied to the new queries
        and keys (cached keys are rotated already); ``position_bias``: added to the logits
        ``(B or 1, h, T, T_k)`` (relative positions).

        Returns ``(output (B, T, d_model), the grown cache or None, weights (B, h, T, T_k) or None)``.
        """
        q, k, v = self.in_proj(x).split((self.d_model, self.kv_dim, self.kv_dim), dim=-1)  # fused QKV
        q, k, v = self._split(q), self._split(k, self.n_kv_heads), self._split(v, self.n_kv_heads)  # (B, h|n_kv, T, d_k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            cache = cache.append(k, v)
            k, v = cache.k, cache.v  # (B, n_kv, T_past + T, d_k)
        out, weights = self._attend(q, k, v, mask, causal, need_weights, position_bias)
        return out, cache, weights

    def self_attention_step(self, x: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """:meth:`self_attention` of one new position per row, ``x (B, d_model)``, appended to
        ``cache``: the same operations on the same values (so the same result, bit for bit), with
        the position axis left out and fewer tensor operations (incremental decoding, eval mode)."""
        b = x.size(0)
        qkv = eval_linear(self.in_proj, x).view(b, 3, self.n_heads, 1, self.d_k)  # (B, 3, h, 1, d_k): fused QKV
        cache = cache.append(qkv[:, 1], qkv[:, 2])
        out = F.scaled_dot_product_attention(qkv[:, 0], cache.k, cache.v)  # (B, h, 1, d_k)
        return eval_linear(self.out_proj, out.reshape(b, self.d_model)), cache

    def self_attention_into(self, x: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor,
                            bias: torch.Tensor | None, in_place: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`self_attention_step` over buffers of a fixed capacity C, ``(B, h, C, d_k)``: the new
        key/value is written at position ``pos`` (a LongTensor ``(1,)``) and the query attends to
        the whole buffer under ``bias`` ``(1, 1, 1, C)``, 0 at the positions written so far and
        -inf after them. Every step has the same shapes (what compiled code specialises to,
        :mod:`qkv.decoding.compiled`); the result is the same as attending to the positions written
        so far only (a key under -inf gets weight exactly 0). ``bias`` None: the buffers are views of
        exactly the positions written so far, ``pos`` the last (no mask: the eager step's attention,
        :mod:`qkv.decoding.scripted`). ``in_place``: write into the buffers;
        else into copies (no input is changed: what CUDA graphs need). Returns the output
        ``(B, d_model)`` and the buffers written."""
        b = x.size(0)
        qkv = eval_linear(self.in_proj, x).view(b, 3, self.n_heads, 1, self.d_k)  # (B, 3, h, 1, d_k): fused QKV
        if in_place:
            k_buf, v_buf = k_buf.index_copy_(2, pos, qkv[:, 1]), v_buf.index_copy_(2, pos, qkv[:, 2])
        else:
            k_buf, v_buf = k_buf.index_copy(2, pos, qkv[:, 1]), v_buf.index_copy(2, pos, qkv[:, 2])
        out = F.scaled_dot_product_attention(qkv[:, 0], k_buf, v_buf, attn_mask=bias)  # (B, h, 1, d_k)
        return eval_linear(self.out_proj, out.reshape(b, self.d_model)), k_buf, v_buf

    def project_kv(self, memory: torch.Tensor) -> KVCache:
        """K = memory W^K, V = memory W^V for every head, ``(B, h, T_k, d_k)`` each: what
        :meth:`cross_attention` reads, computed once per sentence."""
        w, b = self.in_proj.weight[self.d_model :], self._bias(slice(self.d_model, None))
        k, v = F.linear(memory, w, b).chunk(2, dim=-1)  # (B, T_k, n_kv d_k) each
        return KVCache(self._split(k, self.n_kv_heads), self._split(v, self.n_kv_heads))

    def cross_attention_step(self, x: torch.Tensor, memory_kv: KVCache, mask: torch.Tensor | None,
                             beam: int = 1) -> torch.Tensor:
        """:meth:`cross_attention` of one position per row, ``x (B, d_model)`` with ``B = N * beam``:
        the same result bit for bit, in fewer tensor operations. ``mask``: None (no padding) or
        the additive form of the padding mask, ``(N, 1, 1, T_k)`` float, 0 where a key may be
        attended and -inf elsewhere (what :func:`~torch.nn.functional.scaled_dot_product_attention`
        makes of a boolean mask)."""
        b = x.size(0)
        w, bias = self.in_proj.weight[: self.d_model], self._bias(slice(None, self.d_model))
        q = F.linear(x, w, bias).view(-1, beam, self.n_heads, self.d_k).transpose(1, 2)  # (N, h, beam, d_k)
        kwargs = {} if self.scale is None else {"scale": self.scale}
        out = F.scaled_dot_product_attention(q, self._groups(memory_kv.k), self._groups(memory_kv.v), attn_mask=mask,
                                             **kwargs)  # (N, h, beam, d_k)
        return eval_linear(self.out_proj, out.transpose(1, 2).reshape(b, self.d_model))

    def cross_attention(
        self,
        x: torch.Tensor,
        memory_kv: KVCache,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
        beam: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries from ``x (B, T_q, d_model)``, keys/values ``memory_kv`` of the encoder output
        (:meth:`project_kv`), ``mask`` ``(B, 1, 1, T_k)``.

        ``beam``: ``x`` holds ``beam`` consecutive rows per row of ``memory_kv``, ``B = N * beam``
        against keys/values ``(N, h, T_k, d_k)`` and a mask ``(N, 1, 1, T_k)``: the hypotheses of
        one sentence in beam search share its source. Its ``beam`` rows are attended as
        ``beam * T_q`` queries of that one sentence, so the keys and values are never copied per
        hypothesis; each query's result is the same as with the keys/values repeated ``beam`` times.

        Returns ``(output (B, T_q, d_model), weights (B, h, T_q, T_k) or None)``.
        """
        b, t, _ = x.shape
        h, d_k = self.n_heads, self.d_k
        w, bias = self.in_proj.weight[: self.d_model], self._bias(slice(None, self.d_model))
        q = self._split(F.linear(x, w, bias))  # (B, h, T_q, d_k)
        if beam == 1:
            return self._attend(q, memory_kv.k, memory_kv.v, mask, False, need_weights)
        t_k = memory_kv.k.size(2)
        q = q.view(-1, beam, h, t, d_k).transpose(1, 2).reshape(-1, h, beam * t, d_k)  # (N, h, beam*T_q, d_k)
        out, weights = self._attend(q, memory_kv.k, memory_kv.v, mask, False, need_weights)  # (N, beam*T_q, d)
        out = out.view(b, t, self.d_model)  # (N*beam, T_q, d): rows of a sentence's queries are its hypotheses
        if weights is not None:  # (N, h, beam*T_q, T_k) -> (N*beam, h, T_q, T_k)
            weights = weights.view(-1, h, beam, t, t_k).transpose(1, 2).reshape(b, h, t, t_k)
        return out, weights
