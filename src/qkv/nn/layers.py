"""Encoder and decoder layers (section 3.1, Figure 1).

Each sublayer is wrapped in a residual connection and layer normalisation:

    post-norm (the paper):  LayerNorm(x + Dropout(Sublayer(x)))
    pre-norm (option):      x + Dropout(Sublayer(LayerNorm(x)))     (+ a final LayerNorm per stack)

Encoder layer: self-attention, then the position-wise FFN. With ``causal=True`` (masked
self-attention) and a key/value cache it is also the layer of the decoder-only model: the
decoder layer of Figure 1 without its cross-attention sublayer.
Decoder layer: masked self-attention, cross-attention over the encoder output, then the FFN.

:class:`Switches` are the families' choices inside a layer (``ModelConfig``'s norm, FFN and attention
fields); their defaults are the paper's layer. Rotary and relative positions reach the
self-attention as ``rope`` / ``position_bias`` (from the stack's positional module).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.dropout import dropout
from qkv.nn.feed_forward import PositionwiseFeedForward
from qkv.nn.norm import make_norm


@dataclass(frozen=True)
class Switches:
    """A layer's family switches, the :class:`~qkv.config.ModelConfig` fields of the same names;
    the defaults are the paper's layer."""

    norm: str = "layernorm"
    norm_bias: bool = True
    ffn_gated: bool = False
    ffn_bias: bool = True
    n_kv_heads: int = 0
    qkv_bias: bool = True
    out_bias: bool = True
    attention_scale: bool = True

    @classmethod
    def of(cls, cfg) -> "Switches":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def attention(self, d_model: int, n_heads: int, dropout: float) -> MultiHeadAttention:
        return MultiHeadAttention(d_model, n_heads, dropout, self.n_kv_heads, self.qkv_bias, self.out_bias,
                                  self.attention_scale)

    def ffn(self, d_model: int, d_ff: int, activation: str) -> PositionwiseFeedForward:
        return PositionwiseFeedForward(d_model, d_ff, activation=activation, gated=self.ffn_gated, bias=self.ffn_bias)

    def residual(self, d_model: int, dropout: float, norm_first: bool, eps: float) -> "Residual":
        return Residual(d_model, dropout, norm_first, eps, make_norm(self.norm, d_model, eps, self.norm_bias))


PAPER = Switches()


class Residual(nn.Module):
    """The residual connection + LayerNorm around one sublayer, post-norm or pre-norm."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float = 1e-5, norm: nn.Module | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps) if norm is None else norm
        self.dropout, self.norm_first = dropout, norm_first

    def before(self, x: torch.Tensor) -> torch.Tensor:
        """What the sublayer reads: ``x`` (post-norm) or ``LayerNorm(x)`` (pre-norm)."""
        return self.norm(x) if self.norm_first else x

    def after(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        y = x + dropout(sublayer_out, self.dropout, self.training)
        return y if self.norm_first else self.norm(y)

    def eval_before(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`before` in eval mode, without the module call's overhead."""
        return _layer_norm(self.norm, x) if self.norm_first else x

    def eval_after(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        """:meth:`after` in eval mode (no dropout), without the module call's overhead."""
        y = x + sublayer_out
        return y if self.norm_first else _layer_norm(self.norm, y)


def _layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(norm) is not nn.LayerNorm:
        return norm(x)
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float, norm_first: bool,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, switches: Switches = PAPER):
        super().__init__()
        self.self_attn = switches.attention(d_model, n_heads, attention_dropout)
        self.ffn = switches.ffn(d_model, d_ff, activation)
        self.res_attn = switches.residual(d_model, dropout, norm_first, layer_norm_eps)
        self.res_ffn = switches.residual(d_model, dropout, norm_first, layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
        **positions,
    ) -> tuple[torch.Tensor, KVCache | None, torch.Tensor | None]:
        """``x (B, T, d)`` -> ``(B, T, d)``, the grown cache and the self-attention weights.

        ``mask`` ``(B, 1, 1, T)`` (padding) or ``(B, 1, T, T_k)``; ``causal``: position t sees
        positions <= t only; ``cache``: the keys/values of the positions before ``x``
        (incremental decoding), to which those of ``x`` are appended; ``positions``: ``rope`` or
        ``position_bias`` for the self-attention (rotary or relative positions).
        """
        a, cache, weights = self.self_attn.self_attention(self.res_attn.before(x), mask, causal, cache, need_weights,
                                                          **positions)
        x = self.res_attn.after(x, a)
        x = self.res_ffn.after(x, self.ffn(self.res_ffn.before(x)))
        return x, cache, weights

    def keys_values(self, x: torch.Tensor) -> KVCache:
        """The self-attention keys/values of the positions ``x (B, T, d)``, as a cache that
        positions after them can attend to (:meth:`forward` with ``cache``)."""
        return self.self_attn.project_kv(self.res_attn.before(x))


@dataclass
class DecoderLayerWeights:
    """Attention weights of one decoder layer, when asked for: ``(B, h, T, T)`` and ``(B, h, T, S)``."""

    self_attn: torch.Tensor | None
    cross_attn: torch.Tensor | None


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float, norm_first: bool,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, switches: Switches = PAPER):
        super().__init__()
        self.self_attn = switches.attention(d_model, n_heads, attention_dropout)
        self.cross_attn = switches.attention(d_model, n_heads, attention_dropout)
        self.ffn = switches.ffn(d_model, d_ff, activation)
        self.res_self = switches.residual(d_model, dropout, norm_first, layer_norm_eps)
        self.res_cross = switches.residual(d_model, dropout, norm_first, layer_norm_eps)
        self.res_ffn = switches.residual(d_model, dropout, norm_first, layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        memory_kv: KVCache,
        memory_mask: torch.Tensor | None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        beam: int = 1,
        **positions,
    ) -> tuple[torch.Tensor, KVCache | None, DecoderLayerWeights]:
        """``x (B, T, d)`` attends causally to itself (to the cache and itself when decoding
        incrementally) and to the encoder output's keys/values ``memory_kv`` (computed once).
        ``beam``: rows of ``x`` per sentence of ``memory_kv`` (``B = N * beam``, beam search; see
        :meth:`MultiHeadAttention.cross_attention`).

        Returns the output ``(B, T, d)``, the grown self-attention cache, and the weights.
        """
        # Training: the whole target at once, causal. Incremental decoding (T == 1 with a cache):
        # the new position may see every cached one, so no mask is needed.
        a, cache, w_self = self.self_attn.self_attention(
            self.res_self.before(x), causal=cache is None, cache=cache, need_weights=need_weights, **positions)
        x = self.res_self.after(x, a)
        a, w_cross = self.cross_attn.cross_attention(
            self.res_cross.before(x), memory_kv, memory_mask, need_weights=need_weights, beam=beam)
        x = self.res_cross.after(x, a)
        x = self.res_ffn.after(x, self.ffn(self.res_ffn.before(x)))
        return x, cache, DecoderLayerWeights(w_self, w_cross)

    def step(self, x: torch.Tensor, memory_kv: KVCache, memory_bias: torch.Tensor | None, cache: KVCache,
             beam: int = 1) -> tuple[torch.Tensor, KVCache]:
        """:meth:`forward` of one new position per row in eval mode, ``x (B, d)`` (no position
        axis), ``memory_bias`` the padding mask in additive form (or None: no padding; see
        :meth:`MultiHeadAttention.cross_attention_step`): the same result bit for bit, in fewer
        operations. Returns ``(B, d)`` and the grown cache."""
        a, cache = self.self_attn.self_attention_step(self.res_self.eval_before(x), cache)
        return self._after_self_attention(x, a, memory_kv, memory_bias, beam), cache

    def static_step(self, x: torch.Tensor, memory_kv: KVCache, memory_bias: torch.Tensor | None,
                    k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor, self_bias: torch.Tensor | None,
                    beam: int = 1, in_place: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`step` with the self-attention keys/values in fixed-size buffers
        (:meth:`~qkv.nn.attention.MultiHeadAttention.self_attention_into`): the same shapes at
        every step, for compiled decoding. Returns ``(B, d)`` and the buffers written."""
        a, k_buf, v_buf = self.self_attn.self_attention_into(self.res_self.eval_before(x), k_buf, v_buf, pos,
                                                             self_bias, in_place)
        return self._after_self_attention(x, a, memory_kv, memory_bias, beam), k_buf, v_buf

    def _after_self_attention(self, x: torch.Tensor, a: torch.Tensor, memory_kv: KVCache,
                              memory_bias: torch.Tensor | None, beam: int) -> torch.Tensor:
        x = self.res_self.eval_after(x, a)
        a = self.cross_attn.cross_attention_step(self.res_cross.eval_before(x), memory_kv, memory_bias, beam)
        x = self.res_cross.eval_after(x, a)
        return self.res_ffn.eval_after(x, self.ffn.eval_forward(self.res_ffn.eval_before(x)))
