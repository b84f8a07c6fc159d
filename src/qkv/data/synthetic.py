"""Generated sequence tasks: copy, reverse, sort, and the long-range task as translation pairs.

Each task maps a string of symbols (letters, one character each) to another::

    copy("cab")    == "cab"
    reverse("cab") == "bac"
    sort("cab")    == "abc"
    long_range: "cdbaeghf..." -> the symbol ``distance`` places before the last one

The long-range task (:func:`make_batch`, the task of ``qkv bench long-range``): a sequence of
T = ``distance`` + ``PREFIX`` + 1 random symbols whose answer is the symbol ``distance`` places before
the last one. :func:`long_range_pairs` writes its sequences as text, so that a translation model
(Transformer or recurrent) learns the same task. :func:`splits` draws the training and validation
pairs of a task; no validation source is in the training pairs. With a character tokenizer
(``--tokenizer char``) each symbol is one token.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from qkv.errors import QkvError

ALPHABET = string.ascii_lowercase
PREFIX = 4  # long-range task: distractors before the deciding symbol


def copy(s: str) -> str:
    return s


def reverse(s: str) -> str:
    return s[::-1]


def sort(s: str) -> str:
    return "".join(sorted(s))


TRANSFORMS: dict[str, Callable[[str], str]] = {"copy": copy, "reverse": reverse, "sort": sort}
TASKS = (*TRANSFORMS, "long_range")


def random_strings(n: int, min_len: int, max_len: int, symbols: int, rng: random.Random) -> list[str]:
    """``n`` strings of ``min_len..max_len`` symbols drawn uniformly from the first ``symbols`` letters."""
    if not 2 <= symbols <= len(ALPHABET):
        raise QkvError(f"symbols must be in [2, {len(ALPHABET)}], got {symbols}")
    if not 1 <= min_len <= max_len:
        raise QkvError(f"lengths must satisfy 1 <= min_len <= max_len, got {min_len}..{max_len}")
    letters = ALPHABET[:symbols]
    return ["".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def sequence_length(t: int) -> int:
    """T for distance t: PREFIX distractors, the deciding symbol, then t more symbols."""
    return PREFIX + 1 + t


def make_batch(batch: int, t: int, symbols: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences ``(B, T)`` of uniform random symbols in 0..K-1 and their labels ``(B,)``:
    the symbol at position T - t (1-based), i.e. index T - 1 - t."""
    import torch

    if t < 1 or symbols < 2:
        raise ValueError(f"need a distance t >= 1 and at least 2 symbols (got t={t}, K={symbols})")
    tokens = torch.randint(0, symbols, (batch, sequence_length(t)), generator=generator)  # (B, T)
    return tokens, tokens[:, -1 - t].clone()


def long_range_pairs(n: int, distance: int, symbols: int, seed: int) -> list[tuple[str, str]]:
    """``n`` sequences of :func:`make_batch` as (letters, the letter ``distance`` places before the last)."""
    import torch

    tokens, labels = make_batch(n, distance, symbols, torch.Generator().manual_seed(seed))  # (n, T), (n,)
    return [("".join(ALPHABET[i] for i in row), ALPHABET[int(y)]) for row, y in zip(tokens.tolist(), labels)]


def splits(task: str, n_train: int = 5000, n_valid: int = 200, min_len: int = 1, max_len: int = 12,
           symbols: int = 10, distance: int = 16, seed: int = 1) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(src, tgt)], "valid": [...]}`` of ``task`` (one of :data:`TASKS`); validation
    sources never occur in training. ``min_len``/``max_len``: source lengths of copy, reverse and sort;
    ``distance``: how far back the long-range task's answer lies."""
    if task not in TASKS:
        raise QkvError(f"unknown generated task {task!r}; choose one of {', '.join(TASKS)}")
    if n_train < 1 or n_valid < 1:
        raise QkvError(f"need at least one training and one validation pair, got {n_train} and {n_valid}")
    if task == "long_range":
        if distance < 1:
            raise QkvError(f"distance must be >= 1, got {distance}")
        pairs = long_range_pairs(n_train + n_valid, distance, symbols, seed)
    else:
        rng = random.Random(seed)
        pairs = [(s, TRANSFORMS[task](s)) for s in random_strings(n_train + n_valid, min_len, max_len, symbols, rng)]
    valid = pairs[n_train:]
    held = {s for s, _ in valid}
    return {"train": [p for p in pairs[:n_train] if p[0] not in held], "valid": valid}


__all__ = ["TASKS", "TRANSFORMS", "ALPHABET", "copy", "reverse", "sort", "random_strings", "long_range_pairs",
           "splits", "make_batch", "sequence_length", "PREFIX"]
