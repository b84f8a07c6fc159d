"""Data at scale: plain files (read whole, encoded in memory) against ``qkv preprocess`` + ``--data``.

    python benchmarks/scale.py generate --pairs 30000000 --out /tmp/qkv-scale/30M
    python benchmarks/scale.py run --sizes 30k,300k,3M,30M --root /tmp/qkv-scale

``generate`` makes a parallel corpus of any size from the Multi30k En-De training pairs
(``../shared/data/multi30k``): every generated pair is one Multi30k pair, or two joined by a space
(even odds), drawn at random with replacement from a seeded generator, so the corpus has
Multi30k's vocabulary and a similar length distribution but few repeated lines.

``run`` measures, for each size, each path in a child process (``resource.getrusage`` of the
children gives the peak RSS; ``/usr/bin/time`` is not needed; the peak ``RssAnon``, the process's own
memory, and ``RssFile``, pages of mapped files, are sampled apart from ``/proc``): preprocessing time and peak RSS,
time to the first update, time to resume, tokens/s over a few hundred steps of a tiny model, and
peak RSS of training in one process and in 2 gloo processes (``torchrun --nproc_per_node 2``).
Every child runs under a wall-clock timeout and an address-space limit; a path that hits one is
recorded with the limit it hit, not run forever. Results go to
``benchmarks/results/scale-DATE.json`` and the plot to ``docs/img/scale.png``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from peers.common import git_commit  # torch-free helpers beside this script

ROOT = Path(__file__).resolve().parent.parent
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
if not MULTI30K.is_dir():
    MULTI30K = Path("/work/shared/data/multi30k")
SIZES = {"30k": 30_000, "300k": 300_000, "3M": 3_000_000, "30M": 30_000_000}


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh]


def generate(pairs: int, out: Path, seed: int = 1) -> None:
    """``out/train.en``, ``out/train.de`` (``pairs`` lines) and the Multi30k validation files."""
    en, de = read_gz(MULTI30K / "train.en.gz"), read_gz(MULTI30K / "train.de.gz")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n = len(en)
    tmp_en, tmp_de = out / ".train.en.tmp", out / ".train.de.tmp"
    with open(tmp_en, "w", encoding="utf-8") as fe, open(tmp_de, "w", encoding="utf-8") as fd:
        done = 0
        while done < pairs:
            k = min(100_000, pairs - done)
            be, bd = [], []
            for _ in range(k):
                i = rng.randrange(n)
                if rng.random() < 0.5:
                    j = rng.randrange(n)
                    be.append(f"{en[i]} {en[j]}\n")
                    bd.append(f"{de[i]} {de[j]}\n")
                else:
                    be.append(en[i] + "\n")
                    bd.append(de[i] + "\n")
            fe.writelines(be)
            fd.writelines(bd)
            done += k
    os.replace(tmp_en, out / "train.en")
    os.replace(tmp_de, out / "train.de")
    for lang in ("en", "de"):
        (out / f"valid.{lang}").write_text("\n".join(read_gz(MULTI30K / f"val.{lang}.gz")) + "\n", encoding="utf-8")


# --- measuring ---------------------------------------------------------------------------------------

MODEL = ["--preset", "tiny", "--d-model", "64", "--d-ff", "128", "--n-heads", "2", "--n-encoder-layers", "1",
         "--n-decoder-layers", "1", "--max-tokens", "2048", "--max-len", "100", "--warmup-steps", "100",
         "--eval-bleu-samples", "0", "--threads", "1", "--seed", "1"]


# Runs the command; prints the peak RSS of its largest process (ru_maxrss: anonymous and file-backed
# pages together), and, sampled every 20 ms from /proc/PID/status of the command and its descendants,
# the peak RssAnon (the process's own memory) and the peak RssFile (pages of mapped files, the memory
# maps of --data among them: shared between processes and reclaimable), each the largest of any process.
WRAP = """
import os, resource, subprocess, sys, threading, time
proc = subprocess.Popen(sys.argv[1:])
peak = {'RssAnon': 0, 'RssFile': 0}
def tree(pid):
    pids = [pid]
    try:
        for tid in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{tid}/children') as fh:
                for c in fh.read().split():
                    pids += tree(int(c))
    except OSError:
        pass
    return pids
def sample():
    while proc.poll() is None:
        for pid in tree(proc.pid):
            try:
                with open(f'/proc/{pid}/status') as fh:
                    for line in fh:
                        key = line.split(':')[0]
                        if key in peak:
                            peak[key] = max(peak[key], int(line.split()[1]))
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
r = proc.wait()
print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
print('PEAK_RSS_ANON_KB', peak['RssAnon'], 'PEAK_RSS_FILE_KB', peak['RssFile'], file=sys.stderr)
sys.exit(r)
"""


def child(cmd: list[str], timeout: float, mem_gb: float, env: dict | None = None, mark: str = "step 1/") -> dict:
    """Run ``cmd`` under a time and address-space limit: wall time, peak RSS of its largest process (MB),
    seconds until a line containing ``mark`` was printed (the first update), exit status, the limit hit."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (int(mem_gb * 2**30), int(mem_gb * 2**30)))

    e = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    load = os.getloadavg()[0]  # the machine is shared: how busy it was
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", WRAP, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=e, preexec_fn=limit, cwd=ROOT, bufsize=1)
    lines, first, hit = [], None, None
    deadline = started + timeout
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            proc.kill()
            hit = f"time limit {timeout:.0f} s"
            break
        if not sel.select(timeout=min(left, 5)):
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if first is None and mark and mark in line:
            first = time.perf_counter() - started
    proc.wait()
    wall = time.perf_counter() - started
    out = "".join(lines)
    peak = re.search(r"PEAK_RSS_KB (\d+)", out)
    parts = re.search(r"PEAK_RSS_ANON_KB (\d+) PEAK_RSS_FILE_KB (\d+)", out)
    if hit is None and proc.returncode != 0 and re.search(r"MemoryError|Cannot allocate|bad_alloc|out of memory", out):
        hit = f"memory limit {mem_gb:g} GB (address space)"
    return {"cmd": " ".join(cmd), "wall_s": round(wall, 2), "rc": proc.returncode, "limit_hit": hit,
            "first_update_s": None if first is None else round(first, 2),
            "peak_rss_mb": round(int(peak.group(1)) / 1024, 1) if peak else None,
            "peak_rss_anon_mb": round(int(parts.group(1)) / 1024, 1) if parts else None,
            "peak_rss_file_mb": round(int(parts.group(2)) / 1024, 1) if parts else None, "load_1min": round(load, 2),
            "tail": out[-1500:]}


def qkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "qkv", *args]


def rate(run: Path, after: int = 50) -> float | None:
    """Mean training tokens/s of metrics.jsonl's progress records from step ``after`` on."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    values = [r["tokens_per_s"] for r in map(json.loads, path.read_text().splitlines())
              if "tokens_per_s" in r and r["step"] >= after]
    return round(sum(values) / len(values), 1) if values else None


def time_v(log: Path) -> dict:
    """Wall time and peak RSS from the output of ``/usr/bin/time -v``."""
    text = log.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    parts = [float(x) for x in wall.group(1).split(":")] if wall else []
    seconds = sum(v * 60 ** i for i, v in enumerate(reversed(parts))) if parts else None
    return {"cmd": "/usr/bin/time -v qkv preprocess ... (run beside this script)", "wall_s": seconds,
            "peak_rss_mb": round(int(rss.group(1)) / 1024, 1) if rss else None, "rc": 0, "limit_hit": None}


def tile(source: Path, times: int, out: Path) -> None:
    """A preprocessed directory whose training split is ``source``'s repeated ``times`` times (the
    tokenizer and validation split copied): the corpus of ``times`` x the pairs in a minute, for the
    training measurements (its preprocessing is not a measurement). The length index, the counts and
    the manifest's sizes and sha256 are computed again."""
    import numpy as np

    from qkv.data.binarized import MANIFEST, SIDES, _file_entries, _NpyWriter, write_length_index

    manifest = json.loads((source / MANIFEST).read_text())
    if out.exists():
        raise SystemExit(f"{out} exists")
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in manifest["files"]:
        if not name.startswith("train."):
            shutil.copy2(source / name, tmp / name)
    for side in SIDES:
        parts = {part: np.load(source / f"train.{side}.{part}.npy", mmap_mode="r") for part in ("tokens", "offsets", "lengths")}
        writers = {part: _NpyWriter(tmp / f"train.{side}.{part}.npy", a.dtype) for part, a in parts.items()}
        n_tokens = len(parts["tokens"])
        for r in range(times):
            for part, a in parts.items():
                for i in range(0, len(a), 1 << 24):
                    block = np.asarray(a[i : i + (1 << 24)])
                    writers[part].write(block + r * n_tokens if part == "offsets" else block)
        for w in writers.values():
            w.close()
    write_length_index(tmp, "train")
    split = manifest["splits"]["train"]
    split["pairs"] *= times
    split["lines"] *= times
    split["tokens"] = {k: v * times for k, v in split["tokens"].items()}
    split["source"] = [f"{source} repeated {times} times"]
    manifest["version"] = max(manifest.get("version", 1), 2)
    manifest["files"] = _file_entries(tmp, sorted(p.name for p in tmp.iterdir()), 2)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.rename(out)
    (out.parent / "preprocess.json").write_text(json.dumps({"tiled_from": str(source), "times": times}, indent=1))
    print(f"wrote {out}: {split['pairs']} training pairs")


def measure_size(name: str, root: Path, args) -> dict:
    d = root / name
    if not (d / "train.en").is_file() and not (d / "bin" / "manifest.json").is_file():
        generate(SIZES[name], d)
    out: dict = {"pairs": SIZES[name], "steps": args.steps, "ddp_steps": args.ddp_steps}
    bin_dir = d / "bin"
    saved = d / "preprocess.json"
    if (bin_dir / "manifest.json").is_file() and saved.is_file():
        out["preprocess"] = json.loads(saved.read_text())
    elif (bin_dir / "manifest.json").is_file() and (d / "preprocess.log").is_file():
        out["preprocess"] = time_v(d / "preprocess.log")
    else:
        shutil.rmtree(bin_dir, ignore_errors=True)
        out["preprocess"] = child(qkv("preprocess", "--src-train", str(d / "train.en"), "--tgt-train", str(d / "train.de"),
                                      "--src-valid", str(d / "valid.en"), "--tgt-valid", str(d / "valid.de"),
                                      "--vocab-size", "8000", "--workers", "2", "--out", str(bin_dir)),
                                  args.timeout, args.mem_gb, mark="")
    saved.write_text(json.dumps(out["preprocess"], indent=1))
    if bin_dir.joinpath("manifest.json").is_file():
        manifest = json.loads((bin_dir / "manifest.json").read_text())
        out["preprocess"]["pairs_kept"] = manifest["splits"]["train"]["pairs"]
        out["preprocess"]["skipped"] = manifest["splits"]["train"]["skipped"]
        out["preprocess"]["bytes_written"] = sum(f["size"] for f in manifest["files"].values())
        if (d / "train.en").is_file():
            out["preprocess"]["input_bytes"] = sum((d / f).stat().st_size for f in ("train.en", "train.de"))
        if out["preprocess"].get("wall_s"):
            out["preprocess"]["pairs_per_s"] = round(SIZES[name] / out["preprocess"]["wall_s"], 1)
    plain = ["--src-train", str(d / "train.en"), "--tgt-train", str(d / "train.de"), "--src-valid",
             str(d / "valid.en"), "--tgt-valid", str(d / "valid.de"), "--tokenizer-from", str(bin_dir)]
    # the floor under every time to first update: starting Python and importing torch and qkv's trainer
    out["startup"] = child([sys.executable, "-c", "import torch, qkv.training.run; print('imported')"],
                           args.timeout, args.mem_gb, mark="imported")
    paths = {"new": ["--data", str(bin_dir)], "old": plain}
    for path, data in paths.items():
        if path == "old" and name not in args.old_sizes.split(","):
            out[path] = {"skipped": f"not run at {name}: see old_limit"}
            continue
        run_dir = d / f"run-{path}"
        shutil.rmtree(run_dir, ignore_errors=True)
        res = {}
        res["train"] = child(qkv("train", *data, *MODEL, "--max-steps", str(args.steps), "--eval-every",
                                 str(args.steps), "--out", str(run_dir)), args.timeout, args.mem_gb)
        res["train"]["tokens_per_s"] = rate(run_dir)
        if res["train"]["rc"] == 0:
            res["resume"] = child(qkv("train", *data, "--resume", "--max-steps", str(args.steps + 1), "--out",
                                      str(run_dir)), args.timeout, args.mem_gb, mark="first update since resuming")
            ddp_dir = d / f"run-{path}-ddp"
            shutil.rmtree(ddp_dir, ignore_errors=True)
            if name in (args.ddp_sizes if path == "new" else args.old_ddp_sizes).split(","):
                res["ddp2"] = child([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                     "--master_port", str(29500 + random.randrange(400)), "-m", "qkv", "train", *data,
                                     *MODEL, "--max-steps", str(args.ddp_steps), "--eval-every", str(args.ddp_steps),
                                     "--out", str(ddp_dir)], args.timeout, args.mem_gb)
        for r in res.values():
            r.pop("tail", None) if r.get("rc") == 0 else None
        out[path] = res
        print(json.dumps({name: {path: res}}, indent=1), flush=True)
    return out


def run(args) -> None:
    import datetime
    import platform

    root = Path(args.root)
    commit = git_commit()
    result_path = Path(args.result) if args.result else ROOT / "benchmarks" / "results" / f"scale-{datetime.date.today()}.json"
    results = json.loads(result_path.read_text()) if result_path.is_file() else {}
    results.update({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "commit": commit, "nproc": os.cpu_count(), "machine": platform.platform(),
                    "cpu": platform.processor() or platform.machine(), "model": MODEL, "steps": args.steps,
                    "ddp_steps": args.ddp_steps, "timeout_s": args.timeout, "mem_limit_gb": args.mem_gb,
                    "corpus": "Multi30k En-De train pairs drawn with replacement, each alone or two joined "
                              "(benchmarks/scale.py generate)"})
    results.setdefault("sizes", {})
    for name in args.sizes.split(","):
        results["sizes"][name] = measure_size(name, root, args)
        result_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {result_path}")


def speed(args) -> None:
    """Training tokens/s of the two paths, interleaved (new, old, old, new, new, old, ...) on one size, so
    that a shared machine's load falls on both alike; the preprocessed directory must exist."""
    import datetime

    d = Path(args.root) / args.size
    bin_dir = d / "bin"
    data = {"new": ["--data", str(bin_dir)],
            "old": ["--src-train", str(d / "train.en"), "--tgt-train", str(d / "train.de"), "--src-valid",
                    str(d / "valid.en"), "--tgt-valid", str(d / "valid.de"), "--tokenizer-from", str(bin_dir)]}
    rounds = []
    for i in range(args.rounds):
        for path in ("new", "old") if i % 2 == 0 else ("old", "new"):  # alternated: a drift of the load falls on both
            run_dir = d / f"speed-{path}"
            shutil.rmtree(run_dir, ignore_errors=True)
            r = child(qkv("train", *data[path], *MODEL, "--max-steps", str(args.steps), "--eval-every",
                          str(args.steps), "--out", str(run_dir)), args.timeout, args.mem_gb)
            rounds.append({"path": path, "tokens_per_s": rate(run_dir), "load_1min": r["load_1min"], "rc": r["rc"]})
            print(rounds[-1], flush=True)
    mean = {p: sum(r["tokens_per_s"] for r in rounds if r["path"] == p) / args.rounds for p in data}
    result_path = Path(args.result) if args.result else ROOT / "benchmarks" / "results" / f"scale-{datetime.date.today()}.json"
    results = json.loads(result_path.read_text()) if result_path.is_file() else {}
    results["speed_interleaved"] = {"size": args.size, "steps": args.steps, "rounds": rounds,
                                    "mean_tokens_per_s": mean, "new_over_old": round(mean["new"] / mean["old"], 4)}
    result_path.write_text(json.dumps(results, indent=1) + "\n")
    print(results["speed_interleaved"])


def plot(result_path: Path, png: Path, old_from: Path | None = None) -> None:
    """Peak RSS of training, and the times to the first update, against the corpus size; the text-file
    path's series from ``old_from`` when given (a results file of an earlier run that measured it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(result_path.read_text())
    old = json.loads(old_from.read_text()) if old_from else results
    names = [n for n in SIZES if n in results["sizes"] or n in old["sizes"]]
    x = {n: SIZES[n] for n in names}

    def series(path: str, run: str, key: str):
        source = old if path == "old" else results
        runs = [(x[n], source["sizes"].get(n, {}).get(path, {}).get(run, {})) for n in names]
        return [(v, r[key]) for v, r in runs if r.get(key) is not None and r.get("rc") == 0]

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for path, run, label, style in (("new", "train", "--data, 1 process", "o-"), ("new", "ddp2", "--data, 2 gloo processes (each)", "s--"),
                                    ("old", "train", "text files, 1 process", "x-"), ("old", "ddp2", "text files, 2 processes (each)", "d--")):
        pts = series(path, run, "peak_rss_mb")
        if pts:
            a.plot(*zip(*pts), style, label=label)
    for n in names:  # where the text-file path hit a limit
        failed = old["sizes"].get(n, {}).get("old", {}).get("train", {})
        if failed.get("limit_hit"):
            a.plot([x[n]], [failed.get("peak_rss_mb") or 8192], "X", color="red")
            a.annotate(f"text files: {failed['limit_hit']}", (x[n], failed.get("peak_rss_mb") or 8192),
                       textcoords="offset points", xytext=(-190, -16), fontsize=7, color="red")
    a.axhline(4096, color="grey", lw=0.8, ls=":")
    a.text(x[names[0]], 4096 * 1.05, "4 GB goal", color="grey", fontsize=8)
    a.set(xscale="log", yscale="log", xlabel="training pairs", ylabel="peak RSS while training (MB)",
          title="Memory of training")
    a.legend(fontsize=8)
    for path, run, label, style in (("new", "train", "--data: first update", "o-"), ("new", "resume", "--data: resume to first update", "s--"),
                                    ("old", "train", "text files: first update", "x-"), ("old", "resume", "text files: resume", "d--")):
        pts = series(path, run, "first_update_s")
        if pts:
            b.plot(*zip(*pts), style, label=label)
    floor = [(x[n], results["sizes"][n]["startup"]["first_update_s"]) for n in names
             if results["sizes"].get(n, {}).get("startup", {}).get("first_update_s")]
    if floor:
        b.plot(*zip(*floor), ":", color="grey", label="importing torch + qkv (floor)")
    b.axhline(10, color="grey", lw=0.8, ls=":")
    b.set(xscale="log", yscale="log", xlabel="training pairs", ylabel="seconds from start",
          title="Time to the first update")
    b.legend(fontsize=8)
    fig.suptitle(f"qkv preprocess + train --data (commit {results['commit']}) against text files (commit "
                 f"{old['commit']}), {results['nproc']}-core shared CPU", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def table(result_path: Path) -> str:
    """The Markdown table of docs/results.md ("Data at scale") from a results file."""
    results = json.loads(result_path.read_text())

    def cell(r: dict | None, key: str, fmt: str = "{:.1f}") -> str:
        if not r:
            return "—"
        if r.get("skipped"):
            return "not run"
        if r.get("rc") != 0:
            return f"**failed** ({r.get('limit_hit') or 'exit ' + str(r.get('rc'))})"
        v = r.get(key)
        return "—" if v is None else fmt.format(v)

    rows = ["| pairs | path | preprocess s (pairs/s) | preprocess peak RSS MB | first update s | peak RSS MB, 1 process "
            "| peak RSS MB, 2 processes (each) | resume to first update s | tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in SIZES:
        size = results["sizes"].get(name)
        if not size:
            continue
        pre = size.get("preprocess", {})
        for path in ("new", "old"):
            runs = size.get(path, {})
            label = "`preprocess` + `--data`" if path == "new" else "text files"
            if path == "new":
                p_s = f"{pre['wall_s']:.0f} ({pre.get('pairs_per_s', 0):,.0f})" if pre.get("wall_s") else "—"
                p_m = f"{pre['peak_rss_mb']:.0f}" if pre.get("peak_rss_mb") else "—"
            else:
                p_s = p_m = "(in training)"
            if runs.get("skipped"):
                rows.append(f"| {name} | {label} | {p_s} | {p_m} | {runs.get('note', 'not run')} | | | | |")
                continue
            rows.append(f"| {name} | {label} | {p_s} | {p_m} | {cell(runs.get('train'), 'first_update_s')} | "
                        f"{cell(runs.get('train'), 'peak_rss_mb', '{:.0f}')} | {cell(runs.get('ddp2'), 'peak_rss_mb', '{:.0f}')} | "
                        f"{cell(runs.get('resume'), 'first_update_s')} | {cell(runs.get('train'), 'tokens_per_s', '{:,.0f}')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--pairs", required=True, help="30k, 300k, 3M, 30M or a number")
    g.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--sizes", default="30k,300k,3M,30M")
    r.add_argument("--root", default="/tmp/qkv-scale")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--ddp-steps", type=int, default=60)
    r.add_argument("--old-sizes", default="30k,300k,3M", help="sizes at which to run the plain-file path")
    r.add_argument("--ddp-sizes", default="30k,300k,3M,30M")
    r.add_argument("--old-ddp-sizes", default="30k,300k", help="sizes at which to run the plain-file path in 2 processes")
    r.add_argument("--timeout", type=float, default=1200)
    r.add_argument("--mem-gb", type=float, default=12)
    r.add_argument("--result", help="the results file (default benchmarks/results/scale-DATE.json; sizes measured "
                                    "again replace theirs)")
    pl = sub.add_parser("plot")
    pl.add_argument("result", help="benchmarks/results/scale-DATE.json")
    pl.add_argument("--out", default=str(ROOT / "docs" / "img" / "scale.png"))
    pl.add_argument("--old", help="take the text-file path's figures from this results file")
    sp = sub.add_parser("speed")
    sp.add_argument("--size", default="300k")
    sp.add_argument("--root", default="/tmp/qkv-scale")
    sp.add_argument("--steps", type=int, default=150)
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--timeout", type=float, default=1200)
    sp.add_argument("--mem-gb", type=float, default=12)
    sp.add_argument("--result", help="the results file to add the figures to (default benchmarks/results/scale-DATE.json)")
    ti = sub.add_parser("tile", help="a preprocessed directory repeated N times (for training measurements)")
    ti.add_argument("--from", dest="source", required=True, help="a directory qkv preprocess wrote, e.g. ROOT/3M/bin")
    ti.add_argument("--times", type=int, default=10)
    ti.add_argument("--out", required=True, help="e.g. ROOT/30M/bin")
    tb = sub.add_parser("table")
    tb.add_argument("result")
    args = p.parse_args()
    if args.cmd == "speed":
        speed(args)
    elif args.cmd == "table":
        print(table(Path(args.result)))
    elif args.cmd == "plot":
        plot(Path(args.result), Path(args.out), Path(args.old) if args.old else None)
    elif args.cmd == "tile":
        tile(Path(args.source), args.times, Path(args.out))
    elif args.cmd == "generate":
        generate(SIZES.get(args.pairs) or int(args.pairs), Path(args.out))
    else:
        run(args)


if __name__ == "__main__":
    main()
