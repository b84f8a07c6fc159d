"""Training speed of Multi30k recipes, measured one at a time on a quiet machine.

The recipe runs themselves report tokens/s too, but those runs share the machine (three LSTMs
and a Transformer on two cores) and span code changes, so their rates say more about the load
than about the models. This script trains each config for a few updates through the real
command, alone, with the same data, subword model and token budget, and reports the training
rate: target tokens per second, the median of the 50-update windows after the first.

    python benchmarks/train_rate.py --spm runs/m30k-ende-spm.model \\
        recipes/multi30k/en-de.toml recipes/multi30k/rnn/lstm-{none,general,additive}.toml

Prints one Markdown row per config and writes ``benchmarks/results/train-rate-DATE.json``.
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(config: Path, args: argparse.Namespace, data: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="train-rate-"))
    try:
        cmd = [sys.executable, "-m", "qkv", "train", "--config", str(config), "--out", str(out / "run"),
               "--src-train", str(data / "train.en.gz"), "--tgt-train", str(data / "train.de.gz"),
               "--tokenizer-from", str(args.spm), "--max-steps", str(args.steps), "--eval-every", str(args.steps),
               "--max-time", "0", "--patience", "0", "--max-lr-shrinks", "0", "--keep-last", "0", "--threads", str(args.threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"train_rate: {config}: qkv train failed (exit {proc.returncode})")
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 50]
        params = next((line for line in proc.stderr.splitlines() if " parameters;" in line), "")
        return {"config": str(config), "windows_tokens_per_s": windows,
                "tokens_per_s": statistics.median(windows) if windows else None, "model": params.strip()}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path, help="recipe TOML files (en-de)")
    ap.add_argument("--spm", type=Path, required=True, help="the SentencePiece model every config shares")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k",
                    help="folder with train.en.gz and train.de.gz (default: ../shared/data/multi30k)")
    ap.add_argument("--steps", type=int, default=200, help="updates per config (windows of 50; the first is skipped)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the recipe runs used 1)")
    args = ap.parse_args()
    missing = [str(p) for p in (*args.configs, args.spm, args.data / "train.en.gz", args.data / "train.de.gz")
               if not p.is_file()]
    if missing:
        print(f"train_rate: missing files: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.steps < 100:
        ap.error("--steps must be at least 100 (the first 50-update window is skipped)")
    results = []
    for config in args.configs:
        r = measure(config, args, args.data)
        results.append(r)
        print(f"| {config} | {r['tokens_per_s']:,.0f} | {r['model']} |", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    record = {"date": stamp, "commit": commit, "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "cpus": os.cpu_count(), "threads": args.threads, "steps": args.steps,
              "command": " ".join(["python", "benchmarks/train_rate.py", *sys.argv[1:]]), "results": results}
    path = ROOT / "benchmarks" / "results" / f"train-rate-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
