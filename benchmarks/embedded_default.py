"""Measure the embedded default: `qkv train` with no data, timed end to end.

Target: >= 95% exact match on the held-out split in under 5 minutes on 2 CPU cores.

    python benchmarks/embedded_default.py [--threads 2] [--out runs/bench-default]

Runs the same command a user runs (`qkv train --out DIR`) in a subprocess, times the whole of
it (tokenizer training, model training, validation, checkpointing, the final held-out test with
beam search) and prints one Markdown row for docs/results.md.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the target is for 2 CPU cores)")
    ap.add_argument("--out", default="runs/bench-default", help="run directory (replaced)")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    cmd = [sys.executable, "-m", "qkv", "train", "--out", args.out, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        return proc.returncode
    m = re.search(r"held-out test: ([\d.]+)% exact match on (\d+)", proc.stdout)
    exact = float(m.group(1)) if m else float("nan")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    print("\n| metric | target | measured | met |\n| --- | --- | --- | --- |")
    print(f"| held-out exact match | >= 95% | {exact:.1f}% | {'yes' if exact >= 95 else 'NO'} |")
    print(f"| wall time, end to end | < 300 s | {seconds:.0f} s | {'yes' if seconds < 300 else 'NO'} |")
    print(f"\nmachine: {os.cpu_count()} CPUs ({cpu}), {args.threads} threads, torch via `{' '.join(cmd[1:])}`; "
          f"date {datetime.date.today()}; commit {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
