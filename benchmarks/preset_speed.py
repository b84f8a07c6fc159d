"""Training time of each preset on the CPU: seconds per update, and per 1,000 updates.

    python benchmarks/preset_speed.py                       # every preset, 2 threads
    python benchmarks/preset_speed.py --presets tiny,small --threads 2 --note "idle machine"

For each preset (its model, its TrainConfig: tokens per batch, vocabulary size, optimizer, label
smoothing, clipping) this builds the trainer `qkv train` builds and times ``Trainer.train_step``,
the update `qkv train` runs, on generated data: sentence pairs of random ordinary token ids, source
and target lengths drawn uniformly from 10..40 tokens (seeded), cut into batches of the preset's
``max_tokens`` by the trainer's own batching. A few updates are run first and not timed (warm-up);
then ``--updates`` updates are timed one by one (defaults: tiny 30, small 10, base 2, big 1). The
time per 1,000 updates is the median of the timed updates times 1,000 (the median: on a shared
machine a few updates wait for the CPU), extrapolated: nothing here runs 1,000 updates. Validation, checkpoints and logging are not included.

base and big would take many minutes per update on two cores (25,000 tokens per batch): their
updates are timed on 1/k of the preset's batch (``--split``, defaults base 16, big 32: batches of
``max_tokens / k`` tokens, k times fewer sentences of the same lengths) and the time multiplied by
k, a second extrapolation, linear in the tokens (the matrix products are; the optimizer step, a
small part, is counted k times). The file records k for each preset.

Writes ``src/qkv/preset_times.json`` (or ``--out``), which ``qkv info --preset NAME`` reads, with the
machine, the thread count, the load average after each preset, the command and the commit; a run
with --presets keeps the other presets' earlier figures (at the same thread count).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from peers.common import cpu_name, git_commit, set_thread_env  # noqa: E402

DEFAULT_OUT = ROOT.parent / "src" / "qkv" / "preset_times.json"
TIMED = {"tiny": 30, "small": 10, "base": 2, "big": 1}  # timed updates per preset
WARMUP = {"tiny": 3, "small": 2, "base": 1, "big": 1}  # untimed updates first
SPLIT = {"tiny": 1, "small": 1, "base": 16, "big": 32}  # timed on 1/k of the batch, times k
LENGTHS = (10, 40)  # source and target lengths of the generated pairs, uniform, inclusive


def generated_split(n_pairs: int, vocab: int, seed: int):
    """``n_pairs`` random sentence pairs as the trainer's split (what ``qkv train`` encodes text into)."""
    import numpy as np

    from qkv.config import SEP
    from qkv.data.binarized import TokenArray
    from qkv.tasks.translate import EncodedSplit

    rng = np.random.default_rng(seed)
    sides = []
    for _ in range(2):
        lengths = rng.integers(LENGTHS[0], LENGTHS[1] + 1, size=n_pairs)
        sides.append(TokenArray.from_lists([rng.integers(SEP + 1, vocab, size=n).tolist() for n in lengths], vocab))
    return EncodedSplit(*sides)


def measure(name: str, timed_updates: int, warmup: int, split_k: int, note: str) -> dict:
    import dataclasses
    import tempfile
    import types

    from qkv.config import DecodeConfig, preset
    from qkv.training.trainer import Trainer

    model_cfg, full = preset(name)
    train_cfg = dataclasses.replace(full, max_tokens=full.max_tokens // split_k)
    vocab = types.SimpleNamespace(vocab_size=train_cfg.vocab_size)
    tokenizers = types.SimpleNamespace(src=vocab, tgt=vocab, joint=True)
    updates = warmup + timed_updates
    pairs_per_batch = train_cfg.max_tokens // (LENGTHS[0] + 1)  # at most this many
    split = generated_split(updates * train_cfg.update_freq * pairs_per_batch, train_cfg.vocab_size, train_cfg.seed)
    order = split.batches(train_cfg.max_tokens, shuffle=True, seed=train_cfg.seed, epoch=0)
    assert len(order) >= updates * train_cfg.update_freq, "too few generated pairs"
    size = train_cfg.update_freq
    groups = [order[i * size:(i + 1) * size] for i in range(updates)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model_cfg, train_cfg, DecodeConfig(), tokenizers, split, None, Path(tmp), log=lambda m: None)
        seconds, tokens = [], []
        for i, group in enumerate(groups):
            t0 = time.perf_counter()
            stats = trainer.train_step(group)
            if i >= warmup:
                seconds.append(time.perf_counter() - t0)
                tokens.append(stats["tokens"])
        n_params = sum(p.numel() for p in trainer.model.parameters())
    per_update = split_k * statistics.median(seconds)
    return {"seconds_per_update": round(per_update, 4), "seconds_per_1000_updates": round(1000 * per_update, 1),
            "extrapolated_from_updates": timed_updates, "warmup_updates": warmup, "batch_split": split_k,
            "timed_max_tokens": train_cfg.max_tokens, "timed_update_seconds": [round(s, 4) for s in seconds],
            "timed_target_tokens_per_update": round(statistics.fmean(tokens)), "max_tokens": full.max_tokens,
            "parameters": n_params, "date": _now(), "note": note, "load_average": [round(x, 2) for x in os.getloadavg()]}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")


def main() -> int:
    from qkv.config import PRESETS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("--updates", type=int, help="timed updates for every preset (default: tiny 30, small 10, "
                                                 "base 2, big 1)")
    ap.add_argument("--split", type=int, help="time every preset on 1/k of its batch, times k (default: base 16, "
                                               "big 32, the others 1)")
    ap.add_argument("--note", default="", help="a note kept in the file, e.g. how loaded the machine was")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file (default: src/qkv/preset_times.json)")
    args = ap.parse_args()
    names = [n for n in args.presets.split(",") if n]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        ap.error(f"--presets: unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    set_thread_env(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results = dict(old.get("presets", {})) if old.get("threads") == args.threads else {}
    for name in names:  # the file is written after each preset: an interrupted run keeps what it measured
        r = measure(name, args.updates or TIMED[name], WARMUP[name], args.split or SPLIT[name], args.note)
        results[name] = r
        k = f", timed on 1/{r['batch_split']} of the batch" if r["batch_split"] > 1 else ""
        print(f"{name}: {r['seconds_per_update']:.3f} s per update (timed: {r['timed_update_seconds']}{k}), "
              f"{r['seconds_per_1000_updates']:,.0f} s per 1,000 updates (extrapolated from "
              f"{r['extrapolated_from_updates']})", flush=True)
        write(args, results, torch.__version__)
    print(f"wrote {args.out}\n")
    from qkv.info import preset_table

    print(preset_table(json.loads(args.out.read_text())))
    return 0


def write(args: argparse.Namespace, results: dict, torch_version: str) -> None:
    from qkv.config import PRESETS

    record = {
        "what": "seconds per training update (Trainer.train_step, the median of the timed updates) of each preset "
                "on generated data, the preset's own tokens per batch (base, big: timed on 1/batch_split of it, times batch_split); per 1,000 "
                "updates extrapolated from the timed updates",
        "date": _now(),
        "commit": git_commit(), "machine": f"{cpu_name()}, {os.cpu_count()} cores", "threads": args.threads,
        "torch": torch_version, "lengths": list(LENGTHS),
        "command": shlex.join(["python", "benchmarks/preset_speed.py", *sys.argv[1:]]),
        "presets": {n: results[n] for n in PRESETS if n in results},
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
