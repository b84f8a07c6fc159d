"""Compiled decoding (``qkv translate --compile``) against eager decoding, in one process.

    python benchmarks/decode_compile.py RUN/best [--device cpu] [--threads 1] [--rounds 3] [--json OUT]
    python benchmarks/decode_compile.py RUN/best --step-only

``--step-only``: the step function alone at batch 1 (one sentence, position 3), the static-shape
step eager against compiled as ``--compile`` compiles it, microseconds per call (best of 5 loops of
200 calls), no search.

Decodes the first test_2016_flickr sentences with qkv's eager step (the model itself) and with
:class:`qkv.decoding.compiled.CompiledDecoder` (the static-shape step, compiled), through the same
:func:`qkv.decoding.batch.decode_sentences` call ``qkv translate`` makes: greedy and beam 5, at batch
1 (20 and 10 sentences) and batch 32 (64 and 32 sentences). Each cell is first run once (the
compiled side compiles then: its seconds are printed), then eager and compiled alternate for
``--rounds`` rounds; the median of each is reported. Before timing, the outputs of both on the
first ``--identical`` sentences (greedy and beam 5, batch 32) are compared token for token.
Needs a C++ compiler on the CPU (inductor).
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

import qkv
from qkv.config import BOS, EOS
from qkv.decoding.batch import decode_sentences
from qkv.decoding.compiled import CompiledDecoder
from qkv.decoding.greedy import banned_ids

TEST_SET = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "multi30k" / "test_2016_flickr.en.gz"
CELLS = [(1, 1, 20), (1, 32, 64), (5, 1, 10), (5, 32, 32)]  # (beam, batch, sentences)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a translation checkpoint directory")
    ap.add_argument("--test", default=str(TEST_SET), help="source sentences, one per line (.gz or plain)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--identical", type=int, default=1000, help="sentences whose outputs are compared")
    ap.add_argument("--batches", default="1,32", help="batch sizes of the cells (default: %(default)s)")
    ap.add_argument("--step-only", action="store_true", help="time the step function alone at batch 1")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opener = gzip.open if args.test.endswith(".gz") else open
    with opener(args.test, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    tr = qkv.load(args.model, device=args.device)
    src = tr.tokenizers.src.encode(lines)
    banned = banned_ids(tr.tokenizers.tgt)
    compiled = CompiledDecoder(tr.model)
    cells = [cell for cell in CELLS if str(cell[1]) in args.batches.split(",")]
    if args.step_only:
        return step_only(tr, src[0], args.device)

    def decode(model, beam: int, batch: int, n: int):
        cfg = replace(tr.decode_cfg, beam_size=beam, batch_size=batch)
        if args.device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = decode_sentences(model, src[:n], cfg, banned)
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t, [h[0].tokens for h in out]

    report: dict = {"model": args.model, "device": args.device, "threads": args.threads, "cells": [],
                    "identical": {}, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    if args.device != "cpu":
        report["machine"] = torch.cuda.get_device_name()
    first = {}
    for beam, batch, n in cells:  # the first call compiles
        first[beam, batch] = decode(compiled, beam, batch, n)[0]
        print(f"beam {beam} batch {batch}: first compiled call {first[beam, batch]:.1f} s", flush=True)
    n_same = min(args.identical, len(src))
    for beam in (1, 5):
        ref, out = decode(tr.model, beam, 32, n_same)[1], decode(compiled, beam, 32, n_same)[1]
        same = sum(a == b for a, b in zip(ref, out))
        report["identical"][f"beam {beam}"] = [same, n_same]
        print(f"beam {beam}, batch 32: {same} of {n_same} outputs identical to eager", flush=True)
    times: dict = {cell: ([], []) for cell in cells}
    for _ in range(args.rounds):
        for beam, batch, n in cells:
            eager, comp = times[beam, batch, n]
            eager.append(decode(tr.model, beam, batch, n)[0])
            comp.append(decode(compiled, beam, batch, n)[0])
    print(f"{'cell':<22}{'eager':>10}{'compiled':>10}{'speed-up':>10}")
    for (beam, batch, n), (eager, comp) in times.items():
        e, c = statistics.median(eager), statistics.median(comp)
        name = f"{'greedy' if beam == 1 else f'beam {beam}'}, batch {batch}"
        print(f"{name:<22}{e * 1000:>8.0f}ms{c * 1000:>8.0f}ms{e / c:>9.2f}×")
        report["cells"].append({"beam": beam, "batch": batch, "sentences": n, "eager_s": eager, "compiled_s": comp,
                                "speedup": e / c, "first_compiled_call_s": first[beam, batch]})
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


@torch.inference_mode()
def step_only(tr, src: list[int], device: str) -> int:
    """The static-shape step at batch 1, eager and compiled, µs per call (best of 5 loops of 200)."""
    src_t = torch.tensor([src + [EOS]], device=device)
    for name, decoder in (("eager", CompiledDecoder(tr.model, compile=False)), ("compiled", CompiledDecoder(tr.model))):
        state = decoder.start(src_t)
        tokens = torch.tensor([BOS], device=device)
        for _ in range(4):  # positions 0-3 written; the next call writes position 3 again
            _, state = decoder.step(tokens, state)
        args = (tokens, tr.model.tgt_pos(1, 3)[0], torch.tensor([3], device=device), state.self_bias,
                [kv.k for kv in state.self_kv], [kv.v for kv in state.self_kv], [kv.k for kv in state.cross_kv],
                [kv.v for kv in state.cross_kv], state.memory_bias, 1, decoder._in_place)
        for _ in range(20):
            decoder._step(*args)
        best = float("inf")
        for _ in range(5):
            if device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                decoder._step(*args)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / 200)
        print(f"static-shape step, batch 1, {name}: {best * 1e6:.0f} µs per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
