"""Measure the embedded default: `qkv train` with no data, timed end to end.

Target: >= 98% exact match on the held-out numbers and >= 97% in every class of number length
(1-2 digits, 3, 4-5, 6), in under 5 minutes on 2 CPU cores.

    python benchmarks/embedded_default.py [--threads 2] [--out runs/bench-default] [--seed 1,2,3]

Runs the same command a user runs (`qkv train --out DIR`) in a subprocess, times the whole of
it (tokenizer training, model training, validation, checkpointing, the final held-out test with
beam search) and prints Markdown rows for docs/results.md: overall, one per class, the wall time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import time


def run(out: str, threads: int, seed: int | None) -> tuple[dict, list[str]] | int:
    """`qkv train --out OUT` (with ``--seed`` unless None), timed: its figures and the command."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "qkv", "train", "--out", out, "--threads", str(threads),
           *(["--seed", str(seed)] if seed is not None else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        return proc.returncode
    m = re.search(r"held-out test: ([\d.]+)% exact match on (\d+)", proc.stdout)
    steps = re.findall(r"^step (\d+): valid loss", proc.stderr + proc.stdout, flags=re.M)
    return {"exact": float(m.group(1)) if m else float("nan"), "seconds": seconds,
            "updates": steps[-1] if steps else "?",
            "classes": re.findall(r"^  (\d(?:-\d)? digits) +([\d.]+)% \((\d+/\d+)\)$", proc.stdout, flags=re.M)}, cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the target is for 2 CPU cores)")
    ap.add_argument("--out", default="runs/bench-default", help="run directory (replaced; OUT-seedN with --seed)")
    ap.add_argument("--seed", default=None, help="training seeds, e.g. 1,2,3: one run each, one after the other "
                                                 "(default: the recipe's seed, the command a user runs)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seed.split(",")] if args.seed else [None]
    rows = []
    for seed in seeds:
        result = run(args.out if seed is None else f"{args.out}-seed{seed}", args.threads, seed)
        if isinstance(result, int):
            return result
        rows.append((seed, *result))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    print("\n| seed | metric | target | measured | met |\n| --- | --- | --- | --- | --- |")
    for seed, r, cmd in rows:
        name = "default" if seed is None else seed
        print(f"| {name} | held-out exact match | >= 98% | {r['exact']:.1f}% | {'yes' if r['exact'] >= 98 else 'NO'} |")
        for cls, percent, count in r["classes"]:
            print(f"| {name} | held-out exact match, {cls} | >= 97% | {float(percent):.1f}% ({count}) | "
                  f"{'yes' if float(percent) >= 97 else 'NO'} |")
        print(f"| {name} | wall time, end to end ({r['updates']} updates) | < 300 s | {r['seconds']:.0f} s | "
              f"{'yes' if r['seconds'] < 300 else 'NO'} |")
    print(f"\nmachine: {os.cpu_count()} CPUs ({cpu}), {args.threads} threads, torch via "
          f"`{' '.join(rows[0][2][1:])}`; date {datetime.date.today()}; commit {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
