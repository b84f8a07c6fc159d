"""What ``--engine ctranslate2`` costs over calling CTranslate2 directly: ``qkv.load(CKPT,
engine="ctranslate2").translate(...)`` against ``ctranslate2.Translator.translate_batch`` on the same
sentences and settings, greedy and beam 5, batch 1 and 32.

    python benchmarks/engine_overhead.py RUN/best --src test_2016_flickr.en.gz --n 256 --rounds 11 \\
        --json benchmarks/results/engine-overhead-DATE.json   # 11 rounds by default
    python benchmarks/engine_overhead.py RUN/best --quick     # a few sentences, two rounds: does it run

Two worker processes, one per side, each holding its model loaded for the whole run:

* engine: ``qkv.load(CKPT, engine="ctranslate2", threads=T).translate(sentences, beam_size=B,
  batch_size=N)`` -- what ``qkv translate --engine ctranslate2`` runs: SentencePiece ids, qkv's
  per-sentence length limits (the extra calls they need are counted, see below), qkv's scores;
* raw: ``ctranslate2.Translator(the engine's converted model, intra_threads=T, inter_threads=1)``,
  SentencePiece pieces in (``source.spm``), ``translate_batch(pieces, beam_size=B,
  max_batch_size=N, length_penalty=alpha, min_decoding_length=0, max_decoding_length=the
  longest of qkv's limits over the sentences)``, the texts out (``target.spm``), in a process that
  never imports torch.

Both sides get the checkpoint's length limits (``max_len_a · |x| + max_len_b``), its length penalty
alpha, ``length_norm="length"`` and ``early_stopping`` (the beam rule CTranslate2 has). The parent
sends the cells round-robin, the order of the two sides swapped every round, for ``--rounds``
rounds after one untimed warm-up per cell; each time is the median over rounds. Reported per
cell: seconds, sentences/s, raw seconds over engine seconds (1.0 = as fast; the target is at least
0.95) as the median over rounds of each round's ratio (the two sides of a round run back to back,
so a slow spell of the machine slows both; the ratio of the medians is kept in the JSON too), the ``translate_batch`` and ``score_batch`` calls the engine made, and the outputs that
differ from the raw ones (where qkv's per-sentence limit cut a greedy output or changed a search:
the raw call has only the longest). The load average and the OpenMP variables the workers saw are
recorded: on a shared machine the figures are indicative only (on the loaded 2-core EPYC the same
call swung by 2-5x between runs), and CTranslate2's speed in a process depends on its OpenMP
settings (``OMP_WAIT_POLICY``, and whether torch was imported first).
Needs ``pip install -c constraints.txt -e ".[export]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers.common import cpu_name, git_commit  # noqa: E402  (torch-free: the raw worker imports this file)

TEST_SET = Path("/work/shared/data/multi30k/test_2016_flickr.en.gz")
CELLS = [("greedy", 1, 1), ("greedy", 1, 32), ("beam 5", 5, 1), ("beam 5", 5, 32)]  # label, beam, batch
PAUSE = 0.2  # seconds between calls


# --- workers: one process per side, a JSON line in, a JSON line out ------------------------------------

def engine_side(setup: dict):
    import torch

    import qkv

    torch.set_num_threads(setup["threads"])
    model = qkv.load(setup["model"], engine="ctranslate2", threads=setup["threads"])
    def run(cell: dict, counted: bool = False) -> dict:
        before = dict(model.ct2.calls)  # the worker counts its calls (translate_batch, score_batch)
        texts = model.translate(cell["sentences"], **cell["settings"], beam_size=cell["beam"], batch_size=cell["batch"])
        calls = {name: n - before[name] for name, n in model.ct2.calls.items()}
        return {"texts": texts, **({"calls": calls} if counted else {})}

    cfg = model.decode_cfg
    src_ids = model.tokenizers.src.encode(setup["sentences"])
    info = {"directory": str(model.directory), "longest": max(model.budgets(src_ids, [], cfg)),
            "length_penalty": cfg.length_penalty, "max_len_a": cfg.max_len_a, "max_len_b": cfg.max_len_b,
            "min_len": cfg.min_len}
    return run, info


def raw_side(setup: dict):
    import ctranslate2  # never torch
    import sentencepiece as spm

    directory = Path(setup["directory"])
    translator = ctranslate2.Translator(str(directory), device="cpu", intra_threads=setup["threads"],
                                        inter_threads=1)
    src = spm.SentencePieceProcessor(model_file=str(directory / "source.spm"))
    tgt = spm.SentencePieceProcessor(model_file=str(directory / "target.spm"))

    def run(cell: dict, counted: bool = False) -> dict:
        pieces = src.encode(cell["sentences"], out_type=str)
        results = translator.translate_batch(pieces, beam_size=cell["beam"], max_batch_size=cell["batch"],
                                             length_penalty=cell["length_penalty"], min_decoding_length=0,
                                             max_decoding_length=cell["longest"])
        return {"texts": tgt.decode([r.hypotheses[0] for r in results]),
                **({"calls": {"translate_batch": 1, "score_batch": 0}} if counted else {})}

    return run, {}


def worker(side: str) -> int:
    setup = json.loads(sys.stdin.readline())
    run, info = (engine_side if side == "engine" else raw_side)(setup)
    print(json.dumps(info), flush=True)
    counts: dict = {}
    for line in sys.stdin:
        cell = json.loads(line)
        key = (cell["beam"], cell["batch"])
        if key not in counts:  # the warm-up: untimed, its calls counted
            counts[key] = run(cell, counted=True)["calls"]
        t0 = time.perf_counter()
        timed = run(cell)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "calls": counts[key], "texts": timed["texts"]}), flush=True)
    return 0


class Worker:
    def __init__(self, side: str, setup: dict):
        env = dict(os.environ)
        threads = str(setup["threads"])
        env.update({v: threads for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
        self.side = side
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", side],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self.ask(setup)

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.side} worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --- the parent ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint directory of a translation Transformer")
    ap.add_argument("--src", default=str(TEST_SET), help="source sentences, one a line (plain or gzip)")
    ap.add_argument("--n", type=int, default=256, help="first N non-empty lines (default 256)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16 sentences, 2 rounds: a smoke test")
    ap.add_argument("--json", help="also write the JSON here (e.g. benchmarks/results/engine-overhead-DATE.json)")
    ap.add_argument("--worker", choices=["engine", "raw"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.model:
        ap.error("give the checkpoint directory of a translation Transformer")
    if args.quick:
        args.n, args.rounds = 16, 2

    sys.path.insert(0, str(HERE.parent / "src"))
    from qkv.data.corpus import read_lines

    sentences = [s for s in read_lines(args.src) if s.strip()][: args.n]
    setup = {"model": args.model, "threads": args.threads, "sentences": sentences}
    load_before = os.getloadavg()
    engine = Worker("engine", setup)
    info = engine.info
    raw = Worker("raw", dict(setup, directory=info["directory"]))
    settings = {"length_norm": "length", "early_stopping": True}
    times: dict = {label: {"engine": [], "raw": []} for label in (f"{b} / batch {n}" for b, _, n in CELLS)}
    first: dict = {}
    try:
        for r in range(args.rounds):
            for label, beam, batch in CELLS:
                key = f"{label} / batch {batch}"
                cell = {"sentences": sentences, "beam": beam, "batch": batch, "settings": settings,
                        "length_penalty": info["length_penalty"], "longest": info["longest"]}
                sides = [("engine", engine), ("raw", raw)]
                for name, w in (sides if r % 2 == 0 else sides[::-1]):
                    out = w.ask(cell)
                    times[key][name].append(out["seconds"])
                    first.setdefault(key, {}).setdefault(name, out)
                    time.sleep(PAUSE)
                print(f"round {r + 1}/{args.rounds} {key}: engine {times[key]['engine'][-1]:.3f} s, "
                      f"raw {times[key]['raw'][-1]:.3f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
        raw.close()

    import ctranslate2

    cells = []
    for label, beam, batch in CELLS:
        key = f"{label} / batch {batch}"
        e, w = statistics.median(times[key]["engine"]), statistics.median(times[key]["raw"])
        paired = statistics.median(r / s for r, s in zip(times[key]["raw"], times[key]["engine"]))
        a, b = first[key]["engine"]["texts"], first[key]["raw"]["texts"]
        cells.append({"cell": key, "beam": beam, "batch": batch, "engine_s": e, "raw_s": w,
                      "engine_sent_per_s": len(sentences) / e, "raw_sent_per_s": len(sentences) / w,
                      "raw_over_engine": paired, "ratio_of_medians": w / e, "engine_calls": first[key]["engine"]["calls"],
                      "outputs_differing": sum(x != y for x, y in zip(a, b)),
                      "engine_rounds_s": times[key]["engine"], "raw_rounds_s": times[key]["raw"]})
    result = {
        "benchmark": "engine_overhead", "model": args.model, "source": args.src, "sentences": len(sentences),
        "rounds": args.rounds, "threads": args.threads, "quick": args.quick,
        "settings": {"length_norm": "length", "early_stopping": True, "length_penalty": info["length_penalty"],
                     "max_len_a": info["max_len_a"], "max_len_b": info["max_len_b"],
                     "raw_max_decoding_length": info["longest"]},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "environment": {v: os.environ.get(v) for v in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS",
                                                                   "MKL_NUM_THREADS")}},
        "ctranslate2": ctranslate2.__version__, "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()),
        "command": "python benchmarks/engine_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": "raw_over_engine >= 0.95 in every cell", "cells": cells,
    }
    print(f"| cell | engine s | raw s | raw/engine | engine calls (translate, score) | outputs differing |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in cells:
        calls = c["engine_calls"]
        print(f"| {c['cell']} | {c['engine_s']:.3f} | {c['raw_s']:.3f} | {c['raw_over_engine']:.2f} | "
              f"{calls['translate_batch']}, {calls['score_batch']} | {c['outputs_differing']}/{len(sentences)} |")
    print(f"load average before {load_before[0]:.2f}, after {result['machine']['load_average_after'][0]:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
