"""torch.compile of qkv's decoder step against the eager step, in one process, one thread.

    python benchmarks/decode_compile.py RUN/best [--mode default]

Compiles ``model._eval_step`` (the eval-mode step that ``Translator.translate`` calls) with
``dynamic=True`` and decodes the first test_2016_flickr sentences greedily (batch 1: 20 sentences;
batch 32: 40) and with beam 5 (batch 1: 10), best of 3 after one warm-up call, eager first. Prints
each cell's times, the speed-up, the first (compiling) call's seconds and whether the outputs are
identical. Needs a C++ compiler for inductor.
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import torch

import qkv

TEST_SET = Path("/work/shared/data/multi30k/test_2016_flickr.en.gz")
CELLS = [(1, 1, 20), (1, 32, 40), (5, 1, 10)]  # (beam, batch, sentences)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a translation checkpoint directory")
    ap.add_argument("--mode", default="default", help="torch.compile mode (default: %(default)s)")
    ap.add_argument("--test", default=str(TEST_SET), help="source sentences, one per line (.gz or plain)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    opener = gzip.open if args.test.endswith(".gz") else open
    with opener(args.test, "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(40), f)]
    tr = qkv.load(args.model)

    def run(beam: int, batch: int, n: int):
        t = time.perf_counter()
        out = tr.translate(lines[:n], beam_size=beam, batch_size=batch)
        return time.perf_counter() - t, out

    eager = {}
    for beam, batch, n in CELLS:
        run(beam, batch, n)
        eager[beam, batch] = min(run(beam, batch, n) for _ in range(3))
    tr.model._eval_step = torch.compile(tr.model._eval_step, dynamic=True,
                                        mode=None if args.mode == "default" else args.mode)
    for beam, batch, n in CELLS:
        t0 = time.perf_counter()
        run(beam, batch, n)
        first = time.perf_counter() - t0
        t, out = min(run(beam, batch, n) for _ in range(3))
        e, ref = eager[beam, batch]
        print(f"beam {beam} batch {batch}: eager {e * 1000:.0f} ms, compiled {t * 1000:.0f} ms ({e / t:.2f}×; "
              f"first call {first:.1f} s), outputs identical: {out == ref}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
