"""Learning-rate schedules: the paper's (section 5.3), called "noam" after its author, and two
for models usually trained at a set rate (``constant``, ``inverse_sqrt``).

The noam rate rises linearly for ``warmup`` steps, then decays with the inverse square root of the
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


# --- schedules for models trained with a fixed rate (the recurrent models) ---------------------------

def constant(step: int, lr: float) -> float:
    """A constant rate, ``lrate = lr`` at every step (Adam with lr = 1e-3 is the usual choice for
    RNN/LSTM/GRU encoder–decoders)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return lr


def inverse_sqrt(step: int, lr: float, warmup: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then decay with the inverse square root of the
    step (fairseq's ``inverse_sqrt``; the shape of :func:`noam` with the peak set directly):

        lrate = lr * min(step / warmup, sqrt(warmup / step))      (step 0 is treated as 1)
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup <= 0:
        raise ValueError(f"warmup must be positive, got {warmup}")
    step = max(step, 1)
    return lr * min(step / warmup, (warmup / step) ** 0.5)


def learning_rate(schedule: str, step: int, *, d_model: int, warmup: int, scale: float = 1.0, lr: float = 0.0,
                  default_lr: float = 1e-3) -> float:
    """The rate of the named schedule (``noam`` | ``constant`` | ``inverse_sqrt``) at ``step``;
    ``lr = 0`` means ``default_lr`` for the last two."""
    if schedule == "noam":
        return noam(step, d_model, warmup, scale)
    rate = lr or default_lr
    if schedule == "constant":
        return constant(step, rate)
    if schedule == "inverse_sqrt":
        return inverse_sqrt(step, rate, warmup)
    raise ValueError(f"unknown schedule {schedule!r}; choose noam, constant or inverse_sqrt")


def cooldown(step: int, max_steps: int, cooldown_steps: int) -> float:
    """The factor on the rate over the last ``cooldown_steps`` updates of ``max_steps``: 1 before them, then
    falling linearly, (max_steps - step + 1) / cooldown_steps, to 1 / cooldown_steps at the last update
    (``cooldown_steps = 0``: always 1). A run shorter than its cooldown (a quick ``--max-steps`` on a
    recipe that sets one) cools down over all of its ``max_steps`` updates."""
    if cooldown_steps <= 0:
        return 1.0
    n = min(cooldown_steps, max_steps) if max_steps > 0 else cooldown_steps
    return min(1.0, max(0, max_steps - step + 1) / n)
