"""Normalisation of the residual stream: the paper's LayerNorm, or RMSNorm (``ModelConfig.norm``).

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + ε) · g + b         (Ba et al., 2016; the paper)
    RMSNorm(x)   = x / sqrt(mean(x²) + ε) · g  (+ b)                 (Zhang and Sennrich, 2019)

RMSNorm drops the centring (and, in T5 and Llama, the bias): one statistic instead of two. It is
computed in float32 whatever the input's dtype, as T5 and Llama do, and cast back before the gain.
``ModelConfig.norm_bias`` decides the bias of either kind.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight (+ bias)`` over the last dimension."""

    def __init__(self, d_model: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, bias={self.bias is not None}"


def make_norm(kind: str, d_model: int, eps: float, bias: bool = True) -> nn.Module:
    """The norm ``kind`` (``layernorm`` | ``rmsnorm``) of width ``d_model``; the defaults are the paper's
    LayerNorm with its bias (a plain :class:`torch.nn.LayerNorm`, as every checkpoint has it)."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps) if bias else nn.LayerNorm(d_model, eps=eps, bias=False)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps, bias=bias)
    raise ValueError(f"unknown norm {kind!r}")


__all__ = ["RMSNorm", "make_norm"]
