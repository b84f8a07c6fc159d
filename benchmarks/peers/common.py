"""Torch-free helpers shared by every worker: the batch of token ids, timing, peak RSS.

Every system gets the same token ids (drawn here with a seeded ``random.Random``), so the
CTranslate2 worker, which must not import torch, sees exactly the batch the others see.

Token ids avoid the special ids of every system: qkv uses PAD 0, UNK 1, BOS 2, EOS 3; the Marian
models (Hugging Face, CTranslate2) use EOS 0, UNK 1 and PAD = decoder start = V - 1.
"""

from __future__ import annotations

import os
import platform
import random
import resource
import statistics
import subprocess
import time
from pathlib import Path

FIRST_ID = 4  # ordinary tokens are FIRST_ID .. vocab - 2 in every system


def set_thread_env(threads: int) -> None:
    """Thread-count variables read by OpenMP / MKL / OpenBLAS when they start (before any import)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo), for the machine line of a result."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The short commit of the working tree these benchmarks belong to, wherever they are run from
    ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def token_rows(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n_rows`` lists of ``length`` ordinary token ids (no specials), the same in every process."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab - 1) for _ in range(length)] for _ in range(n_rows)]


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# (wall seconds, process CPU seconds) of every timed call, for :func:`cpu_share`
_TIMED: list[tuple[float, float]] = []


def timed(fn, reps: int) -> list[float]:
    """Wall-clock seconds of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        out.append(wall)
        _TIMED.append((wall, time.process_time() - c0))
    return out


def cpu_share(threads: int) -> float | None:
    """CPU time this process got during its timed calls / (their wall time x threads).

    Close to 1 when the worker had its cores (OpenMP threads spin while they wait); well below 1
    when another process took them: a contended measurement."""
    wall = sum(w for w, _ in _TIMED)
    return round(sum(c for _, c in _TIMED) / (wall * threads), 3) if wall > 0 else None


def decode_result(spec: dict, task: str, seconds: list[float], **extra) -> dict:
    """Sentences/s and tokens/s of a decoding measurement (median of the timed repetitions)."""
    d = spec["decode"]
    t = statistics.median(seconds)
    tokens = d["batch"] * d["out_len"]
    return {"task": task, "seconds": seconds, "sent_per_s": d["batch"] / t, "tok_per_s": tokens / t,
            "sentences": d["batch"], "out_tokens_per_sentence": d["out_len"], **extra}


def train_result(spec: dict, seconds: list[float], **extra) -> dict:
    """Target tokens/s of a training measurement (median step time)."""
    tr = spec["train"]
    t = statistics.median(seconds)
    tokens = tr["batch"] * tr["tgt_len"]
    return {"task": "train", "seconds": seconds, "tok_per_s": tokens / t, "tgt_tokens_per_step": tokens, **extra}
