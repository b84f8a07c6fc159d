"""The learning-rate schedule of the paper (section 5.3), called "noam" after its author.

The rate rises linearly for ``warmup`` steps, then decays with the inverse square root of the
step number. The paper trains with Adam (beta1 = 0.9, beta2 = 0.98, eps = 1e-9) and warmup = 4000.
"""

from __future__ import annotations


def noam(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Learning rate at ``step`` (counted from 1; step 0 is treated as 1), equation of section 5.3:

        lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

    The two terms are equal at step == warmup, where the rate peaks (see :func:`peak_lr`):
    before it the rate grows linearly in ``step``, after it decays as ``step^-0.5``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if d_model <= 0 or warmup <= 0:
        raise ValueError(f"d_model and warmup must be positive, got {d_model} and {warmup}")
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def peak_lr(d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The highest rate of :func:`noam`, reached at step == warmup: scale * (d_model * warmup)^-0.5."""
    if d_model <= 0 or warmup <= 0:
        raise ValueError(f"d_model and warmup must be positive, got {d_model} and {warmup}")
    return scale * (d_model * warmup) ** -0.5
