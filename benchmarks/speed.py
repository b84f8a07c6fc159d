"""Speed of qkv against the systems a user would pick instead, on the paper's model shapes.

    python benchmarks/speed.py                       # presets small and base, every peer installed
    python benchmarks/speed.py --presets base --rounds 5 --systems qkv,hf
    python benchmarks/speed.py --quick --systems qkv # smoke test: tiny shapes, one round

Measures, for each preset (model shapes from qkv's presets; the shared vocabulary of the preset's
tokenizer: small 8000, base 37000):

* training: target tokens/s of forward + label-smoothed cross-entropy (0.1) + backward + gradient
  clipping (1.0, qkv's default) + Adam(0.9, 0.98, 1e-9) step, on a batch of B sentence pairs of
  exactly --seq-len source and target tokens (no padding; masks still built and applied). Token
  budget per batch: base 3072 target tokens (the paper's 25000 per batch over 8 GPUs, per GPU),
  small 4096 (the small preset's max_tokens). Dropout 0.1 and attention dropout 0.1 on every side.
  Model FLOP/s as a fraction of the machine's measured float32 matmul peak (MFU), with the FLOPs
  per target token of qkv.info.transformer_flops (matmuls only, 2 FLOPs per multiply-add):
      forward = [N_enc (8d²S + 4d·d_ff·S + 4S²d) + N_dec (8d²T + 4T²d + 4d²T + 4d²S + 4TSd
                 + 4d·d_ff·T) + 2dVT] / T,      training = 3 x forward
* decoding: sentences/s and tokens/s of greedy and beam-5 search (length penalty 0.6) on a batch of
  --decode-batch sentences of --src-len tokens, every output exactly --out-len decoder steps
  (forced minimum = maximum length), so random-weight models all do the same work.

Systems (each in its own process, launched round-robin for --rounds rounds, order rotated each
round; ratios qkv/peer are the median over rounds of the per-round ratios):

* qkv: Trainer.train_step (what `qkv train` runs) and qkv.decoding.greedy / beam_search on token
  tensors (what qkv.frontends.Translator calls after tokenizing);
* qkv-int8: the same decoding with dynamic int8 quantisation (qkv.frontends.quantize_int8, what
  `qkv translate --int8` runs): a different precision, compared with HF (float32) and CTranslate2
  int8 for information only; the targets are judged on the float32 row;
* hf: transformers MarianMTModel as the paper's Transformer (post-norm, ReLU, sinusoidal positions,
  scaled shared embeddings), training and generate();
* torchnn: torch.nn.Transformer + scaled shared nn.Embedding + sinusoidal positions, training only;
* ct2-f32, ct2-int8: CTranslate2 converted from that Marian model, decoding only, in a process
  that never imports torch (torch's idle OpenMP threads otherwise slow it down on 2 cores), one
  batch on intra_threads=threads; ct2-f32-par, ct2-int8-par: the same model in CTranslate2's
  throughput setting, inter_threads=threads one-thread workers on threads sub-batches at once.

Every worker runs with --threads intra-op threads (torch.set_num_threads, OMP/MKL variables;
CTranslate2 intra_threads, inter_threads=1) and reports its peak RSS (ru_maxrss). The matmul peak
is measured in its own worker at the start, once per round and at the end.

Peers are optional: pip install -c constraints.txt -e ".[bench]". A system whose package is
missing is skipped with a note. Prints one table and writes JSON to benchmarks/results/.

Internal: `--worker NAME` runs one measurement in this process and prints one JSON line
(`SPEED-RESULT {...}`); NAME is matmul, convert, or SYSTEM-TASK (e.g. qkv-train, hf-beam,
ct2-int8-greedy); the shapes come from --spec (JSON, as the parent passes) or --preset.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MARK = "SPEED-RESULT "

SYSTEMS = {  # name: (label, tasks, packages it needs)
    "qkv": ("qkv", ("train", "greedy", "beam"), ()),
    "qkv-int8": ("qkv int8", ("greedy", "beam"), ()),
    "hf": ("HF MarianMTModel", ("train", "greedy", "beam"), ("transformers",)),
    "torchnn": ("torch.nn.Transformer", ("train",), ()),
    "ct2-f32": ("CTranslate2 float32", ("greedy", "beam"), ("ctranslate2", "transformers")),
    "ct2-int8": ("CTranslate2 int8", ("greedy", "beam"), ("ctranslate2", "transformers")),
    "ct2-f32-par": ("CTranslate2 f32 par", ("greedy", "beam"), ("ctranslate2", "transformers")),
    "ct2-int8-par": ("CTranslate2 int8 par", ("greedy", "beam"), ("ctranslate2", "transformers")),
}
CT2 = {"ct2-f32": ("float32", False), "ct2-int8": ("int8", False), "ct2-f32-par": ("float32", True),
       "ct2-int8-par": ("int8", True)}
TASKS = ("train", "greedy", "beam")

# (task, peer, {preset: minimum qkv/peer ratio}, kind). Presets not listed: reported, no target.
TARGETS = [
    ("train", "hf", {"base": 1.25, "small": 1.0}, "target"),
    ("greedy", "hf", {"base": 2.0, "small": 2.0}, "target"),
    ("beam", "hf", {"base": 2.0, "small": 2.0}, "target"),
    ("greedy", "ct2-f32", {"base": 1 / 1.5, "small": 1 / 1.5}, "goal"),
    ("beam", "ct2-f32", {"base": 1 / 1.5, "small": 1 / 1.5}, "goal"),
    ("greedy", "ct2-f32-par", {"base": 1 / 1.5, "small": 1 / 1.5}, "goal"),
    ("beam", "ct2-f32-par", {"base": 1 / 1.5, "small": 1 / 1.5}, "goal"),
]

# the ratios reported: qkv against every peer (None), qkv int8 against these (no targets)
QKV_RATIOS = {"qkv": None, "qkv-int8": ("hf", "ct2-int8", "ct2-int8-par")}

TRAIN_TOKENS = {"base": 3072, "small": 4096}  # target tokens per batch (see the docstring)


# --- shapes ---------------------------------------------------------------------------------------


def make_spec(preset: str, args: argparse.Namespace) -> dict:
    """Model, training and decoding shapes for one preset, the same for every system."""
    from qkv.config import MODEL_PRESETS, TRAIN_PRESETS  # torch-free

    if preset not in MODEL_PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(MODEL_PRESETS)}")
    m, t = MODEL_PRESETS[preset], TRAIN_PRESETS[preset]
    if m.n_encoder_layers != m.n_decoder_layers:
        raise SystemExit(f"preset {preset}: the peers need as many encoder as decoder layers")
    quick = args.quick
    seq = args.seq_len or (8 if quick else 32)
    tokens = args.train_tokens or (4 * seq if quick else TRAIN_TOKENS.get(preset, 4096))
    return {
        "preset": preset,
        "quick": quick,
        "model": {"d_model": m.d_model, "n_heads": m.n_heads, "d_ff": m.d_ff, "layers": m.n_encoder_layers,
                  "vocab": args.vocab or t.vocab_size, "dropout": 0.1, "attention_dropout": 0.1},
        "train": {"batch": max(1, tokens // seq), "src_len": seq, "tgt_len": seq,
                  "warmup": args.train_warmup if args.train_warmup is not None else (1 if quick else 2),
                  "steps": args.train_steps or (2 if quick else 3),
                  "label_smoothing": t.label_smoothing, "clip_norm": t.clip_norm},
        "decode": {"batch": args.decode_batch or (4 if quick else 64), "src_len": args.src_len or (8 if quick else 25),
                   "out_len": args.out_len or (6 if quick else 25), "reps": args.decode_reps or (1 if quick else 2),
                   "beam_size": args.beam_size, "length_penalty": 0.6},
    }


# --- worker side ----------------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    from peers.common import cpu_share, peak_rss_mb, set_thread_env  # torch-free

    set_thread_env(args.threads)  # before torch / CTranslate2 start their thread pools
    spec = json.loads(args.spec) if args.spec else make_spec(args.preset, args)
    name, started = args.worker, time.perf_counter()
    if name.startswith("ct2-"):
        from peers import ct2

        system, task = name.rsplit("-", 1)
        compute_type, parallel = CT2[system]
        res = ct2.run(task, spec, args.threads, args.model_dir, compute_type, parallel)
    else:
        from peers.torchutil import set_threads

        set_threads(args.threads)
        if name == "matmul":
            from peers import matmul

            res = matmul.run("matmul", spec, args.threads)
        elif name == "convert":
            from peers import hf_marian

            res = hf_marian.convert_to_ct2(spec, args.model_dir)
        else:
            system, task = name.rsplit("-", 1)
            module = {"qkv": "qkv_system", "qkv-int8": "qkv_system", "hf": "hf_marian", "torchnn": "torch_nn"}[system]
            kw = {"int8": True} if system == "qkv-int8" else {}
            res = __import__(f"peers.{module}", fromlist=["run"]).run(task, spec, args.threads, **kw)
    res.update(worker=name, preset=spec["preset"], threads=args.threads, peak_rss_mb=round(peak_rss_mb(), 1),
               wall_s=round(time.perf_counter() - started, 2), torch_imported="torch" in sys.modules,
               loadavg_1min=os.getloadavg()[0], cpu_share=cpu_share(args.threads))
    print(MARK + json.dumps(res), flush=True)
    return 0


# --- parent side ----------------------------------------------------------------------------------


def run_worker(name: str, spec: dict, args: argparse.Namespace, model_dir: str | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", json.dumps(spec),
           "--threads", str(args.threads)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"worker": name, "error": f"timed out after {args.worker_timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    last = tail[-1] if tail else "no output"
    return {"worker": name, "error": f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s: {last}",
            "stderr_tail": tail}


def available(system: str) -> str | None:
    """None if the system can run here, else why not."""
    missing = [p for p in SYSTEMS[system][2] if importlib.util.find_spec(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install -c constraints.txt -e \".[bench]\")"
    return None


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now(datetime.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def measure(args: argparse.Namespace) -> dict:
    presets = args.presets.split(",") if args.presets else (["tiny"] if args.quick else ["small", "base"])
    wanted = args.systems.split(",") if args.systems else list(SYSTEMS)
    for s in wanted:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    skipped = {s: why for s in wanted if (why := available(s))}
    systems = [s for s in wanted if s not in skipped]
    for s, why in skipped.items():
        log(f"skipping {s}: {why}")
    tasks = args.tasks.split(",") if args.tasks else list(TASKS)
    specs = {p: make_spec(p, args) for p in presets}
    started = datetime.datetime.now(datetime.UTC)
    load_start = os.getloadavg()
    raw: list[dict] = []
    matmul: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="qkv-speed-"))
    ct2_dirs: dict[str, str] = {}
    mm_spec = specs[presets[-1]]

    def peak(when: str) -> None:
        r = run_worker("matmul", mm_spec, args)
        r["when"] = when
        matmul.append(r)
        log(f"matmul peak ({when}): {r.get('peak_gflops', float('nan')):.1f} GFLOP/s" if "error" not in r
            else f"matmul failed: {r['error']}")

    try:
        peak("start")
        if any(s.startswith("ct2-") for s in systems):
            for p in presets:
                ct2_dirs[p] = str(tmp / p)
                r = run_worker("convert", specs[p], args, model_dir=ct2_dirs[p])
                log(f"{p}: converted the Marian model to CTranslate2" if "error" not in r
                    else f"{p}: conversion failed: {r['error']}")
                if "error" in r:
                    systems = [s for s in systems if not s.startswith("ct2-")]
                    skipped.update({s: "conversion failed" for s in wanted if s.startswith("ct2-")})
        for rnd in range(args.rounds):
            if rnd:
                peak(f"round {rnd + 1}")
            for p in presets:
                for task in tasks:
                    runs = [s for s in systems if task in SYSTEMS[s][1]]
                    k = rnd % len(runs) if runs else 0
                    for s in runs[k:] + runs[:k]:  # order rotated each round
                        r = run_worker(f"{s}-{task}", specs[p], args, model_dir=ct2_dirs.get(p))
                        r.update(system=s, task=task, preset=p, round=rnd)
                        raw.append(r)
                        if "error" in r:
                            log(f"round {rnd + 1} {p} {task} {s}: FAILED: {r['error']}")
                        else:
                            log(f"round {rnd + 1} {p} {task} {s}: {fmt(r['tok_per_s'])} tok/s"
                                + (f", {fmt(r['sent_per_s'])} sent/s" if "sent_per_s" in r else "")
                                + f", {r['peak_rss_mb']:.0f} MiB")
        if not args.quick:  # (a smoke test measures it once)
            peak("end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return analyse(raw, matmul, specs, systems, skipped, tasks, presets, args, started, load_start)


def analyse(raw, matmul, specs, systems, skipped, tasks, presets, args, started, load_start) -> dict:
    from peers.common import cpu_name  # torch-free

    peaks = [m["peak_gflops"] for m in matmul if "peak_gflops" in m]
    peak = statistics.median(peaks) if peaks else float("nan")
    rows, ratios = [], []
    for p in presets:
        for task in tasks:
            for s in systems:
                if task not in SYSTEMS[s][1]:
                    continue
                ok = [r for r in raw if (r["preset"], r["task"], r["system"]) == (p, task, s) and "error" not in r]
                errors = [r["error"] for r in raw if (r["preset"], r["task"], r["system"]) == (p, task, s) and "error" in r]
                row = {"preset": p, "task": task, "system": s, "label": SYSTEMS[s][0], "errors": errors}
                if ok:
                    key = "tok_per_s" if task == "train" else "sent_per_s"
                    row["unit"] = "target tok/s" if task == "train" else "sent/s"
                    row["value"] = summarize([r[key] for r in ok])
                    row["tok_per_s"] = summarize([r["tok_per_s"] for r in ok])
                    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
                    row["per_round"] = {r["round"]: r[key] for r in ok}
                    shares = [r["cpu_share"] for r in ok if r.get("cpu_share") is not None]
                    row["cpu_share_min"] = min(shares) if shares else None
                    for extra in ("attn_implementation", "transformers", "ctranslate2", "compute_type", "parameters",
                                  "train_flops_per_token", "step_path", "decode_path"):
                        if extra in ok[0]:
                            row[extra] = ok[0][extra]
                    if task == "train" and "train_flops_per_token" in ok[0]:
                        f = ok[0]["train_flops_per_token"]
                        row["model_gflops"] = row["tok_per_s"]["median"] * f / 1e9
                        row["mfu"] = row["model_gflops"] / peak if peak == peak else None
                rows.append(row)
    by_key = {(r["preset"], r["task"], r["system"]): r for r in rows}
    for p in presets:
        for task in tasks:
            for mine, peers in QKV_RATIOS.items():
                q = by_key.get((p, task, mine))
                if not q or "per_round" not in q:
                    continue
                for s in systems:
                    peer = by_key.get((p, task, s))
                    if not (peers is None and not s.startswith("qkv") or peers and s in peers):
                        continue
                    if not peer or "per_round" not in peer:
                        continue
                    paired = [q["per_round"][i] / peer["per_round"][i] for i in q["per_round"] if i in peer["per_round"]]
                    if not paired:
                        continue
                    entry = {"preset": p, "task": task, "system": mine, "peer": s, "ratio": summarize(paired),
                             "ratio_of_medians": q["value"]["median"] / peer["value"]["median"]}
                    for t_task, t_peer, mins, kind in TARGETS:
                        if mine == "qkv" and (t_task, t_peer) == (task, s) and p in mins:
                            entry.update(kind=kind, minimum=mins[p], met=entry["ratio"]["median"] >= mins[p])
                    ratios.append(entry)
    versions = {}
    for pkg in ("torch", "transformers", "ctranslate2"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    root = HERE.parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True,
                                cwd=root).stdout.strip())
    return {
        "meta": {"started": started.isoformat(timespec="seconds"),
                 "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "commit": commit + ("+dirty src" if dirty else ""), "cpu": cpu_name(), "cpus": os.cpu_count(),
                 "threads": args.threads, "rounds": args.rounds, "python": platform.python_version(),
                 "versions": versions, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "skipped": skipped, "argv": sys.argv[1:]},
        "flop_formula": FLOP_FORMULA,
        "specs": specs,
        "matmul": matmul,
        "matmul_peak_gflops": {"median": peak, "all": peaks},
        "rows": rows,
        "ratios": ratios,
        "raw": raw,
    }


FLOP_FORMULA = ("FLOPs per target token (qkv.info.transformer_flops, matmuls only, 2 per multiply-add): "
                "forward = [N_enc(8d²S + 4d·d_ff·S + 4S²d) + N_dec(8d²T + 4T²d + 4d²T + 4d²S + 4TSd + 4d·d_ff·T) "
                "+ 2dVT] / T; training = 3 x forward; MFU = tok/s x training FLOPs per token / measured matmul peak")


def table(res: dict) -> str:
    rows, ratios, specs = res["rows"], res["ratios"], res["specs"]
    out = []
    peak = res["matmul_peak_gflops"]
    allp = ", ".join(f"{x:.0f}" for x in peak["all"])
    out.append(f"{res['meta']['cpu']}, {res['meta']['threads']} threads, {res['meta']['rounds']} round(s); "
               f"commit {res['meta']['commit']}; {res['meta']['started']}")
    out.append(f"fp32 matmul peak: median {peak['median']:.0f} GFLOP/s (start, rounds, end: {allp})")
    out.append(res["flop_formula"])
    for p, s in specs.items():
        m, tr, d = s["model"], s["train"], s["decode"]
        out.append(f"{p}: d_model {m['d_model']}, {m['n_heads']} heads, d_ff {m['d_ff']}, {m['layers']}+{m['layers']} "
                   f"layers, shared vocab {m['vocab']}, dropout {m['dropout']}/{m['attention_dropout']}; train "
                   f"{tr['batch']} x {tr['src_len']}->{tr['tgt_len']} tokens ({tr['batch'] * tr['tgt_len']} target "
                   f"tokens/step, {tr['warmup']} warm-up + {tr['steps']} timed steps); decode {d['batch']} sentences "
                   f"x {d['src_len']} tokens -> {d['out_len']} steps, beam {d['beam_size']} alpha {d['length_penalty']},"
                   f" {d['reps']} timed reps")
    out.append("")
    head = (f"{'preset':<6} {'task':<6} {'system':<21} {'median [min-max]':<28} {'tok/s':>8} {'MFU':>5} {'peak RSS':>9}"
            f" {'CPU':>5}")
    out.append(head)
    out.append("-" * len(head))
    for r in rows:
        if "value" not in r:
            out.append(f"{r['preset']:<6} {r['task']:<6} {r['label']:<21} FAILED: {r['errors'][0][:80] if r['errors'] else ''}")
            continue
        v = r["value"]
        unit = "tok/s" if r["task"] == "train" else "sent/s"
        cell = f"{fmt(v['median'])} [{fmt(v['min'])}-{fmt(v['max'])}] {unit}"
        mfu = f"{100 * r['mfu']:.0f}%" if r.get("mfu") else ""
        out.append(f"{r['preset']:<6} {r['task']:<6} {r['label']:<21} {cell:<28} {fmt(r['tok_per_s']['median']):>8} "
                   f"{mfu:>5} {r['peak_rss_mb'] / 1024:>7.2f}GB "
                   f"{'' if r.get('cpu_share_min') is None else format(100 * r['cpu_share_min'], '.0f') + '%':>5}")
    out.append("")
    head = f"{'preset':<6} {'task':<6} {'qkv / peer':<36} {'ratio median [min-max]':<24} {'target':<16} met"
    out.append(head)
    out.append("-" * len(head))
    for e in ratios:
        rr = e["ratio"]
        cell = f"{rr['median']:.2f} [{rr['min']:.2f}-{rr['max']:.2f}]"
        target = f">= {e['minimum']:.2f} ({e['kind']})" if "minimum" in e else "(report)"
        met = ("yes" if e["met"] else "NO") if "met" in e else ""
        pair = f"{SYSTEMS[e.get('system', 'qkv')][0]} / {SYSTEMS[e['peer']][0]}"
        out.append(f"{e['preset']:<6} {e['task']:<6} {pair:<36} {cell:<24} {target:<16} {met}")
    notes = [f"{s}: {why}" for s, why in res["meta"]["skipped"].items()]
    attn = {r.get("attn_implementation") for r in rows if r.get("attn_implementation")}
    if attn:
        notes.append(f"HF attention implementation: {', '.join(sorted(attn))}")
    if any(r["system"].endswith("-par") for r in rows):
        notes.append("CTranslate2 ... par: inter_threads=threads one-thread workers decoding the batch split in "
                     "threads sub-batches at once (its throughput setting); the others: one batch, "
                     "intra_threads=threads, inter_threads=1")
    notes.append("ratios: median over rounds of the per-round ratio qkv/peer (systems interleaved in each round)")
    notes.append("CPU: the lowest, over rounds, of the CPU time a worker got in its timed calls / (wall time x "
                 "threads); well below 100% means it was single-threaded for part of the time (Python work) or "
                 "another process took its cores (compare rounds in the JSON's raw entries)")
    out.append("")
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", help="comma-separated qkv presets (default: small,base; with --quick: tiny)")
    ap.add_argument("--systems", help=f"comma-separated, from {','.join(SYSTEMS)} (default: all installed)")
    ap.add_argument("--tasks", help="comma-separated, from train,greedy,beam (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all systems (default 3; 1 with --quick)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads per worker (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny preset and shapes, one round")
    ap.add_argument("--seq-len", type=int, help="training source and target length in tokens (default 32)")
    ap.add_argument("--train-tokens", type=int, help="target tokens per training batch (default base 3072, small 4096)")
    ap.add_argument("--train-warmup", type=int, help="untimed training steps (default 2)")
    ap.add_argument("--train-steps", type=int, help="timed training steps (default 3)")
    ap.add_argument("--vocab", type=int, help="shared vocabulary size (default: the preset's, small 8000, base 37000)")
    ap.add_argument("--decode-batch", type=int, help="sentences per decoding batch (default 64)")
    ap.add_argument("--src-len", type=int, help="decoding source length in tokens, EOS included (default 25)")
    ap.add_argument("--out-len", type=int, help="decoder steps per output sentence (default 25)")
    ap.add_argument("--decode-reps", type=int, help="timed decoding repetitions per worker (default 2)")
    ap.add_argument("--beam-size", type=int, default=5, help="beam size of the beam task (default 5)")
    ap.add_argument("--json-out", help="JSON path (default benchmarks/results/speed-<UTC date and time>.json)")
    ap.add_argument("--worker-timeout", type=int, default=1800, help="seconds before a worker is abandoned")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="base", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick and "--rounds" not in (argv if argv is not None else sys.argv):
        args.rounds = 1
    sys.path.insert(0, str(HERE))
    if args.worker:
        return worker_main(args)
    res = measure(args)
    print(table(res))
    path = Path(args.json_out) if args.json_out else RESULTS / f"speed-{res['meta']['started'][:16].replace(':', '')}Z.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {path}")
    failed = [r for r in res["rows"] if "value" not in r]
    return 1 if failed or not res["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
