"""Measure the embedded default: `qkv train` with no data, timed end to end, over seeds and threads.

Targets: in every run, >= 99% exact match in every class of number length of the held-out test
(1-2 digits, 3, 4-5, 6), every number of 1-99 right, and the numbers the README shows right; on an
idle 2-core machine, under 5 minutes end to end.

    python benchmarks/embedded_default.py                              # the README's command, once
    python benchmarks/embedded_default.py --seed 1,2,3 --threads 1,2   # the six-run robustness table
    python benchmarks/embedded_default.py --seed 1,2,3 --threads 1,2 --jobs 6   # all at once (many cores)

Runs the command a user runs (`qkv train --out DIR`, with `--threads T` and `--seed S`) in a
subprocess, times the whole of it (tokenizer training, model training, validation, checkpointing,
the closing report with beam search) and reads the closing report: the held-out classes, the line
on every number of 1-99, and the ok/ERR lines of the shown examples. Prints a Markdown table for
docs/results.md and the machine: CPU model, its AVX2 / AVX-512 flags, the instruction set torch's
kernels use, cores, the load average before and after. With --jobs > 1 runs share the machine, so
their wall times are not those of an idle machine.
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
from concurrent.futures import ThreadPoolExecutor, as_completed

CLASS_FLOOR = 99.0  # % exact match in every class of the held-out test
SECONDS = 300  # end to end, on an idle 2-core machine


def parse_report(text: str) -> dict:
    """The figures of `qkv train`'s closing report on the embedded default (its stdout)."""
    overall = re.search(r"held-out test: ([\d.]+)% exact match on (\d+)", text)
    small = re.search(r"^every number 1-99: (\d+)/99 right", text, flags=re.M)
    return {
        "exact": float(overall.group(1)) if overall else float("nan"),
        "classes": [(name, float(p), count) for name, p, count in
                    re.findall(r"^  (\d(?:-\d)? digits) +([\d.]+)% \((\d+/\d+)\)$", text, flags=re.M)],
        "small": int(small.group(1)) if small else -1,
        "examples_ok": len(re.findall(r"^  ok  ", text, flags=re.M)),
        "examples_err": re.findall(r"^  ERR (.*)$", text, flags=re.M),
    }


def met(r: dict) -> bool:
    return (len(r["classes"]) == 4 and all(p >= CLASS_FLOOR for _, p, _ in r["classes"]) and r["small"] == 99
            and not r["examples_err"] and r["examples_ok"] > 0)


def run(out: str, threads: int, seed: int | None, extra: list[str]) -> dict:
    """`qkv train --out OUT --threads THREADS [--seed SEED] [EXTRA...]`, timed: its figures."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "qkv", "train", "--out", out, "--threads", str(threads),
           *(["--seed", str(seed)] if seed is not None else []), *extra]
    # OpenMP's workers sleep while they wait instead of spinning: on a busy machine spinning workers make a
    # 2-thread run many times slower; the arithmetic, and so the model, is the same either way
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    with open(f"{out}.log", "w", encoding="utf-8") as log:
        log.write(proc.stderr + proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} ended with status {proc.returncode}: see {out}.log")
    steps = re.findall(r"^step (\d+): valid loss", proc.stderr + proc.stdout, flags=re.M)
    return {**parse_report(proc.stdout), "seconds": seconds, "updates": steps[-1] if steps else "?",
            "seed": seed, "threads": threads, "report": proc.stdout}


HEADER = ("| seed | threads | held-out | 1-2 digits | 3 digits | 4-5 digits | 6 digits | 1-99 right | "
          "shown examples | wall time | all met |\n" + "| --- " * 11 + "|")


def row(r: dict) -> str:
    """A run's row of the Markdown table."""
    classes = " | ".join(f"{p:.1f}% ({count})" for _, p, count in r["classes"])
    wrong = [e.split("   (")[0].split("->")[0].strip() for e in r["examples_err"]]
    examples = (f"{r['examples_ok']} ok" if not wrong else
                f"{len(wrong)} wrong: " + ", ".join(f'"{w}"' for w in wrong[:3]) + (", ..." if len(wrong) > 3 else ""))
    return (f"| {r['seed'] if r['seed'] is not None else 'default'} | {r['threads']} | {r['exact']:.1f}% | {classes} | "
            f"{r['small']}/99 | {examples} | {r['seconds']:.0f} s ({r['updates']} updates) | "
            f"{'yes' if met(r) else 'NO'} |")


def cpu() -> str:
    """The CPU's model name, its AVX2 / AVX-512 flags, and the instruction set torch's kernels use."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        model = re.search(r"^model name\s*: (.*)$", info, flags=re.M).group(1).strip()
        flags = set(re.search(r"^flags\s*: (.*)$", info, flags=re.M).group(1).split())
    except (OSError, AttributeError):
        pass
    avx = ", ".join(name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags) or "no AVX2"
    if "avx512f" not in flags and flags:
        avx += ", no AVX-512"
    import torch

    return f"{model} ({avx}; torch {torch.__version__}, its CPU kernels: {torch.backends.cpu.get_cpu_capability()})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2", help="torch threads, e.g. 1,2: a run for each (default: 2)")
    ap.add_argument("--seed", default=None, help="training seeds, e.g. 1,2,3: a run for each (default: the recipe's "
                                                 "seed, the command a user runs)")
    ap.add_argument("--out", default="runs/bench-default", help="run directories: OUT-seedS-tT (replaced)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default: 1, one after the other)")
    ap.add_argument("train_flags", nargs="*", help="after --: more qkv train flags, to try another recipe "
                                                   "(e.g. -- --max-steps 1000); none for the recipe itself")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seed.split(",")] if args.seed else [None]
    threads = [int(t) for t in args.threads.split(",")]
    plan = [(f"{args.out}-seed{s if s is not None else 'default'}-t{t}", t, s) for s in seeds for t in threads]
    load_before = os.getloadavg()
    print(HEADER, flush=True)
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # a row as soon as its run ends
        for r in as_completed([pool.submit(run, *p, args.train_flags) for p in plan]):
            rows.append(r.result())
            print(row(rows[-1]), flush=True)
    load_after = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows.sort(key=lambda r: (r["seed"] or 0, r["threads"]))
    print("\n" + HEADER + "\n" + "\n".join(map(row, rows)))
    print(f"\ntargets: every class >= {CLASS_FLOOR:g}%, 99/99 of 1-99, every shown example right; "
          f"< {SECONDS} s end to end on an idle 2-core machine")
    print(f"machine: {os.cpu_count()} CPUs, {cpu()}; {args.jobs} run(s) at a time; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1 min); date {datetime.date.today()}; "
          f"commit {commit}")
    print(f"command: python benchmarks/embedded_default.py" + "".join(
        f" --{k} {v}" for k, v in (("seed", args.seed), ("threads", args.threads), ("jobs", args.jobs)) if v not in (None, 1))
          + (" -- " + " ".join(args.train_flags) if args.train_flags else ""))
    return 0 if all(met(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
