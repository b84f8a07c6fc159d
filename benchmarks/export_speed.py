"""Speed and peak memory of a model exported to CTranslate2 against ``qkv translate``, on the same
sentences with the same beam.

    python benchmarks/export_speed.py runs/ende/best --src test.en --ref test.de
    python benchmarks/export_speed.py runs/ende/best --src test.en --beam-size 1 --threads 2 --rounds 5
    python benchmarks/export_speed.py tests/fixtures/checkpoints/translate-transformer --quick   # smoke test

The checkpoint's own shapes are measured (the table's header names them, and the preset they are,
e.g. base = the paper's base model: d_model 512, 6 + 6 layers, d_ff 2048, 8 heads). The script
exports the checkpoint twice (``qkv export --format ctranslate2``, float32 and ``--quantization
int8``) into a temporary directory, then runs each system in its own process:

* qkv:       ``qkv.load(CKPT).translate(sentences, beam_size=B, batch_size=N)``, what ``qkv translate``
             runs (sorted by length, N sentences a batch; qkv's length penalty and limits);
* qkv-int8:  the same with dynamic int8 quantisation (``qkv translate --int8``);
* ct2-f32:   ``ctranslate2.Translator`` on the float32 export, ``translate_batch(max_batch_size=N)``,
             compute_type float32, in a process that never imports torch;
* ct2-int8:  the same on the int8 export, compute_type int8.

Every system gets --threads intra-op threads (torch.set_num_threads; CTranslate2 intra_threads,
inter_threads=1; OMP/MKL variables), translates all sentences once to warm up and then --reps
times (the median is reported), for --rounds rounds launched round-robin with the order rotated
(the median over rounds). Reported: sentences/s, output tokens/s (SentencePiece pieces of the
outputs), peak RSS of the process (VmHWM) and its RSS right after loading the model, the
share of the CPU time the process got (well below 1: another process took the cores), the lines
identical to qkv float32's, and sacreBLEU when --ref is given.

Every system gets one output limit, the largest of qkv's per-sentence limits (max_len_a · |x| +
max_len_b) over the sentences: CTranslate2 takes one max_decoding_length per call, and qkv is given
the same (max_len_a 0, max_len_b = the limit), so that both do the same work. With --beam-size 1
the outputs are then qkv's; with a beam they may differ a little: CTranslate2 ranks hypotheses by
log P / |Y|^α where qkv's default (length_norm gnmt) uses ((5 + |Y|) / 6)^α; ``--length-norm
length`` gives qkv CTranslate2's ranking.

Needs: pip install -c constraints.txt -e ".[export]". Prints a table and the JSON of the run;
--json FILE also writes it there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers.common import cpu_name, set_thread_env  # torch-free: the CTranslate2 worker imports this file

HERE = Path(__file__).resolve().parent
MARK = "EXPORT-SPEED "
SYSTEMS = ("qkv", "qkv-int8", "ct2-f32", "ct2-int8")
LABELS = {"qkv": "qkv translate (float32)", "qkv-int8": "qkv translate --int8", "ct2-f32": "CTranslate2 float32",
          "ct2-int8": "CTranslate2 int8"}


def rss_mb() -> float:
    """Current resident set size in MiB (from /proc; the peak is ru_maxrss)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB: VmHWM, which starts afresh at exec (ru_maxrss
    does not: a worker would report the RSS of the parent it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- workers (one process each) ---------------------------------------------------------------------

def run_qkv(args, sentences: list[str]):
    import torch

    import qkv

    torch.set_num_threads(args.threads)
    model = qkv.load(args.checkpoint, quantize="int8" if args.worker == "qkv-int8" else None)

    def translate():  # the same limit as CTranslate2's, see limit()
        extra = {"length_norm": args.length_norm} if args.length_norm else {}
        return model.translate(sentences, beam_size=args.beam_size, batch_size=args.batch_size, max_len_a=0.0,
                               max_len_b=args.limit, **extra)
    return translate


def run_ct2(args, sentences: list[str]):
    import ctranslate2  # never torch: its idle OpenMP threads would slow CTranslate2 down
    import sentencepiece as spm

    directory = Path(args.ct2_dir)
    info = json.loads((directory / "qkv_export.json").read_text())
    dec = info["decode"]["qkv"]
    translator = ctranslate2.Translator(str(directory), device="cpu", intra_threads=args.threads, inter_threads=1,
                                        compute_type="int8" if args.worker == "ct2-int8" else "float32")
    source = spm.SentencePieceProcessor(model_file=str(directory / "source.spm"))
    target = spm.SentencePieceProcessor(model_file=str(directory / "target.spm"))

    def translate():
        pieces = source.encode(sentences, out_type=str)
        results = translator.translate_batch(pieces, beam_size=args.beam_size, max_batch_size=args.batch_size,
                                             length_penalty=dec["length_penalty"], max_decoding_length=args.limit)
        return target.decode([r.hypotheses[0] for r in results])
    return translate


def worker(args) -> int:
    set_thread_env(args.threads)
    sentences = Path(args.sentences).read_text(encoding="utf-8").split("\n")[:-1]
    t0 = time.perf_counter()
    translate = (run_ct2 if args.worker.startswith("ct2") else run_qkv)(args, sentences)
    load_s, loaded_rss = time.perf_counter() - t0, rss_mb()
    hyps = translate()  # warm-up
    walls, cpus = [], []
    for _ in range(args.reps):
        c0, w0 = time.process_time(), time.perf_counter()
        hyps = translate()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    Path(args.hyps).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    print(MARK + json.dumps({"system": args.worker, "seconds": walls, "load_seconds": load_s,
                             "rss_after_load_mb": loaded_rss, "peak_rss_mb": peak_rss_mb(),
                             "cpu_share": sum(cpus) / (sum(walls) * args.threads)}), flush=True)
    return 0


# --- the parent ------------------------------------------------------------------------------------------

def shapes(checkpoint: str) -> tuple[dict, str]:
    from qkv.checkpoint import read_config
    from qkv.config import MODEL_PRESETS

    cfg = read_config(checkpoint, "model")
    keys = ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers")
    model = {k: getattr(cfg, k) for k in keys}
    model.update(vocab=cfg.tgt_vocab_size, norm_first=cfg.norm_first, positional=cfg.positional)
    preset = next((name for name, p in MODEL_PRESETS.items() if all(getattr(p, k) == model[k] for k in keys)), None)
    return model, preset or "no preset"


def launch(system: str, args, sentences: Path, ct2_dirs: dict, hyps: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), args.checkpoint, "--worker", system, "--sentences", str(sentences),
           "--hyps", str(hyps), "--threads", str(args.threads), "--beam-size", str(args.beam_size),
           "--batch-size", str(args.batch_size), "--reps", str(args.reps), "--limit", str(args.limit)]
    if args.length_norm:
        cmd += ["--length-norm", args.length_norm]
    if system.startswith("ct2"):
        cmd += ["--ct2-dir", str(ct2_dirs[system])]
    env = dict(os.environ)
    env.update({v: str(args.threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a translation checkpoint (Transformer), e.g. runs/ende/best")
    p.add_argument("--src", help="sentences to translate, one a line (plain or gzip)")
    p.add_argument("--ref", help="their references: sacreBLEU of every system's output")
    p.add_argument("--n", type=int, default=0, help="use the first N sentences (0: all)")
    p.add_argument("--beam-size", type=int, default=0, help="beam size for every system (0: the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch for every system")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every system")
    p.add_argument("--reps", type=int, default=2, help="timed passes over the sentences per process (median)")
    p.add_argument("--rounds", type=int, default=3, help="processes per system, launched round-robin")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--length-norm", choices=("gnmt", "length"),
                   help="qkv's length normalisation in beam search (default: the checkpoint's); "
                        "'length' ranks by log P / |Y|^α as CTranslate2 does")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--quick", action="store_true", help="smoke test: 16 sentences, one round, one pass")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sentences", help=argparse.SUPPRESS)
    p.add_argument("--hyps", help=argparse.SUPPRESS)
    p.add_argument("--ct2-dir", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    from qkv.checkpoint import read_config
    from qkv.data.corpus import read_lines
    from qkv.export import export

    if read_config(args.checkpoint, "model").task != "translate":
        raise SystemExit(f"{args.checkpoint}: this benchmark translates; give a translation checkpoint")
    decode = read_config(args.checkpoint, "decode")
    args.beam_size = args.beam_size or decode.beam_size
    if args.quick:
        args.n, args.rounds, args.reps = args.n or 16, 1, 1
    if args.src:
        sentences = read_lines(args.src)
    else:
        sentences = ["red cat", "the big dog sun", "small tree", "three hundred twenty-one", "a man rides a bicycle"] * 4
    sentences = [s for s in sentences if s.strip()]
    if args.n:
        sentences = sentences[: args.n]
    refs = read_lines(args.ref)[: len(sentences)] if args.ref else None
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.limit = limit(args.checkpoint, sentences, decode)
    model, preset = shapes(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="export-speed-") as tmp:
        t = Path(tmp)
        (t / "sentences.txt").write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
        ct2_dirs = {"ct2-f32": t / "ct2-f32", "ct2-int8": t / "ct2-int8"}
        if "ct2-f32" in systems:
            export(args.checkpoint, "ctranslate2", ct2_dirs["ct2-f32"])
        if "ct2-int8" in systems:
            export(args.checkpoint, "ctranslate2", ct2_dirs["ct2-int8"], quantization="int8")
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        outputs: dict[str, list[str]] = {}
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for system in order:
                hyps = t / f"{system}.hyp"
                runs[system].append(launch(system, args, t / "sentences.txt", ct2_dirs, hyps))
                outputs[system] = hyps.read_text(encoding="utf-8").split("\n")[:-1]
                print(f"round {r + 1} {system}: {statistics.median(runs[system][-1]['seconds']):.2f} s", file=sys.stderr)
    result = summarise(args, sentences, refs, systems, runs, outputs, model, preset)
    print(table(result))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def limit(checkpoint: str, sentences: list[str], decode) -> int:
    """One output limit for every system and sentence: the largest of qkv's per-sentence limits
    (max_len_a · (tokens + EOS) + max_len_b, at most 1024). CTranslate2 takes one limit per call; qkv is
    given the same one (max_len_a 0, max_len_b = it), so both do the same work on a sentence that
    never ends and greedy outputs are comparable line by line."""
    import qkv

    tok = qkv.load(checkpoint).tokenizers.src
    return min(1024, max(int(decode.max_len_a * (len(ids) + 1) + decode.max_len_b) for ids in tok.encode(sentences)))


def summarise(args, sentences, refs, systems, runs, outputs, model, preset) -> dict:
    import qkv
    from qkv.metrics import bleu

    tok = qkv.load(args.checkpoint).tokenizers.tgt
    rows = {}
    for system in systems:
        seconds = [statistics.median(r["seconds"]) for r in runs[system]]
        s = statistics.median(seconds)
        out_tokens = sum(len(ids) for ids in tok.encode(outputs[system]))
        row = {"label": LABELS[system], "seconds": s, "seconds_per_round": seconds,
               "sent_per_s": len(sentences) / s, "tok_per_s": out_tokens / s, "output_tokens": out_tokens,
               "peak_rss_mb": max(r["peak_rss_mb"] for r in runs[system]),
               "rss_after_load_mb": statistics.median(r["rss_after_load_mb"] for r in runs[system]),
               "load_seconds": statistics.median(r["load_seconds"] for r in runs[system]),
               "cpu_share": min(r["cpu_share"] for r in runs[system])}
        if "qkv" in outputs:
            row["identical_to_qkv"] = sum(a == b for a, b in zip(outputs[system], outputs["qkv"])) / len(sentences)
        if refs:
            row["bleu"] = round(bleu(outputs[system], refs, quiet=True).score, 2)
        rows[system] = row
    if "qkv" in rows:
        for row in rows.values():
            row["speed_vs_qkv"] = rows["qkv"]["seconds"] / row["seconds"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src", "benchmarks"], capture_output=True,
                                text=True, cwd=HERE).stdout.strip())
    import ctranslate2
    import torch

    return {
        "checkpoint": args.checkpoint, "shapes": model, "preset": preset, "sentences": len(sentences),
        "src": args.src, "beam_size": args.beam_size, "length_norm": args.length_norm or "checkpoint's", "output_limit": args.limit, "batch_size": args.batch_size, "threads": args.threads,
        "reps": args.reps, "rounds": args.rounds, "systems": rows,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "ctranslate2": ctranslate2.__version__,
                    "load_average": os.getloadavg()},
        "commit": commit + ("-dirty" if dirty else ""), "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }


def table(result: dict) -> str:
    m = result["shapes"]
    head = (f"{result['sentences']} sentences, beam {result['beam_size']} (qkv length norm: {result.get('length_norm')}), batch {result['batch_size']}, "
            f"at most {result['output_limit']} output tokens, "
            f"{result['threads']} thread(s); shapes: d_model {m['d_model']}, {m['n_encoder_layers']}+"
            f"{m['n_decoder_layers']} layers, d_ff {m['d_ff']}, {m['n_heads']} heads, vocabulary {m['vocab']} "
            f"({result['preset']}); {result['machine']['cpu']}, commit {result['commit']}")
    lines = [head, "", "| system | sent/s | tok/s | × qkv | peak RSS MiB | RSS after load MiB | identical to qkv | BLEU | CPU share |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["systems"].values():
        lines.append(f"| {row['label']} | {row['sent_per_s']:.1f} | {row['tok_per_s']:.0f} | "
                     f"{row.get('speed_vs_qkv', float('nan')):.2f} | {row['peak_rss_mb']:.0f} | "
                     f"{row['rss_after_load_mb']:.0f} | {100 * row.get('identical_to_qkv', float('nan')):.1f}% | "
                     f"{row.get('bleu', '')} | {row['cpu_share']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
