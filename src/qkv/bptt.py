"""Backpropagation through time, truncated (Williams & Peng, 1990; as in Zaremba et al., 2014).

A long token stream ``(B, L)`` (B parallel streams, e.g. a corpus cut into B contiguous parts) is
cut into windows of ``bptt`` positions. Window k reads positions [k·bptt, k·bptt + n) and
predicts the next token at each, positions [k·bptt + 1, k·bptt + n + 1):

    inputs_k  = stream[:, k·bptt     : k·bptt + n]
    targets_k = stream[:, k·bptt + 1 : k·bptt + n + 1]        n = min(bptt, L − 1 − k·bptt)

so the windows together cover every (input, next token) pair of the stream exactly once.

The recurrent state is carried from one window to the next — the model keeps its memory of the
stream — but *detached* (:meth:`~qkv.nn.recurrent.RNNState.detach`): the gradient of window k's
loss stops at its first position. That bounds the memory and time of backpropagation to
``bptt`` steps; dependencies longer than that can still be used, but not learned through the
gradient. Each window is one update, with the gradient norm clipped (Pascanu et al., 2013) —
the exploding gradients of long recurrences make clipping part of the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor

from qkv.nn.recurrent import RNNState


@dataclass(frozen=True)
class Window:
    """One truncation window: ``inputs`` and ``targets`` ``(B, n)``, starting at stream position ``start``."""

    inputs: Tensor
    targets: Tensor
    start: int


def bptt_windows(stream: Tensor, bptt: int) -> Iterator[Window]:
    """Cut ``stream (B, L)`` into windows of ``bptt`` input positions (the last may be shorter)."""
    if bptt <= 0:
        raise ValueError(f"bptt must be positive, got {bptt}")
    if stream.dim() != 2:
        raise ValueError(f"stream must be (B, L), got shape {tuple(stream.shape)}")
    length = stream.size(1)
    for start in range(0, length - 1, bptt):
        n = min(bptt, length - 1 - start)
        yield Window(stream[:, start : start + n], stream[:, start + 1 : start + n + 1], start)


def carry(state: RNNState | None, truncate: bool = True) -> RNNState | None:
    """The state handed to the next window: detached when truncating (the gradient stops here)."""
    if state is None or not truncate:
        return state
    return state.detach()


def train_bptt(
    forward: Callable[[Tensor, Tensor, RNNState | None], tuple[Tensor, RNNState]],
    windows: Iterable[Window],
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.nn.Parameter],
    clip_norm: float = 0.0,
    state: RNNState | None = None,
    lr: Callable[[], float] | None = None,
) -> tuple[list[float], RNNState | None]:
    """Truncated BPTT over ``windows``: one update per window, the state carried across detached.

    ``forward(inputs (B, n), targets (B, n), state) -> (loss, new_state)`` computes the loss to
    minimise (e.g. the mean cross-entropy of the window); ``clip_norm > 0`` clips the gradient
    norm before each update; ``lr()``, if given, sets the rate before each update. Returns the
    windows' losses and the final (detached) state, to continue in the next epoch or batch.
    """
    params = list(parameters)
    losses = []
    for window in windows:
        state = carry(state)
        optimizer.zero_grad(set_to_none=True)
        loss, state = forward(window.inputs, window.targets, state)
        loss.backward()
        if clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        if lr is not None:
            for g in optimizer.param_groups:
                g["lr"] = lr()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, carry(state)


__all__ = ["Window", "bptt_windows", "carry", "train_bptt"]
