"""Kill a training run again and again; it must lose nothing and end where an unkilled run ends.

    python benchmarks/faults.py [--kills 30] [--seed 0] [--out runs/bench-faults]

Trains a small Transformer (dropout 0.1) on the embedded number-translation pairs twice, each
with `qkv train` in a subprocess, as a user would:

1. the reference: one uninterrupted run;
2. the killed run: started, then sent SIGKILL or SIGTERM (chosen at random) after a random delay,
   restarted with `--resume` (or afresh, if it was killed before its first `last/` existed), and
   so on for `--kills` kills; between them, `--injected` starts kill themselves (SIGKILL) at a
   checkpoint-writing stage chosen at random (`QKV_FAULT`: after best/, after step_N/, after
   last/, between the two renames of a save of last/ or best/), where a random kill rarely lands;
   then the run is left to finish.

After every kill it opens every checkpoint in the run directory (`last/`, `best/`, `step_N/`,
checksums verified, trainer state read), and counts those that do not load. At the end it compares
the two runs' checkpoints bit for bit and their metrics records step by step, and prints the
figures and one Markdown row for docs/results.md. Exit status 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from peers.common import git_commit  # torch-free helpers beside this script

FLAGS = ["--preset", "tiny", "--tokenizer", "char", "--vocab-size", "60", "--max-tokens", "512",
         "--dropout", "0.1", "--attention-dropout", "0.1", "--eval-every", "10", "--keep-last", "3",
         "--eval-bleu-samples", "0", "--threads", "1", "--seed", "11"]


POINTS = ["saved:best", "saved:step", "saved:last", "swap:last", "swap:best"]


def write_data(d: Path, n_train: int) -> list[str]:
    from qkv.data import toy

    rng = random.Random(0)
    numbers = rng.sample(range(1, 1_000_000), n_train + 100)
    files = []
    for name, ns in (("train", numbers[:n_train]), ("valid", numbers[n_train:])):
        for side, fn in (("src", toy.english), ("tgt", toy.german)):
            path = d / f"{name}.{side}"
            path.write_text("".join(fn(n) + "\n" for n in ns), encoding="utf-8")
            files += [f"--{side}-{name}", str(path)]
    return files


def command(data: list[str], out: Path, max_steps: int, resume: bool) -> list[str]:
    return [sys.executable, "-m", "qkv", "train", *data, "--out", str(out), *FLAGS, "--max-steps", str(max_steps),
            *(["--resume"] if resume else [])]


def checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if p.is_dir() and (p.name in ("last", "best") or p.name.startswith("step_")))


def unloadable(run: Path) -> list[str]:
    from qkv.checkpoint import read_checkpoint

    bad = []
    for ckpt in checkpoints(run):
        try:
            read_checkpoint(ckpt, need_trainer_state=(ckpt.name == "last"))
        except Exception as e:  # noqa: BLE001 - any failure to load is what is counted
            bad.append(f"{ckpt.name}: {e}")
    return bad


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two runs: checkpoint names, tensors bit for bit, metrics records."""
    import torch

    from qkv.checkpoint import read_checkpoint

    diffs = []
    na, nb = [p.name for p in checkpoints(a)], [p.name for p in checkpoints(b)]
    if na != nb:
        diffs.append(f"checkpoints {na} != {nb}")
    for name in sorted(set(na) & set(nb)):
        wa, wb = read_checkpoint(a / name).state_dict, read_checkpoint(b / name).state_dict
        worst = max((float((wa[k] - wb[k]).abs().max()) for k in wa), default=0.0)
        if wa.keys() != wb.keys() or not all(torch.equal(wa[k], wb[k]) for k in wa):
            diffs.append(f"{name}: weights differ (max |dw| {worst:.3g})")

    def records(run: Path) -> list[tuple]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("train_loss"), r.get("valid_loss")) for r in rows]

    if records(a) != records(b):
        diffs.append(f"metrics.jsonl differ: {len(records(a))} vs {len(records(b))} records")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=30, help="kills before the run is left to finish (default 30)")
    ap.add_argument("--max-steps", type=int, default=5000, help="length of the run (default 5000)")
    ap.add_argument("--train-pairs", type=int, default=4000, help="training pairs (default 4000)")
    ap.add_argument("--max-delay", type=float, default=6.0,
                    help="a kill comes 0.2..MAX_DELAY seconds after a start (default 6; start-up takes ~2)")
    ap.add_argument("--injected", type=int, default=10,
                    help="starts that kill themselves at a checkpoint-writing stage (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times and signals")
    ap.add_argument("--out", default="runs/bench-faults", help="working directory (replaced)")
    args = ap.parse_args()
    work = Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = write_data(work, args.train_pairs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    started = time.perf_counter()
    ref = subprocess.run(command(data, work / "reference", args.max_steps, False), env=env, capture_output=True,
                         text=True)
    if ref.returncode != 0:
        sys.stderr.write(ref.stderr)
        return 1
    ref_seconds = time.perf_counter() - started
    print(f"reference: {args.max_steps} steps in {ref_seconds:.0f} s", flush=True)

    rng = random.Random(args.seed)
    run = work / "killed"
    kills = {"SIGKILL": 0, "SIGTERM": 0}
    injected: dict[str, int] = {}
    exits: dict[str, int] = {}
    bad: list[str] = []
    errors: list[str] = []
    mid_save = recovered = fresh_starts = 0
    finished = False
    attempt = 0
    while True:
        resume = (run / "last").is_dir() or any(p.name.startswith(".last.tmp-") for p in run.glob(".*"))
        if not resume:
            fresh_starts += 1
        left_random, left_injected = args.kills - sum(kills.values()), args.injected - sum(injected.values())
        fault = None
        if left_injected > 0 and rng.random() < left_injected / (left_random + left_injected):
            fault = f"{rng.choice(POINTS)}@{rng.randint(1, 3)}"
        proc = subprocess.Popen(command(data, run, args.max_steps, resume),
                                env={**env, "QKV_FAULT": fault} if fault else env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        attempt += 1
        killing = left_random > 0
        if killing:  # an injected fault that is not reached in time (no new best/, say) is overtaken by a kill
            time.sleep(rng.uniform(0.2, args.max_delay) if fault is None else args.max_delay)
            sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
            if proc.poll() is None:
                proc.send_signal(sig)
                kills[sig.name] += 1
                mid_save += any(".tmp-" in p.name for p in run.iterdir()) if run.is_dir() else 0
        _, err = proc.communicate()
        recovered += err.count("recovered ")
        code = proc.returncode
        if fault and code == -9:
            point = fault.split("@")[0]
            injected[point] = injected.get(point, 0) + 1
        label = {0: "finished", 130: "stopped cleanly (130)", -9: "killed (-9)", -15: "killed before its handler (-15)"}
        exits[label.get(code, str(code))] = exits.get(label.get(code, str(code)), 0) + 1
        if code not in label:
            errors.append(f"attempt {attempt}: exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}")
        if run.is_dir():
            bad += [f"after attempt {attempt}: {b}" for b in unloadable(run)]
        print(f"attempt {attempt}: {'resume' if resume else 'fresh'}{', ' + fault if fault else ''}, exit {code}; "
              f"kills so far {sum(kills.values())} random, {sum(injected.values())} injected", flush=True)
        if code == 0:
            finished = True
            break  # finished (before all kills were made, if the run was too short: reported below)
        if errors or attempt > 4 * (args.kills + args.injected) + 10:
            break
    diffs = compare(work / "reference", run) if finished else ["the killed run never finished"]
    n_kills = sum(kills.values())
    equal = not diffs
    print()
    print(f"kills: {n_kills} ({kills['SIGKILL']} SIGKILL, {kills['SIGTERM']} SIGTERM); {mid_save} landed while a "
          f"checkpoint was being written; {recovered} half-done saves recovered on the next start; "
          f"{fresh_starts} fresh start(s)")
    print(f"injected kills at a checkpoint-writing stage: {sum(injected.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(injected.items()))})")
    print(f"exits: {exits}")
    print(f"starts that failed: {len(errors)}" + "".join(f"\n  {e}" for e in errors))
    print(f"checkpoints unloadable after a kill: {len(bad)}" + "".join(f"\n  {b}" for b in bad))
    print(f"final weights equal to the uninterrupted run (last/, best/, step_N/, bit for bit; metrics): "
          f"{'yes' if equal else 'no'}" + "".join(f"\n  {d}" for d in diffs))
    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU, 1 thread"
    survived = n_kills - len(errors)
    n_injected = sum(injected.values())
    print(f"\n| {n_kills} ({kills['SIGKILL']} SIGKILL, {kills['SIGTERM']} SIGTERM) + {n_injected} injected | "
          f"{survived + n_injected} | {mid_save} | {recovered} | {len(bad)} | {'yes' if equal else 'no'} | {machine} | "
          f"{date} | {git_commit()} |")
    return 0 if (equal and not bad and not errors and n_kills >= args.kills and n_injected >= args.injected) else 1


if __name__ == "__main__":
    sys.exit(main())
