"""The range of every number a command or a config file takes: values beyond it could only be a
mistake, or would overflow (a float past 1e308, a tensor of 10**12 rows, a length penalty whose
power is no longer a float).

A :class:`Bound` is declared with the option or config field it bounds (``setting(..., bound=)``
in :mod:`qkv.config`, the flags in :mod:`qkv.cli_options`, ``qkv serve``'s limits), and the same
object checks a value wherever it comes from: the command line (:meth:`Bound.parse`, before any
work starts), a TOML file or a checkpoint's settings (:meth:`Bound.problem` in ``validate()``).
``--help`` says each bound (:meth:`Bound.text`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qkv.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """Numbers of ``kind`` (int or float) from ``low`` to ``high``, both included; ``zero``: 0 is
    also allowed below ``low`` (0 meaning "off" or "the default", e.g. temperature 0 = greedy)."""

    kind: type
    low: float
    high: float
    zero: bool = False

    def _show(self, v: float) -> str:
        return _number(int(v) if self.kind is int or (float(v).is_integer() and abs(v) < 10**15) else v)

    def text(self) -> str:
        """``0 to 1,024``; ``0, or 1e-06 to 100``."""
        span = f"{self._show(self.low)} to {self._show(self.high)}"
        return f"0, or {span}" if self.zero else span

    def wanted(self, finite: bool = False) -> str:
        """``must be a whole number from 1 to 4,096``; ``must be 0 or a number from 1e-06 to 100``."""
        what = "a whole number" if self.kind is int else "a finite number" if finite else "a number"
        span = f"{self._show(self.low)} to {self._show(self.high)}"
        return f"must be 0 or {what} from {span}" if self.zero else f"must be {what} from {span}"

    def problem(self, value) -> str | None:
        """Why ``value`` is out of bounds (``must be ..., got ...``), or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.kind is int and
                                                                             not isinstance(value, int)):
            return f"{self.wanted()}, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{self.wanted(finite=True)}, got {value}"
        if self.low <= value <= self.high or (self.zero and value == 0):
            return None
        return f"{self.wanted()}, got {_number(value)}"

    def parse(self, text: str, name: str):
        """``text`` (a command-line value) as a number in bounds, or a one-line ConfigError naming
        the option ``name``."""
        try:
            value = int(text, 10) if self.kind is int else float(text)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} {self.wanted()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise ConfigError(f"{name} {problem}")
        return value


def _number(v: float) -> str:
    """1024, 65536, 1,000,000 (separators from 100,000 on); 1e+300; 0.5."""
    if isinstance(v, int):
        return f"{v:,}" if 10**5 <= abs(v) < 10**15 else str(v) if abs(v) < 10**15 else f"{v:.3g}"
    return f"{v:g}"


def whole(low: int, high: int, zero: bool = False) -> Bound:
    return Bound(int, low, high, zero)


def real(low: float, high: float, zero: bool = False) -> Bound:
    return Bound(float, low, high, zero)


# Ranges that several options share.
MAX_THREADS = 1024  # thousands of OpenMP threads fail to start (about 31,000 segfaulted a 2-core machine)
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit; the trainer adds 1_000_003 * rank + step to the seed
MAX_VOCAB = 1_000_000  # pieces of a vocabulary
MAX_STEPS = 10**9  # updates, validations, epochs
MAX_WIDTH = 65536  # d_model, positions, tokens of one sentence
MAX_LAYERS = 1024
MAX_BEAM = 4096  # beam size and n-best (checked against the vocabulary when the model is known)
MAX_LENGTH_PENALTY = 10.0  # ((5+1024)/6)^10 ~ 2e22 and 1024^10 ~ 1e30: still finite floats

__all__ = ["Bound", "whole", "real", "MAX_THREADS", "MAX_SEED", "MAX_VOCAB", "MAX_STEPS", "MAX_WIDTH", "MAX_LAYERS",
           "MAX_BEAM", "MAX_LENGTH_PENALTY"]
