"""qkv's own decoder against CTranslate2, cell by cell: greedy and beam 5, batch 32 (throughput) and
batch 1 (latency), 1 and 2 threads, float32 against float32 and int8 against int8.

    python benchmarks/decode_speed.py --model /work/models/m30k-small/best
    python benchmarks/decode_speed.py --model runs/m30k/best --shapes recipe,base --before /tmp/before/src
    python benchmarks/decode_speed.py --model tests/fixtures/checkpoints/translate-transformer --quick

Models. ``--model PATH``: a trained translation checkpoint, decoded as it is (outputs end where the
model ends them; one output limit for both engines, as in ``export_speed.py``). ``--shapes`` adds
untrained models built here with that checkpoint's tokenizer and other shapes: ``recipe`` (those of
recipes/multi30k/en-de.toml: d_model 128, 4 heads, d_ff 256, 4 + 4 layers) and ``base`` (the paper's
base model: d_model 512, 8 heads, d_ff 2048, 6 + 6 layers), both with the tokenizer's vocabulary,
not the recipe's 6,000 or the paper's 37,000 pieces. Untrained weights seldom choose EOS, so on
those both engines are held to the same output length: ``--forced-length`` tokens each
(qkv min_len = max_len; CTranslate2 min_decoding_length and max_decoding_length, one more for the
EOS step qkv takes).

Every model is exported to CTranslate2 (float32 and ``--quantization int8``) into a temporary
directory. Each engine runs alone in its process: for each model, weights and thread count, one
worker process per engine (the CTranslate2 one never imports torch) holds that one model loaded
(one ``ctranslate2.Translator`` per process: two 2-thread translators in one process make
CTranslate2's OpenMP threads sleep between parallel regions, 14-17 times slower on 2 cores); the
parent sends them the cells in turn, so qkv and CTranslate2 alternate cell by cell, the order
swapped every round, for ``--rounds`` rounds; each cell's figure is the median over rounds (after
one untimed warm-up). A pause between calls lets the other engine's OpenMP threads stop spinning.
The check that CTranslate2 at 2 threads is not slower than at 1 (per cell, when both are measured)
is printed and kept in the JSON (``checks``). qkv runs what ``qkv translate`` runs
(``Translator.translate``: sorted by length, ``batch`` sentences a batch; ``--int8``: dynamic int8
quantisation); CTranslate2 ``translate_batch(max_batch_size=batch)``, compute_type float32 or int8.
Beam cells rank hypotheses as CTranslate2 does (``length_norm="length"``, alpha 0.6), so both search
alike. ``--before SRC``: a third worker runs qkv from another source tree (e.g. ``git archive`` of an
earlier commit), measured in the same rounds.

Reported per cell: sentences/s and output tokens/s of each engine (its own output pieces: on the
untrained models CTranslate2 writes one more per sentence than qkv, which spends that step on EOS),
and qkv's speed as a fraction of CTranslate2's (CTranslate2's seconds over qkv's: 1.0 = as fast). Prints a Markdown table; writes the
JSON to benchmarks/results/decode-speed-DATE.json (``--json`` elsewhere). The machine's load is
recorded: on a shared machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers.common import cpu_name, git_commit  # torch-free: the CTranslate2 worker imports this file

HERE = Path(__file__).resolve().parent
TEST_SET = Path("/work/shared/data/multi30k/test_2016_flickr.en.gz")
SHAPES = {  # untrained models built with the checkpoint's tokenizer (--shapes)
    "recipe": {"d_model": 128, "n_heads": 4, "d_ff": 256, "n_encoder_layers": 4, "n_decoder_layers": 4},
    "base": {"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_encoder_layers": 6, "n_decoder_layers": 6},
}
PAUSE = 0.3  # seconds between calls: CTranslate2's OpenMP threads spin 200 ms after a parallel region
LENGTH_PENALTY = 0.6


# --- workers: one process per engine, a JSON line in, a JSON line out per cell ----------------------

def qkv_engine():
    import torch

    import qkv

    models: dict = {}

    def run(cell: dict) -> dict:
        torch.set_num_threads(cell["threads"])
        key = (cell["model"], cell["dtype"])
        if key not in models:
            models[key] = qkv.load(cell["model"], quantize="int8" if cell["dtype"] == "int8" else None)
        model = models[key]
        extra = {"length_norm": "length", "length_penalty": LENGTH_PENALTY} if cell["beam"] > 1 else {}
        if cell["forced"]:
            extra.update(max_len_a=0.0, max_len_b=cell["forced"], min_len=cell["forced"])
        else:
            extra.update(max_len_a=0.0, max_len_b=cell["limit"])
        hyps = model.hypotheses(cell["sentences"], beam_size=cell["beam"], batch_size=cell["batch"], **extra)
        return {"tokens": sum(len(h[0].tokens) for h in hyps)}
    return run


def ct2_engine():
    import ctranslate2  # never torch: its idle OpenMP threads would slow CTranslate2 down
    import sentencepiece as spm

    translators: dict = {}
    tokenizers: dict = {}

    def run(cell: dict) -> dict:
        directory = cell["ct2"][cell["dtype"]]
        key = (directory, cell["threads"])
        if key not in translators:
            translators[key] = ctranslate2.Translator(directory, device="cpu", intra_threads=cell["threads"],
                                                      inter_threads=1, compute_type=cell["dtype"])
        if directory not in tokenizers:
            tokenizers[directory] = spm.SentencePieceProcessor(model_file=str(Path(directory) / "source.spm"))
        pieces = tokenizers[directory].encode(cell["sentences"], out_type=str)
        limits = ({"min_decoding_length": cell["forced"], "max_decoding_length": cell["forced"] + 1}
                  if cell["forced"] else {"max_decoding_length": cell["limit"]})
        results = translators[key].translate_batch(pieces, beam_size=cell["beam"], max_batch_size=cell["batch"],
                                                   length_penalty=LENGTH_PENALTY, **limits)
        return {"tokens": sum(len(r.hypotheses[0]) for r in results), "translators": len(translators)}
    return run


def worker(engine: str) -> int:
    run = ct2_engine() if engine == "ct2" else qkv_engine()
    warm: set = set()
    for line in sys.stdin:
        cell = json.loads(line)
        key = json.dumps({k: v for k, v in cell.items() if k != "sentences"}, sort_keys=True)
        if key not in warm:
            run(cell)
            warm.add(key)
        t0 = time.perf_counter()
        out = run(cell)
        out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), flush=True)
    return 0


class Worker:
    """A worker process of this script, fed one cell at a time."""

    def __init__(self, engine: str, threads: int, pythonpath: str | None = None):
        env = dict(os.environ)
        env.update({v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", engine],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, cell: dict) -> dict:
        self.proc.stdin.write(json.dumps(cell) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.engine} worker stopped (exit {self.proc.wait()}) on {cell['label']}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --- the parent ------------------------------------------------------------------------------------------

def untrained(checkpoint: str, shapes: dict, out: Path) -> str:
    """A checkpoint with ``checkpoint``'s tokenizer and config but these shapes, random weights (seed 0)."""
    import dataclasses
    import shutil

    import torch

    from qkv.checkpoint import read_checkpoint, read_config, save_checkpoint
    from qkv.models import build_model

    ckpt = read_checkpoint(checkpoint)
    cfg = dataclasses.replace(read_config(checkpoint, "model"), **shapes)
    torch.manual_seed(0)
    model = build_model(cfg)
    config = dict(ckpt.config, model=dataclasses.asdict(cfg))
    extras = [f for f in ckpt.files if f not in ("config.json", "model.safetensors", "trainer_state.pt",
                                                 "manifest.json")]

    def write_extra(d: Path) -> None:
        for f in extras:
            shutil.copy(Path(checkpoint) / f, d / f)
    return str(save_checkpoint(out, model, config, write_extra=write_extra))


def cells(args, models: list[dict]) -> list[dict]:
    out = []
    for m in models:
        for threads in args.threads:
            for beam in args.beams:
                for batch in args.batches:
                    n = args.n_batch if batch > 1 else args.n_one
                    if m["name"] == "base":
                        n = max(1, n // 2)
                    for dtype in ("float32", "int8"):
                        out.append({"label": f"{m['name']} t{threads} beam{beam} b{batch} {dtype}",
                                    "model": m["path"], "ct2": m["ct2"], "dtype": dtype, "threads": threads,
                                    "beam": beam, "batch": batch, "forced": m["forced"], "limit": m["limit"],
                                    "sentences": args.sentences[:n], "name": m["name"]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=False, help="a trained translation checkpoint (Transformer)")
    p.add_argument("--shapes", default="base",
                   help="untrained models to add, comma-separated: recipe, base ('' for none; default base)")
    p.add_argument("--src", default=str(TEST_SET), help="source sentences, one a line (plain or gzip)")
    p.add_argument("--n-batch", type=int, default=32, help="sentences for the batch-32 cells (base: half)")
    p.add_argument("--n-one", type=int, default=4, help="sentences for the batch-1 cells (base: half)")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--beams", default="1,5", help="beam sizes, comma-separated")
    p.add_argument("--batches", default="32,1", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds (the median is reported)")
    p.add_argument("--forced-length", type=int, default=24, help="output length of the untrained models")
    p.add_argument("--before", help="a qkv source tree (its src/) to measure beside this one")
    p.add_argument("--json", help="write the results here (default benchmarks/results/decode-speed-DATE.json)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: no --shapes, 1 thread, 8/2 sentences, outputs of at most 16 tokens, 1 round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.model:
        p.error("--model PATH is required")
    if args.quick:
        args.shapes, args.threads, args.n_batch, args.n_one, args.rounds = "", "1", 8, 2, 1

    from qkv.checkpoint import read_config
    from qkv.data.corpus import read_lines
    from qkv.export import export
    from export_speed import limit, shapes as model_shapes

    if read_config(args.model, "model").task != "translate":
        raise SystemExit(f"--model {args.model}: this benchmark translates; give a translation checkpoint")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.beams = [int(b) for b in args.beams.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sentences = [s for s in read_lines(args.src) if s.strip()][: max(args.n_batch, args.n_one)]
    extra = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in extra if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    decode = read_config(args.model, "decode")
    with tempfile.TemporaryDirectory(prefix="decode-speed-") as tmp:
        t = Path(tmp)
        cap = 16 if args.quick else 1024
        models = [{"name": "trained", "path": args.model, "forced": 0,
                   "limit": min(cap, limit(args.model, args.sentences, decode))}]
        for name in extra:
            models.append({"name": name, "path": untrained(args.model, SHAPES[name], t / name / "ckpt"),
                           "forced": args.forced_length, "limit": 0})
        for m in models:
            m["shapes"], m["preset"] = model_shapes(m["path"])
            m["ct2"] = {}
            for dtype, q in (("float32", None), ("int8", "int8")):
                m["ct2"][dtype] = str(t / m["name"] / f"ct2-{dtype}")
                export(m["path"], "ctranslate2", m["ct2"][dtype], quantization=q)
            print(f"{m['name']}: {m['path']} ({m['preset']})", file=sys.stderr)
        todo = cells(args, models)
        engines = {"qkv": None, "ct2": None}
        if args.before:
            engines["before"] = args.before
        times: dict = {c["label"]: {e: [] for e in engines} for c in todo}
        tokens: dict = {c["label"]: {} for c in todo}
        workers = {}
        groups = list(dict.fromkeys((c["threads"], c["name"], c["dtype"]) for c in todo))
        try:
            for group in groups:  # one model, one weight type, one thread count per worker process
                workers = {e: Worker("ct2" if e == "ct2" else "qkv", group[0], path) for e, path in engines.items()}
                mine = [c for c in todo if (c["threads"], c["name"], c["dtype"]) == group]
                for r in range(args.rounds):
                    for i, cell in enumerate(mine):
                        order = list(engines)
                        shift = (r + i) % len(order)
                        for e in order[shift:] + order[:shift]:
                            got = workers[e].run(cell)
                            times[cell["label"]][e].append(got["seconds"])
                            tokens[cell["label"]][e] = got["tokens"]
                            if "translators" in got:  # translators alive in that CTranslate2 process
                                tokens[cell["label"]]["ct2_translators"] = got["translators"]
                            time.sleep(PAUSE)
                        print(f"round {r + 1} {cell['label']}: " + ", ".join(
                            f"{e} {times[cell['label']][e][-1]:.2f} s" for e in engines), file=sys.stderr)
                for w in workers.values():
                    w.close()
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.proc.kill()
    result = summarise(args, models, todo, times, tokens, list(engines))
    print(table(result))
    path = Path(args.json) if args.json else HERE / "results" / f"decode-speed-{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"written: {path}", file=sys.stderr)
    return 0


def summarise(args, models, todo, times, tokens, engines) -> dict:
    import ctranslate2
    import torch

    rows = []
    for c in todo:
        n = len(c["sentences"])
        row = {k: c[k] for k in ("name", "threads", "beam", "batch", "dtype")}
        row["sentences"] = n
        for e in engines:
            s = statistics.median(times[c["label"]][e])
            row[e] = {"seconds": s, "seconds_per_round": times[c["label"]][e], "sent_per_s": n / s,
                      "tok_per_s": tokens[c["label"]][e] / s, "output_tokens": tokens[c["label"]][e]}
        row["ct2"]["translators_in_process"] = tokens[c["label"]]["ct2_translators"]
        row["qkv_vs_ct2"] = row["ct2"]["seconds"] / row["qkv"]["seconds"]
        if "before" in engines:
            row["before_vs_ct2"] = row["ct2"]["seconds"] / row["before"]["seconds"]
        rows.append(row)
    return {
        "models": [{k: m[k] for k in ("name", "path", "shapes", "preset", "forced", "limit")} for m in models],
        "src": args.src, "rounds": args.rounds, "before": args.before, "rows": rows, "checks": thread_checks(rows),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "ctranslate2": ctranslate2.__version__,
                    "load_average": os.getloadavg()},
        "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()),
    }


def thread_checks(rows: list[dict]) -> list[dict]:
    """Per cell measured at 1 and 2 threads: CTranslate2's seconds at each, and whether 2 threads were
    not slower than 1 (``ok``)."""
    by = {(r["name"], r["beam"], r["batch"], r["dtype"], r["threads"]): r for r in rows}
    out = []
    for (name, beam, batch, dtype, threads), r in by.items():
        one = by.get((name, beam, batch, dtype, 1))
        if threads == 2 and one is not None:
            out.append({"cell": f"{name} beam{beam} b{batch} {dtype}", "ct2_1_thread_s": one["ct2"]["seconds"],
                        "ct2_2_threads_s": r["ct2"]["seconds"], "ok": r["ct2"]["seconds"] <= one["ct2"]["seconds"]})
    return out


def table(result: dict) -> str:
    lines = []
    for m in result["models"]:
        s = m["shapes"]
        how = f"outputs forced to {m['forced']} tokens" if m["forced"] else f"outputs at most {m['limit']} tokens"
        lines.append(f"- {m['name']}: d_model {s['d_model']}, {s['n_encoder_layers']}+{s['n_decoder_layers']} layers, "
                     f"d_ff {s['d_ff']}, {s['n_heads']} heads, vocabulary {s['vocab']} ({m['preset']}); {how}")
    before = result["before"] is not None
    lines += ["", f"{result['machine']['cpu']}, load average {result['machine']['load_average'][0]:.1f}, "
              f"commit {result['commit']}, median of {result['rounds']} rounds; ratio = CTranslate2 s / qkv s", "",
              "| model | threads | search | batch | weights | qkv sent/s | qkv tok/s | CT2 sent/s | CT2 tok/s | qkv / CT2 |"
              + (" before / CT2 |" if before else ""),
              "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if before else "")]
    for r in result["rows"]:
        search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
        line = (f"| {r['name']} | {r['threads']} | {search} | {r['batch']} | {r['dtype']} | "
                f"{r['qkv']['sent_per_s']:.1f} | {r['qkv']['tok_per_s']:.0f} | {r['ct2']['sent_per_s']:.1f} | "
                f"{r['ct2']['tok_per_s']:.0f} | {r['qkv_vs_ct2']:.2f} |")
        if before:
            line += f" {r['before_vs_ct2']:.2f} |"
        lines.append(line)
    checks = result.get("checks") or []
    if checks:
        slower = [c["cell"] for c in checks if not c["ok"]]
        lines += ["", f"check, CTranslate2 at 2 threads not slower than at 1: {len(checks) - len(slower)} of "
                      f"{len(checks)} cells" + (f"; slower: {', '.join(slower)}" if slower else "")]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
