"""qkv lab: time to a working model per built-in task and architecture preset, and the page's API
latency while two runs train.

    python benchmarks/lab_times.py [--tasks copy,reverse,...] [--presets transformer,lstm+attention,...]
                                   [--threads 2] [--budget 120] [--target 0.99] [--latency-seconds 60]
    python benchmarks/lab_times.py --concurrent 1,4 --tasks copy,reverse [--threads 1] [--budget 600]

1. Time to a working model. For each task and preset, one at a time, the lab starts the run as the
   page does (:class:`qkv.lab.runs.Lab`: ``qkv train`` in a child process with ``--threads``
   threads, the preset's settings, validation every 100 updates on 200 held-out sentences) and
   watches its ``metrics.jsonl``: the time is the wall-clock time from the start (process start,
   tokenizer and all, as a learner waits) to the first validation record with exact match >=
   ``--target``; a run that has not got there after ``--budget`` seconds is stopped and reported
   with its best exact match.
2. API latency. ``qkv lab`` runs as a process of its own on 127.0.0.1 (a free port); two runs
   train on the copy task (the Transformer and the LSTM-with-attention presets, one thread each,
   as the lab's default bounds say) while one client asks, in turn, for what the page polls
   (``GET /api/runs``, ``GET /api/runs/NAME/metrics``) and looks inside (``POST .../inside``) for
   ``--latency-seconds``: p50 and p99 per endpoint.

3. Concurrent runs (``--concurrent 1,4``): for each task and each count N, N runs start at once as the
   lab's page starts them (one thread each by default, the lab's bound; stopped once solved, as the page
   does): the Transformer preset, and with it the first N - 1 of ``--companions`` (the tour's
   comparison: LSTM with attention, LSTM, a Transformer without positions); the round ends when the Transformer is
   solved or reaches its time limit (the others, stopped then, say how far they got). For each run: its start-up (from Start
   to its first update's record: process start, imports, data and tokenizer), the delay from its first
   update to its first validation point (update 25), and its time to ``--target`` exact match.
   Times are only meaningful on an otherwise idle machine: the JSON records the load average.

The lab is opened as ``qkv lab`` opens it: warm (:mod:`qkv.lab.zygote`: runs forked from a process that
has imported torch and the trainer; the benchmark waits for it to be ready, as it is by the time a
learner presses Start). ``--cold`` starts each run as a fresh process instead, to compare.

Prints Markdown tables and writes JSON to benchmarks/results/lab-times-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.lab.runs import PRESETS, TASKS, Lab, LabLimits  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def open_lab(root: Path, limits: LabLimits, cold: bool) -> Lab:
    """A lab as ``qkv lab`` opens one: warm (its zygote has imported torch and the trainer, as it has by the
    time a learner presses Start), or with ``cold`` each run a fresh process."""
    lab = Lab(root, limits)
    if not cold:
        lab.warm()
        lab.zygote.ready.wait(180)
    return lab


def time_to_target(root: Path, task: str, preset: str, threads: int, budget: float, target: float,
                   cold: bool = False) -> dict:
    lab = open_lab(root, LabLimits(run_threads=threads, max_time=budget), cold)
    name = f"{preset.replace('+', '-')}-{task}"
    started = time.monotonic()
    lab.start(name, task, preset)
    best, reached, step = 0.0, None, 0
    while lab.status(name) == "training" and reached is None:
        time.sleep(0.25)
        for r in lab.metrics(name)["records"]:
            if "valid_exact" in r:
                best, step = max(best, r["valid_exact"]), r["step"]
                if r["valid_exact"] >= target and reached is None:
                    reached = (time.monotonic() - started, r["step"])
        if time.monotonic() - started > budget + 60:
            break
    lab.stop_all()
    row = {"task": task, "preset": preset, "threads": threads, "budget_s": budget, "best_exact": best,
           "last_step": step, "seconds": round(reached[0], 1) if reached else None,
           "step": reached[1] if reached else None, "status": lab.status(name)}
    log(f"{task:<10} {preset:<15} " + (f"{row['seconds']:.1f} s (step {row['step']})" if reached else
                                       f"not reached in {budget:g} s (best {100 * best:.1f}%, step {step})"))
    return row


def concurrent_times(root: Path, task: str, presets: list[str], threads: int, budget: float, target: float,
                     cold: bool = False) -> dict:
    """``presets`` started at once on ``task``: each run's start-up, first-point delay and time to ``target``."""
    lab = open_lab(root, LabLimits(max_runs=len(presets), run_threads=threads, max_time=budget), cold)
    names, started = [], {}
    for k, spec in enumerate(presets):
        preset, _, fields = spec.partition(":")  # "transformer:positional=none": a preset with a field by hand
        model = dict(kv.split("=", 1) for kv in fields.split(";") if kv)
        name = f"n{len(presets)}-{k}-{re.sub('[^A-Za-z0-9]+', '-', spec)}-{task}"[:40]
        started[name] = time.time()
        lab.start(name, task, preset, model=model or None)
        names.append(name)
    rows = {n: {"preset": p, "startup_s": None, "first_point_s": None, "seconds": None, "step": None, "best_exact": 0.0}
            for n, p in zip(names, presets)}
    t0 = time.monotonic()
    # until the Transformer (the first run) has its answer: solved, or its time limit; the others are
    # there to share the machine while it trains, and are stopped with it
    while lab.status(names[0]) in ("training", "stopping") and time.monotonic() - t0 < budget + 90:
        time.sleep(0.5)
        for n in names:
            records, row = lab.metrics(n)["records"], rows[n]
            if records and row["startup_s"] is None and "time" in records[0]:
                row["startup_s"] = round(records[0]["time"] - started[n], 1)
            valid = [r for r in records if "valid_exact" in r]
            if valid and row["first_point_s"] is None and records and "time" in records[0]:
                row["first_point_s"] = round(valid[0]["time"] - records[0]["time"], 1)
            for r in valid:
                row["best_exact"] = max(row["best_exact"], r["valid_exact"])
                if r["valid_exact"] >= target and row["seconds"] is None:
                    row["seconds"], row["step"] = round(r["time"] - started[n], 1), r["step"]
    round_s = round(time.time() - started[names[0]], 1)  # the Transformer's answer: the others stop here
    lab.stop_all()
    for n in names:
        rows[n]["status"] = lab.status(n)
        r = rows[n]
        log(f"{task:<8} N={len(presets)} {r['preset']:<15} start-up {r['startup_s']} s, first point +{r['first_point_s']} s, "
            + (f"{r['seconds']} s to {100 * target:g}% (update {r['step']})" if r["seconds"] is not None
               else f"not reached by {round_s:g} s (best {100 * r['best_exact']:.1f}%)"))
    return {"task": task, "n": len(presets), "threads": threads, "budget_s": budget, "cold": cold, "round_s": round_s,
            "runs": list(rows.values())}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def api_latency(root: Path, seconds: float) -> dict:
    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "lab", "--port", "0", "--root", str(root), "--max-time",
                             str(seconds + 120)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise SystemExit(f"qkv lab stopped: exit {proc.returncode}")
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/", line)
            url = m.group(1) if m else None
        client = httpx.Client(base_url=url, timeout=60)
        for name, preset in (("transformer", "transformer"), ("lstm", "lstm+attention")):
            client.post("/api/runs", json={"name": name, "task": "copy", "preset": preset}).raise_for_status()
        while not all((root / n / "last").is_dir() for n in ("transformer", "lstm")):  # something to look inside
            time.sleep(0.5)
        times: dict[str, list[float]] = {"GET /api/runs": [], "GET /api/runs/NAME/metrics": [],
                                         "POST /api/runs/NAME/inside": []}
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            name = ("transformer", "lstm")[i % 2]
            for key, call in (("GET /api/runs", lambda: client.get("/api/runs")),
                              ("GET /api/runs/NAME/metrics", lambda: client.get(f"/api/runs/{name}/metrics")),
                              ("POST /api/runs/NAME/inside",
                               lambda: client.post(f"/api/runs/{name}/inside", json={"text": "abcdefgh"}))):
                t0 = time.perf_counter()
                call().raise_for_status()
                times[key].append(time.perf_counter() - t0)
            i += 1
            time.sleep(0.2)
        training = client.get("/api/runs").json()["training"]
        return {"seconds": seconds, "runs_training_at_end": training,
                "endpoints": {k: {"n": len(v), "p50_ms": 1000 * statistics.median(v), "p99_ms": 1000 * percentile(v, 0.99)}
                              for k, v in times.items()}}
    finally:
        proc.terminate()  # the lab stops its runs (each commits last/) and exits
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(t for t, spec in TASKS.items() if spec.kind == "translate"),
                    help="the tasks timed (default: the translation tasks, whose validation has an exact match)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each timed run (default 2)")
    ap.add_argument("--budget", type=float, default=120, help="seconds a timed run may take (default 120)")
    ap.add_argument("--target", type=float, default=0.99, help="validation exact match that counts as working")
    ap.add_argument("--latency-seconds", type=float, default=60, help="0: no latency measurement")
    ap.add_argument("--concurrent", default="", help="counts of runs at once, e.g. 1,4 (see 3. above); "
                                                     "with it, only this is measured")
    ap.add_argument("--companions", default="lstm+attention,lstm,transformer:positional=none",
                    help="what trains beside the Transformer in --concurrent: presets, each with fields by hand "
                         "after a colon (default: the tour's comparison)")
    ap.add_argument("--cold", action="store_true", help="each run a fresh process (no zygote: the lab's start "
                                                        "before warm starts), to compare start-ups")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.concurrent:
        return concurrent_main(args)
    work = Path(tempfile.mkdtemp(prefix="lab-times-"))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_average_at_start": os.getloadavg()},
              "command": " ".join(sys.argv), "target": args.target, "times": []}
    try:
        for task in args.tasks.split(","):
            for preset in args.presets.split(","):
                result["times"].append(time_to_target(work / "times", task, preset, args.threads, args.budget,
                                                      args.target, args.cold))
        if args.latency_seconds > 0:
            result["latency"] = api_latency(work / "latency", args.latency_seconds)
    finally:
        result["machine"]["load_average_at_end"] = os.getloadavg()
        shutil.rmtree(work, ignore_errors=True)
    print(f"| task | preset | time to {100 * args.target:g}% exact ({args.threads} threads) | update | best exact |")
    print("|---|---|---|---|---|")
    for r in result["times"]:
        when = f"{r['seconds']:.0f} s" if r["seconds"] is not None else f"not in {r['budget_s']:g} s"
        print(f"| {r['task']} | {r['preset']} | {when} | {r['step'] or r['last_step']} | {100 * r['best_exact']:.1f}% |")
    if "latency" in result:
        print("\n| endpoint (two runs training) | requests | p50 | p99 |\n|---|---|---|---|")
        for k, v in result["latency"]["endpoints"].items():
            print(f"| {k} | {v['n']} | {v['p50_ms']:.0f} ms | {v['p99_ms']:.0f} ms |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lab-times-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {path}")


def concurrent_main(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="lab-times-"))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_average_at_start": os.getloadavg()},
              "command": " ".join(sys.argv), "target": args.target, "concurrent": []}
    companions = [p for p in args.companions.split(",") if p]
    try:
        for task in args.tasks.split(","):
            for n in (int(x) for x in args.concurrent.split(",")):
                presets = ["transformer", *companions[: n - 1]]
                if len(presets) < n:
                    raise SystemExit(f"--concurrent {n}: give at least {n - 1} --companions")
                result["concurrent"].append(concurrent_times(work / f"{task}-{n}", task, presets, args.threads,
                                                             args.budget, args.target, args.cold))
    finally:
        result["machine"]["load_average_at_end"] = os.getloadavg()
        shutil.rmtree(work, ignore_errors=True)
    print(f"| task | runs at once | preset | start-up | first point after update 1 | time to {100 * args.target:g}% |")
    print("|---|---:|---|---:|---:|---:|")
    for c in result["concurrent"]:
        for k, r in enumerate(c["runs"]):
            when = (f"{r['seconds']:.0f} s (update {r['step']})" if r["seconds"] is not None else
                    f"not in {c['budget_s']:g} s ({100 * r['best_exact']:.1f}%)" if k == 0 else
                    f"not by {c.get('round_s') or c['budget_s']:.0f} s, when the round ended "
                    f"({100 * r['best_exact']:.1f}%)")
            print(f"| {c['task']} | {c['n']} | {r['preset']} | {r['startup_s']} s | {r['first_point_s']} s | {when} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lab-concurrent-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
