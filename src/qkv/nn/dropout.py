"""Dropout (Srivastava et al., 2014) with a cheaper mask on the CPU.

    dropout(x) = x · m / (1 − p),   m_i ~ Bernoulli(1 − p), drawn anew at every call in training

torch's CPU dropout draws one random number per element (``bernoulli_``). On the Multi30k recipe
that was 11% of a training update on one thread (34 masks per update). :func:`dropout` draws
64-bit words with ``random_`` instead and reads four 16-bit lanes from each. Each lane is uniform
on 65,536 values. An element is dropped when its lane is one of the lowest ``round(p · 65536)``
values, and kept elements are scaled by 65536 / (number of kept values), so E[dropout(x)] = x
exactly. The one difference from torch's own is that p is quantised to 1/65,536 (0.3 becomes
0.300003).

On other devices (CUDA's fused kernel is already fast), for integer tensors, where the
quantised p would be 0 or 1, and inside ``torch.compile`` (whose tracer does not take ``random_``;
the compiled code generates its own masks), it is :func:`torch.nn.functional.dropout`. Outside training it
returns its input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LANE_VALUES = 1 << 16  # a 16-bit lane takes 65,536 values, uniform on [-32768, 32767]


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """A boolean mask of ``shape`` keeping each element with probability 1 − p (p quantised to
    1/65,536), and the scale 1 / (kept fraction) for the kept elements."""
    dropped = round(p * LANE_VALUES)
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None)
    lanes = words.view(torch.int16)[:n].view(shape)  # four uniform 16-bit lanes per 64-bit word
    return lanes >= dropped - LANE_VALUES // 2, LANE_VALUES / (LANE_VALUES - dropped)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the cheaper CPU mask described above."""
    if not training or p == 0.0:
        return x
    dropped = round(p * LANE_VALUES)
    if x.device.type != "cpu" or not x.is_floating_point() or not 0 < dropped < LANE_VALUES \
            or torch.compiler.is_compiling():  # p outside [0, 1] too; torch.compile traces no random_
        return F.dropout(x, p, training)
    keep, scale = keep_mask(x.shape, p, x.device)
    return _Dropout.apply(x, keep, scale)


class _Dropout(torch.autograd.Function):
    """x · m · scale with the boolean mask saved for the backward pass (one byte per element)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None
