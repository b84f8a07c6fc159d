"""Greedy decoding on the CPU: the eager loop against the loop in TorchScript (qkv.decoding.scripted).

    python benchmarks/decode_loop.py RUN/best [--test SRC] [--sentences N] [--rounds 5] [--threads 1]
                                              [--json OUT] [--quick]

Decodes the source sentences (token ids in, hypotheses out: :func:`qkv.decoding.batch.decode_sentences`
with the model's saved settings but ``beam_size=1``, not scored, as ``translate`` calls it) at
batch 1 and batch 32, with ``scripted_greedy`` off (the eager loop) and on. Each round times every
(batch, loop) cell once, the loops alternating within a batch size (interleaved: a machine's load
falls on both alike); the figures are medians over the rounds, and the speedup is the median of the
per-round ratios. Before timing, one untimed pass per cell (the scripted loop is built in the first)
checks the outputs: the tokens must be equal sentence for sentence, and with scores the greedy
log-probabilities equal (the largest difference is reported). Exits 1 when an output differs.

The JSON (``--json``; by default ``benchmarks/results/decode-loop-DATE.json``, none with
``--quick``) has every round's time, the medians, the load average before and after, the CPU, torch's
version and the commit. ``--quick``: 8 sentences, 1 round (what the test runs).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import qkv
from qkv.decoding.batch import decode_sentences
from qkv.decoding.greedy import banned_ids

ROOT = Path(__file__).resolve().parents[1]
TEST_SET = ROOT / ".." / "shared" / "data" / "multi30k" / "test_2016_flickr.en.gz"
BATCHES = (1, 32)
LOOPS = ("eager", "scripted")


def read_lines(path: str, n: int | None) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a translation Transformer checkpoint directory")
    ap.add_argument("--test", default=str(TEST_SET), help="source sentences, one per line (.gz or plain)")
    ap.add_argument("--sentences", type=int, default=0, help="the first N sentences (0: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="8 sentences, 1 round, no JSON unless --json")
    args = ap.parse_args()
    if args.quick:
        args.sentences, args.rounds = 8, 1
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    tr = qkv.load(args.model)
    model = tr.model
    lines = read_lines(args.test, args.sentences or None)
    src_ids = tr.fit_sources(tr.tokenizers.src.encode(lines))
    banned = banned_ids(tr.tokenizers.tgt)

    def cfg(batch: int, loop: str):
        from dataclasses import replace
        return replace(tr.decode_cfg, beam_size=1, nbest=1, batch_size=batch, scripted_greedy=loop == "scripted")

    # the outputs, untimed (the scripted loop is built here): tokens and greedy scores
    checks = {}
    for b in BATCHES:
        hyps = {loop: decode_sentences(model, src_ids, cfg(b, loop), banned) for loop in LOOPS}
        eager, scripted = ([h[0] for h in hyps[loop]] for loop in LOOPS)
        checks[b] = {
            "sentences": len(src_ids),
            "tokens_differ": sum(e.tokens != s.tokens for e, s in zip(eager, scripted)),
            "logprobs_equal": sum(e.logprob == s.logprob for e, s in zip(eager, scripted)),
            "max_logprob_diff": max((abs(e.logprob - s.logprob) for e, s in zip(eager, scripted)), default=0.0),
            "output_tokens": sum(len(e.tokens) + 1 for e in eager),  # EOS included
        }
        print(f"batch {b}: {checks[b]['tokens_differ']} of {len(src_ids)} outputs differ; logprobs equal "
              f"{checks[b]['logprobs_equal']}, largest difference {checks[b]['max_logprob_diff']:.3g}")

    times: dict[int, dict[str, list[float]]] = {b: {loop: [] for loop in LOOPS} for b in BATCHES}
    for r in range(args.rounds):
        for b in BATCHES:
            order = LOOPS if r % 2 == 0 else LOOPS[::-1]
            for loop in order:
                c = cfg(b, loop)
                t = time.perf_counter()
                decode_sentences(model, src_ids, c, banned, scores=False)
                times[b][loop].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + "  ".join(f"b{b} {loop} {times[b][loop][-1]:.2f}s"
                                             for b in BATCHES for loop in LOOPS), flush=True)
    load_after = os.getloadavg()

    cells = {}
    print(f"\n{'batch':>5} {'eager s':>9} {'scripted s':>11} {'speedup':>8} {'ms/sent eager':>14} "
          f"{'ms/sent scripted':>17}")
    for b in BATCHES:
        e, s = (statistics.median(times[b][loop]) for loop in LOOPS)
        speedup = statistics.median(x / y for x, y in zip(times[b]["eager"], times[b]["scripted"]))
        cells[b] = {"eager_s": times[b]["eager"], "scripted_s": times[b]["scripted"], "eager_median_s": e,
                    "scripted_median_s": s, "speedup_median_of_ratios": speedup, **checks[b]}
        n = len(src_ids)
        print(f"{b:>5} {e:>9.3f} {s:>11.3f} {speedup:>7.2f}× {1e3 * e / n:>14.2f} {1e3 * s / n:>17.2f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")

    out = args.json or (None if args.quick else
                        str(ROOT / "benchmarks" / "results" / f"decode-loop-{datetime.date.today().isoformat()}.json"))
    if out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        Path(out).write_text(json.dumps({
            "model": args.model, "test": args.test, "sentences": len(src_ids), "rounds": args.rounds,
            "threads": args.threads, "cells": {str(b): c for b, c in cells.items()},
            "identical": all(c["tokens_differ"] == 0 for c in cells.values()),
            "loadavg_before": load_before, "loadavg_after": load_after, "cpu": cpu_name(),
            "cores": os.cpu_count(), "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        }, indent=1) + "\n")
        print(f"wrote {out}")
    return 1 if any(c["tokens_differ"] for c in cells.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
