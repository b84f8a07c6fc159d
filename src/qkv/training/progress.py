"""How long a run has trained and how long it has left: the clock of the progress lines.

    step 200/600  epoch 3  loss 4.012  lr 3.50e-04  2,510 tokens/s  elapsed 0:41  left ~1:22

The estimate is the one fairseq's and Hugging Face's progress lines give: the updates still to go
at the run's average time per update so far, or the time ``max_time`` still allows, whichever
ends first. Early stopping and ``max_epochs`` may end a run sooner; they are not foreseen.
"""

from __future__ import annotations


def clock(seconds: float) -> str:
    """``M:SS`` under an hour, ``H:MM:SS`` from one hour on (hours unbounded): 41 -> 0:41, 3725 -> 1:02:05."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def time_left(step: int, max_steps: int, elapsed: float, max_time: float = 0.0) -> tuple[float, str] | None:
    """Seconds of training left and the limit that ends it (``"max_steps"`` or ``"max_time"``).

    ``step`` updates took ``elapsed`` seconds (over every resume); ``max_time`` 0 is no time limit.
    None while there is nothing to estimate from (no update made yet, and no time limit)."""
    by_steps = (max_steps - step) * elapsed / step if step > 0 else None
    by_time = max(0.0, max_time - elapsed) if max_time else None
    if by_steps is None and by_time is None:
        return None
    if by_time is not None and (by_steps is None or by_time < by_steps):
        return by_time, "max_time"
    return max(0.0, by_steps), "max_steps"


def clock_fields(step: int, max_steps: int, elapsed: float, max_time: float = 0.0) -> str:
    """``elapsed 0:41  left ~1:22`` for a progress line; ``(max_time)`` follows when that limit ends
    the run first."""
    out = f"elapsed {clock(elapsed)}"
    left = time_left(step, max_steps, elapsed, max_time)
    if left is not None:
        out += f"  left ~{clock(left[0])}" + ("" if left[1] == "max_steps" else " (max_time)")
    return out
