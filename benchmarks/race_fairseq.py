"""qkv against fairseq 0.12.2: the same model, data, vocabulary and machine, trained side by side.

    benchmarks/peers/fairseq/setup.sh /tmp/fs/venv              # fairseq in its own venv, once
    python benchmarks/race_fairseq.py prepare                     # data for both (W: /work/race)
    python benchmarks/race_fairseq.py train --run 1 --minutes 60  # qkv on core 0, fairseq on core 1
    python benchmarks/race_fairseq.py train --run 2 --minutes 60  # cores swapped (and seed 2)
    python benchmarks/race_fairseq.py evaluate --run 1            # test BLEU at the 15-minute marks
    python benchmarks/race_fairseq.py decode --run 1              # decoding speed of run 1's averages
    python benchmarks/race_fairseq.py report                      # table, curves, JSON
    python benchmarks/race_fairseq.py speed --run 1 --within 600  # throughput alone, first 10 minutes

What is the same.
- Data: Multi30k En→De train, val, test_2016_flickr. ``qkv preprocess`` (the command of
  recipes/multi30k/run.py) trains the SentencePiece model; every split is cut into its pieces by
  that model and binarized for fairseq by ``fairseq-preprocess --joined-dictionary`` with a
  dictionary of all its pieces (``--srcdict``), so both read the same token sequences and have the
  same number of embedding rows (qkv's 4 special pieces are fairseq's 4 special symbols).
- Model: recipes/multi30k/en-de.toml (4 + 4 layers, d_model 128, FFN 256, 4 heads, dropout 0.3,
  attention dropout 0.1, all embeddings shared, and fairseq's initialisation: ``init = "fairseq"``)
  and fairseq's ``transformer`` architecture with those flags; ``prepare`` counts the parameters of both (equal: 2,093,056; fairseq 0.12.2's encoder
  layers also hold copies of their weights for torch's fast inference path, which training does
  not use, and which are counted apart).
- Optimization: Adam (0.9, 0.98), ε 1e-9; the inverse-square-root schedule with 1,000 warmup
  updates and the recipe's peak (lr_scale 1.5 · d_model^-0.5 · 1000^-0.5 = 4.19e-3; fairseq
  ``--lr`` that peak, ``--warmup-init-lr 0``); label smoothing 0.1; 4,096 tokens per side per batch;
  gradient norm clipped at 1.0 (qkv's default; fairseq ``--clip-norm 1.0``).
- Loop: validation loss on all of val and a checkpoint every ``--interval`` updates for both (qkv
  ``--eval-bleu-samples 0``: fairseq does not decode while training); nothing at epoch ends.
- Time: both start at once, one thread each (``taskset`` to separate cores, OMP_NUM_THREADS=1),
  and both are stopped ``--minutes`` later (SIGINT, then SIGKILL after 60 s). The 15-minute marks
  take the newest checkpoint each had written by then (file times).
- Decoding for BLEU: beam 5, lp = |Y|^α with α 1.0 and fairseq's stopping rule (fairseq's defaults;
  qkv ``--length-norm length --early-stopping``), at most 1·|x| + 50 tokens, batch 32, one thread.
  Scores: sacreBLEU (cased, 13a) and BLEU-4 on lowercased Moses-tokenized text (the published
  convention, ``qkv.metrics.bleu_tok_lc``).

Validation NLL: each toolkit's own figure over all of val, un-smoothed, per target token with EOS;
fairseq logs it in bits (``valid_nll_loss``) and is converted to nats. Peak memory: the summed RSS
of each process tree (fairseq's data-loading worker included), sampled every 2 s.
Results: W/run-N/ (runs and logs), benchmarks/results/race-fairseq-DATE.json, docs/img/race-*.png.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from peers.common import cpu_name, git_commit  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"
CONFIG = ROOT / "recipes" / "multi30k" / "en-de.toml"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
MARKS_MIN = (15, 30, 45, 60)
BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B = 5, 1.0, 1, 50


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def recipe() -> dict:
    from qkv.config import load_toml

    return load_toml(str(CONFIG))


def peak_lr(cfg: dict) -> float:
    t = cfg["train"]
    return t["lr_scale"] * cfg["model"]["d_model"] ** -0.5 * t["warmup_steps"] ** -0.5


def thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",  # fairseq 0.12 loads its own pickled checkpoints
            "PYTHONPATH": str(ROOT / "src")}


# --- prepare ---------------------------------------------------------------------------------------

def prepare(args) -> None:
    w, venv = Path(args.work), Path(args.venv)
    raw = w / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, name in SPLITS.items():
        for lang in ("en", "de"):
            dst = raw / f"{split}.{lang}"
            if not dst.exists():
                with gzip.open(DATA / f"{name}.{lang}.gz", "rt", encoding="utf-8") as f:
                    dst.write_text(f.read(), encoding="utf-8")
    qbin = w / "qkv-bin"
    if not (qbin / "manifest.json").is_file():
        sys.path.insert(0, str(ROOT / "recipes" / "multi30k"))
        import run as multi30k_run  # the recipe's own preprocess command

        files = {f"{s}.{lang}": raw / f"{split}.{lang}" for split, s in (("train", "train"), ("valid", "val"))
                 for lang in ("en", "de")}
        sh(multi30k_run.preprocess_command([sys.executable, "-m", "qkv"], str(CONFIG), files, "en", "de", qbin, None))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(qbin / "spm.model"))
    pieces = w / "pieces"
    pieces.mkdir(exist_ok=True)
    for split in SPLITS:
        for lang in ("en", "de"):
            lines = (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            (pieces / f"{split}.{lang}").write_text(
                "".join(" ".join(p) + "\n" for p in sp.encode(lines, out_type=str)), encoding="utf-8")
    # every piece but the four specials (pad, unk, bos, eos: ids 0-3), which fairseq's Dictionary
    # holds itself (<s>, <pad>, </s>, <unk>): the same 6,000 rows
    (w / "dict.txt").write_text("".join(f"{sp.id_to_piece(i)} 1\n" for i in range(4, sp.get_piece_size())),
                                encoding="utf-8")
    fbin = w / "fs-bin"
    if fbin.exists():
        shutil.rmtree(fbin)
    sh([venv / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
        "--trainpref", pieces / "train", "--validpref", pieces / "valid", "--testpref", pieces / "test",
        "--srcdict", w / "dict.txt", "--joined-dictionary", "--destdir", fbin, "--workers", "2",
        "--dataset-impl", "mmap"], env=thread_env())
    counts = parameter_counts(args)
    (w / "parameters.json").write_text(json.dumps(counts, indent=1))
    print(json.dumps(counts, indent=1))


def parameter_counts(args) -> dict:
    """Build both untrained models and count their parameters."""
    from qkv.config import ModelConfig
    from qkv.models.transformer import Transformer

    cfg = recipe()
    vocab = cfg["train"]["vocab_size"]  # joint: the SentencePiece model's pieces
    qkv_model = Transformer(ModelConfig(**cfg["model"], src_vocab_size=vocab, tgt_vocab_size=vocab))
    n_qkv = sum(p.numel() for p in qkv_model.parameters())
    code = ("import sys, json\n"
            "from fairseq import options, tasks\n"
            "parser = options.get_training_parser()\n"
            "a = options.parse_args_and_arch(parser, sys.argv[1:])\n"
            "from fairseq.dataclass.utils import convert_namespace_to_omegaconf\n"
            "cfg = convert_namespace_to_omegaconf(a)\n"
            "task = tasks.setup_task(cfg.task)\n"
            "model = task.build_model(cfg.model)\n"
            "import re\n"
            "copies = sum(p.numel() for n, p in model.named_parameters()\n"
            "             if re.search(r'layers\\.\\d+\\.(in_proj|out_proj|fc1|fc2)_(weight|bias)$', n))\n"
            "print(json.dumps({'params': sum(p.numel() for p in model.parameters()), 'copies': copies,\n"
            "                  'dict': len(task.src_dict)}))\n")
    out = subprocess.run([str(Path(args.venv) / "bin" / "python"), "-c", code, *map(str, fairseq_args(args, 1))],
                         capture_output=True, text=True, env=thread_env(), check=True).stdout.strip().splitlines()[-1]
    fs = json.loads(out)
    # fairseq 0.12.2's encoder layers also register copies of their weights (in_proj_weight,
    # fc1_weight, ...) for torch's fast inference path; training never uses them (no gradient)
    return {"qkv": n_qkv, "fairseq_trained": fs["params"] - fs["copies"], "fairseq_fast_path_copies": fs["copies"],
            "fairseq_dictionary": fs["dict"]}


# --- train -----------------------------------------------------------------------------------------

def fairseq_args(args, seed: int, save_dir: Path | None = None) -> list:
    cfg = recipe()
    m, t = cfg["model"], cfg["train"]
    w = Path(args.work)
    return [w / "fs-bin", "--task", "translation", "--source-lang", "en", "--target-lang", "de",
            "--arch", "transformer", "--share-all-embeddings",
            "--encoder-layers", m["n_encoder_layers"], "--decoder-layers", m["n_decoder_layers"],
            "--encoder-embed-dim", m["d_model"], "--decoder-embed-dim", m["d_model"],
            "--encoder-ffn-embed-dim", m["d_ff"], "--decoder-ffn-embed-dim", m["d_ff"],
            "--encoder-attention-heads", m["n_heads"], "--decoder-attention-heads", m["n_heads"],
            "--dropout", m["dropout"], "--attention-dropout", m["attention_dropout"], "--activation-dropout", 0,
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9", "--clip-norm", "1.0",
            "--lr-scheduler", "inverse_sqrt", "--lr", f"{peak_lr(cfg):.8g}", "--warmup-updates", t["warmup_steps"],
            "--warmup-init-lr", 0, "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", t["label_smoothing"], "--max-tokens", t["max_tokens"], "--seed", seed, "--cpu",
            "--max-update", 1_000_000, "--save-dir", save_dir or w / "unused",
            "--save-interval-updates", args.interval, "--validate-interval-updates", args.interval,
            "--keep-interval-updates", -1, "--save-interval", 100000, "--validate-interval", 100000,
            "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", 50, "--num-workers", 1]


def qkv_args(args, seed: int, out: Path) -> list:
    return [sys.executable, "-m", "qkv", "train", "--config", CONFIG, "--data", Path(args.work) / "qkv-bin",
            "--out", out, "--threads", 1, "--seed", seed, "--eval-every", args.interval,
            "--eval-bleu-samples", 0, "--keep-last", 100000, "--max-time", 0, "--max-steps", 1_000_000]


def tree_rss_kb(pid: int) -> int:
    """Summed RSS (kB) of ``pid`` and its descendants (benchmarks/peers/fairseq/rss_tree.py's walk)."""
    from peers.fairseq.rss_tree import tree

    return tree(pid)[0]


def train(args) -> None:
    w = Path(args.work)
    run_dir = w / f"run-{args.run}"
    if run_dir.exists():
        sys.exit(f"{run_dir} exists: remove it to race again")
    run_dir.mkdir(parents=True)
    cores = {"qkv": 0, "fairseq": 1} if args.run % 2 else {"qkv": 1, "fairseq": 0}
    cmds = {"qkv": qkv_args(args, args.run, run_dir / "qkv"),
            "fairseq": [Path(args.venv) / "bin" / "fairseq-train", *fairseq_args(args, args.run, run_dir / "fairseq")]}
    env = thread_env()
    t0 = time.time()
    procs = {}
    for name, cmd in cmds.items():
        log = open(run_dir / f"{name}.log", "w")
        procs[name] = subprocess.Popen(["taskset", "-c", str(cores[name]), *map(str, cmd)], stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
    peak = {name: 0 for name in procs}
    deadline = t0 + args.minutes * 60
    while time.time() < deadline and all(p.poll() is None for p in procs.values()):
        for name, p in procs.items():
            peak[name] = max(peak[name], tree_rss_kb(p.pid))
        time.sleep(2)
    stopped = time.time() - t0
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in procs.values():
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    facts = {"run": args.run, "seed": args.run, "cores": cores, "minutes": args.minutes, "interval": args.interval,
             "started": t0, "stopped_after_s": stopped, "peak_rss_mb": {k: v / 1024 for k, v in peak.items()},
             "exit": {k: p.returncode for k, p in procs.items()},
             "commands": {k: " ".join(map(str, c)) for k, c in cmds.items()},
             "date": datetime.date.today().isoformat(), "commit": git_commit(), "machine": cpu_name(),
             "load_after": Path("/proc/loadavg").read_text().split()[:3]}
    (run_dir / "race.json").write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts, indent=1))


# --- what each run wrote -----------------------------------------------------------------------------

def checkpoints(run_dir: Path) -> dict[str, list[tuple[int, float, Path]]]:
    """(update, seconds after the start, path) of every interval checkpoint of each toolkit."""
    t0 = json.loads((run_dir / "race.json").read_text())["started"]
    out = {"qkv": [], "fairseq": []}
    for d in (run_dir / "qkv").glob("step_*"):
        model = next(d.glob("model*"), None)
        if model is not None:
            out["qkv"].append((int(d.name.split("_")[1]), model.stat().st_mtime - t0, d))
    for f in (run_dir / "fairseq").glob("checkpoint_*_*.pt"):
        out["fairseq"].append((int(f.stem.split("_")[2]), f.stat().st_mtime - t0, f))
    return {k: sorted(v) for k, v in out.items()}


def curves(run_dir: Path) -> dict:
    """Validation NLL (nats per target token) per update, and training throughput, of each toolkit."""
    rows = [json.loads(x) for x in (run_dir / "qkv" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    qkv_valid = {r["step"]: r["valid_nll"] for r in rows if "valid_nll" in r}
    qkv_tok = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1]
    fs_valid, fs_wps, fs_wpb = {}, [], []
    for line in (run_dir / "fairseq.log").read_text(errors="replace").splitlines():
        m = re.search(r"(\{.*\})\s*$", line)
        if not m:
            continue
        try:
            rec = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if "train_wpb" in rec:  # an epoch's summary: its mean target tokens per update
            fs_wpb.append(float(rec["train_wpb"]))
        if "valid_nll_loss" in rec:
            fs_valid[int(float(rec["valid_num_updates"]))] = float(rec["valid_nll_loss"]) * math.log(2)
        elif "wps" in rec and "num_updates" in rec:
            fs_wps.append(float(rec["wps"]))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    return {"qkv": {"valid_nll": qkv_valid, "tokens_per_s": mean(qkv_tok), "tokens_per_update": qkv_tokens_per_update(run_dir)},
            "fairseq": {"valid_nll": fs_valid, "tokens_per_s": mean(fs_wps), "tokens_per_update": mean(fs_wpb)}}


def qkv_tokens_per_update(run_dir: Path) -> float:
    """Target tokens (EOS included) per update of qkv's batches: the training split's over its batches."""
    import numpy as np

    from qkv.data.buckets import budget_batches

    data = run_dir.parent / "qkv-bin"
    if not (data / "train.tgt.lengths.npy").is_file():
        return float("nan")
    src, tgt = np.load(data / "train.src.lengths.npy"), np.load(data / "train.tgt.lengths.npy")
    max_tokens = recipe()["train"]["max_tokens"]
    return float(tgt.sum() + len(tgt)) / len(budget_batches(src, tgt, max_tokens, True, 1, 0))


# --- evaluate ----------------------------------------------------------------------------------------

def decode_qkv(args, ckpt: Path, out: Path, core: int, beam: int = BEAM, batch: int = 32, engine: str = "qkv"):
    cmd = ["taskset", "-c", core, sys.executable, "-m", "qkv", "translate", ckpt, "-i", Path(args.work) / "raw" / "test.en",
           "-o", out, "--beam-size", beam, "--length-norm", "length", "--length-penalty", LENPEN, "--early-stopping",
           "--max-len-a", MAX_LEN_A, "--max-len-b", MAX_LEN_B, "--batch-size", batch, "--threads", 1]
    if engine != "qkv":
        cmd += ["--engine", engine]
    return subprocess.Popen([str(c) for c in cmd], env=thread_env(), stderr=subprocess.DEVNULL)


def decode_fairseq(args, ckpt: Path, out: Path, core: int, beam: int = BEAM, batch: int = 32):
    cmd = ["taskset", "-c", core, Path(args.venv) / "bin" / "fairseq-generate", Path(args.work) / "fs-bin",
           "--path", ckpt, "--gen-subset", "test", "--beam", beam, "--lenpen", LENPEN, "--max-len-a", MAX_LEN_A,
           "--max-len-b", MAX_LEN_B, "--batch-size", batch, "--remove-bpe", "sentencepiece", "--cpu",
           "--model-overrides", "{'checkpoint_activations': True}"]
    # its "Translated N sentences ... in Ts" line is logged to stderr
    return subprocess.Popen([str(c) for c in cmd], env=thread_env(), stdout=open(out, "w"), stderr=subprocess.STDOUT)


def fairseq_hyps(path: Path) -> list[str]:
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("D-"):
            i, _, text = line[2:].split("\t", 2)
            found[int(i)] = text
    return [found[i] for i in range(len(found))]


def scores(args, hyps: list[str]) -> dict:
    from qkv.metrics import bleu, bleu_tok_lc

    refs = (Path(args.work) / "raw" / "test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs), (len(hyps), len(refs))
    return {"sacrebleu": round(bleu(hyps, refs).score, 2), "bleu_lc_moses": round(bleu_tok_lc(hyps, refs, "de").score, 2)}


FAIRSEQ_AVERAGE = """
import sys, torch
out, paths = sys.argv[1], sys.argv[2:]
states = [torch.load(p, map_location="cpu", weights_only=False) for p in paths]
avg = {k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
       for k, v in states[-1]["model"].items()}
states[-1]["model"] = avg
torch.save(states[-1], out)
"""


def average(args, run_dir: Path, ckpts: dict, n: int) -> dict[str, Path]:
    out = {"qkv": run_dir / f"qkv-average{n}", "fairseq": run_dir / f"fairseq-average{n}.pt"}
    if not out["qkv"].exists():
        sh([sys.executable, "-m", "qkv", "average", run_dir / "qkv", "--last", n, "--out", out["qkv"]], env=thread_env())
    if not out["fairseq"].exists():  # what fairseq's scripts/average_checkpoints.py does (not in its sdist)
        sh([Path(args.venv) / "bin" / "python", "-c", FAIRSEQ_AVERAGE, out["fairseq"],
            *[p for _, _, p in ckpts["fairseq"][-n:]]], env=thread_env())
    return out


def evaluate(args) -> None:
    run_dir = Path(args.work) / f"run-{args.run}"
    ckpts = checkpoints(run_dir)
    jobs = []  # (toolkit, label, checkpoint)
    for minutes in MARKS_MIN:
        for tk in ("qkv", "fairseq"):
            ready = [c for c in ckpts[tk] if c[1] <= minutes * 60]
            if ready:
                jobs.append((tk, f"{minutes} min", ready[-1][2], ready[-1][0]))
    avg = average(args, run_dir, ckpts, args.average)
    for tk in ("qkv", "fairseq"):
        jobs.append((tk, f"average of last {args.average}", avg[tk], ckpts[tk][-1][0]))
    results = []
    hyp_dir = run_dir / "hyps"
    hyp_dir.mkdir(exist_ok=True)
    pending = list(jobs)
    while pending:  # two decodes at a time, one per core
        batch, pending = pending[:2], pending[2:]
        running = []
        for core, (tk, label, ckpt, update) in enumerate(batch):
            out = hyp_dir / f"{tk}-{label.replace(' ', '_')}.txt"
            p = (decode_qkv if tk == "qkv" else decode_fairseq)(args, ckpt, out, core)
            running.append((p, tk, label, update, out))
        for p, tk, label, update, out in running:
            if p.wait() != 0:
                raise SystemExit(f"decoding {tk} {label} failed (exit {p.returncode})")
            hyps = out.read_text(encoding="utf-8").splitlines() if tk == "qkv" else fairseq_hyps(out)
            results.append({"toolkit": tk, "at": label, "update": update, **scores(args, hyps)})
            print(results[-1], flush=True)
    (run_dir / "bleu.json").write_text(json.dumps(results, indent=1))


# --- decoding speed ----------------------------------------------------------------------------------

ENGINES = ("fairseq-generate", "qkv translate", "CTranslate2 (fairseq model)", "CTranslate2 (qkv model)")


def convert_fairseq_ct2(args, ckpt: Path, out: Path) -> Path:
    """The fairseq model in CTranslate2's format, by CTranslate2's own fairseq converter."""
    if not (out / "model.bin").is_file():
        sh([Path(args.venv) / "bin" / "ct2-fairseq-converter", "--model_path", ckpt, "--data_dir",
            Path(args.work) / "fs-bin", "--source_lang", "en", "--target_lang", "de", "--output_dir", out,
            "--unsafe_deserialization", "--force"], env=thread_env(), stdout=subprocess.DEVNULL)  # its own checkpoint
    return out


def worker(args) -> None:
    """One timed decoding of the test sources in this process (qkv, or CTranslate2 on pieces); prints JSON."""
    src = (Path(args.work) / "raw" / "test.en").read_text(encoding="utf-8").splitlines()[: args.limit or None]
    if args.engine == "ct2-fairseq":
        import ctranslate2
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(Path(args.work) / "qkv-bin" / "spm.model"))
        tr = ctranslate2.Translator(args.model, device="cpu", inter_threads=1, intra_threads=1)
        pieces = sp.encode(src, out_type=str)
        order = sorted(range(len(pieces)), key=lambda i: len(pieces[i]))  # by length, as qkv and fairseq batch
        t0 = time.perf_counter()
        outs: list = [None] * len(src)
        for start in range(0, len(order), args.batch):
            idx = order[start : start + args.batch]
            longest = max(len(pieces[i]) for i in idx) + 1  # with the EOS the source ends with
            res = tr.translate_batch([pieces[i] for i in idx], beam_size=args.beam, length_penalty=LENPEN,
                                     max_decoding_length=MAX_LEN_A * longest + MAX_LEN_B)
            for i, r in zip(idx, res):
                outs[i] = sp.decode(r.hypotheses[0])
        seconds = time.perf_counter() - t0
    else:
        import torch

        import qkv

        torch.set_num_threads(1)
        model = qkv.load(args.model, engine="ctranslate2" if args.engine == "ct2-qkv" else "qkv", threads=1)
        opts = dict(beam_size=args.beam, length_norm="length", length_penalty=LENPEN, early_stopping=True,
                    max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B, batch_size=args.batch)
        model.translate(src[:8], **opts)  # warm-up (the CTranslate2 conversion is cached beside the checkpoint)
        t0 = time.perf_counter()
        outs = model.translate(src, **opts)
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "hyps": outs}))


def decode(args) -> None:
    import sentencepiece as spm

    run_dir = Path(args.work) / f"run-{args.run}"
    models = {"qkv": run_dir / f"qkv-average{args.average}", "fairseq": run_dir / f"fairseq-average{args.average}.pt"}
    ct2_fs = convert_fairseq_ct2(args, models["fairseq"], run_dir / f"fairseq-average{args.average}-ct2")
    sp = spm.SentencePieceProcessor(model_file=str(Path(args.work) / "qkv-bin" / "spm.model"))
    out_dir = run_dir / "decode"
    out_dir.mkdir(exist_ok=True)
    me = [sys.executable, Path(__file__).resolve(), "_worker", "--work", args.work, "--limit", args.limit]
    cells = []
    for beam in (1, 5):
        for batch in (32, 1):
            for engine in ENGINES:
                cells.append((engine, beam, batch))
    results = []
    for i in range(0, len(cells), 2):  # two at a time, one per core, one thread each
        running = []
        for core, (engine, beam, batch) in enumerate(cells[i : i + 2]):
            tag = f"{engine.split()[0].lower()}{'-fs' if 'fairseq model' in engine else '-qkv' if 'qkv model' in engine else ''}-beam{beam}-batch{batch}"
            log = out_dir / f"{tag}.out"
            if engine == "fairseq-generate":
                p = decode_fairseq(args, models["fairseq"], log, core, beam, batch)
            else:
                kind, model = {"qkv translate": ("qkv", models["qkv"]), "CTranslate2 (qkv model)": ("ct2-qkv", models["qkv"]),
                               "CTranslate2 (fairseq model)": ("ct2-fairseq", ct2_fs)}[engine]
                cmd = ["taskset", "-c", core, *me, "--engine", kind, "--model", model, "--beam", beam, "--batch", batch]
                p = subprocess.Popen([str(c) for c in cmd], env=thread_env(), stdout=open(log, "w"),
                                     stderr=subprocess.DEVNULL)
            running.append((p, engine, beam, batch, log))
        for p, engine, beam, batch, log in running:
            if p.wait() != 0:
                raise SystemExit(f"{engine} beam {beam} batch {batch} failed (exit {p.returncode}): {log}")
            if engine == "fairseq-generate":
                text = log.read_text(encoding="utf-8")
                hyps = fairseq_hyps(log)
                m = re.search(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s", text)
                seconds = float(m.group(3))
            else:
                rec = json.loads(log.read_text(encoding="utf-8").splitlines()[-1])
                hyps, seconds = rec["hyps"], rec["seconds"]
            tokens = sum(len(x) + 1 for x in sp.encode(hyps))  # output pieces with EOS, counted alike for all
            row = {"engine": engine, "beam": beam, "batch": batch, "sentences": len(hyps), "seconds": round(seconds, 2),
                   "sentences_per_s": round(len(hyps) / seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}
            if not args.limit:
                row.update(scores(args, hyps))
            results.append(row)
            print(row, flush=True)
    (run_dir / "decode.json").write_text(json.dumps(results, indent=1))


# --- report ----------------------------------------------------------------------------------------------

def report(args) -> None:
    """Table (Markdown), curves (docs/img/race-*.png) and JSON of every finished run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = Path(args.work)
    runs = sorted(d for d in w.glob("run-*") if (d / "bleu.json").is_file())
    if not runs:
        raise SystemExit(f"no evaluated run in {w} (train, then evaluate)")
    data = []
    for d in runs:
        race = json.loads((d / "race.json").read_text())
        last = {tk: last_checkpoint(c) for tk, c in checkpoints(d).items()}
        data.append({"run": race["run"], "race": race, "curves": curves(d), "bleu": json.loads((d / "bleu.json").read_text()),
                     "updates": {tk: u for tk, (u, _) in last.items()},
                     "last_checkpoint_s": {tk: s for tk, (_, s) in last.items()}})
    mean = lambda xs: sum(xs) / len(xs)
    tks = ("qkv", "fairseq")
    rows = []
    ups = {tk: mean([r["updates"][tk] / r["last_checkpoint_s"][tk] for r in data]) for tk in tks}
    rows.append(("updates/s (to the last checkpoint)", *(f"{ups[tk]:.3f}" for tk in tks), ups["qkv"] / ups["fairseq"]))
    tok = {tk: mean([r["updates"][tk] / r["last_checkpoint_s"][tk] * r["curves"][tk]["tokens_per_update"] for r in data])
           for tk in tks}
    rows.append(("target tokens/s (updates/s × target tokens per update)", *(f"{tok[tk]:,.0f}" for tk in tks),
                 tok["qkv"] / tok["fairseq"]))
    own = {tk: mean([r["curves"][tk]["tokens_per_s"] for r in data]) for tk in tks}
    rows.append(("target tokens/s between validations (each one's log)", *(f"{own[tk]:,.0f}" for tk in tks),
                 own["qkv"] / own["fairseq"]))
    rss = {tk: max(r["race"]["peak_rss_mb"][tk] for r in data) for tk in tks}
    rows.append(("peak RSS, MB (process tree)", *(f"{rss[tk]:,.0f}" for tk in tks), rss["qkv"] / rss["fairseq"]))
    common = sorted(set.intersection(*(set(r["curves"][tk]["valid_nll"]) for r in data for tk in tks)))
    for u in [c for c in common if c in (100, 300, 500, 1000, 1500, 2000)] + common[-1:]:
        v = {tk: mean([r["curves"][tk]["valid_nll"][u] for r in data]) for tk in tks}
        rows.append((f"validation NLL at update {u:,}, nats/token", *(f"{v[tk]:.3f}" for tk in tks), v["qkv"] - v["fairseq"]))
    labels = [b["at"] for b in data[0]["bleu"] if b["toolkit"] == "qkv"]
    for label in labels:
        for metric, name in (("sacrebleu", "sacreBLEU"), ("bleu_lc_moses", "BLEU lc tok")):
            v = {tk: mean([b[metric] for r in data for b in r["bleu"] if b["toolkit"] == tk and b["at"] == label])
                 for tk in tks}
            rows.append((f"test {name} at {label}", *(f"{v[tk]:.2f}" for tk in tks), v["qkv"] - v["fairseq"]))
    lines = [f"| ({len(data)} run{'s' if len(data) > 1 else ''}, mean) | qkv | fairseq | qkv vs fairseq |", "|---|---|---|---|"]
    for name, a, b, r in rows:
        rel = f"{r:.2f}×" if ("/s" in name or "RSS" in name) else f"{r:+.2f}"
        lines.append(f"| {name} | {a} | {b} | {rel} |")
    table = "\n".join(lines)
    print(table)
    img = ROOT / "docs" / "img"
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in data:
        for tk, color in (("qkv", "tab:blue"), ("fairseq", "tab:orange")):
            c = sorted(r["curves"][tk]["valid_nll"].items())
            ax.plot([u for u, _ in c], [v for _, v in c], color=color, marker=".", alpha=0.8,
                    linestyle="-" if r["run"] == 1 else "--", label=f"{tk}, run {r['run']}")
    ax.set_xlabel("update")
    ax.set_ylabel("validation NLL, nats per target token")
    ax.set_ylim(top=min(8, ax.get_ylim()[1]))
    ax.set_title("Multi30k En-De, same model and settings, one thread each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "race-valid-nll.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in data:
        for tk, color in (("qkv", "tab:blue"), ("fairseq", "tab:orange")):
            pts = [(int(b["at"].split()[0]), b["sacrebleu"]) for b in r["bleu"] if b["toolkit"] == tk and b["at"].endswith("min")]
            ax.plot(*zip(*pts), color=color, marker="o", linestyle="-" if r["run"] == 1 else "--", label=f"{tk}, run {r['run']}")
    ax.set_xlabel("minutes of wall clock (one thread each, both at once)")
    ax.set_ylabel("test_2016_flickr sacreBLEU (beam 5)")
    ax.set_title("BLEU against time: qkv and fairseq side by side")
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "race-bleu.png", dpi=110)
    plt.close(fig)
    decode_rows = json.loads((w / "run-1" / "decode.json").read_text()) if (w / "run-1" / "decode.json").is_file() else []
    out = {"table": table, "runs": [{k: v for k, v in r.items()} for r in data], "decoding": decode_rows,
           "date": datetime.date.today().isoformat(), "commit": git_commit(), "machine": cpu_name()}
    res = HERE / "results" / f"race-fairseq-{out['date']}.json"
    res.write_text(json.dumps(out, indent=1, default=str))
    if decode_rows:
        print("\n| engine | beam | batch | sentences/s | output tokens/s | sacreBLEU | BLEU lc tok |\n|---|---|---|---|---|---|---|")
        for d in decode_rows:
            print(f"| {d['engine']} | {d['beam']} | {d['batch']} | {d['sentences_per_s']} | {d['tokens_per_s']:,.0f} | "
                  f"{d.get('sacrebleu', '')} | {d.get('bleu_lc_moses', '')} |")
    print(f"wrote {res}, {img / 'race-valid-nll.png'}, {img / 'race-bleu.png'}")


def last_checkpoint(ckpts: list[tuple[int, float, Path]], within: float = float("inf")) -> tuple[int, float]:
    """(update, seconds after the start) of the newest of ``ckpts`` (:func:`checkpoints`) saved
    within ``within`` seconds: throughput is measured to it."""
    update, seconds, _ = max(c for c in ckpts if c[1] <= within)
    return update, seconds


def speed(args) -> None:
    """Training throughput of one run (evaluated or not) up to ``--within`` seconds: each toolkit's
    updates to its last checkpoint by then, over that checkpoint's time (the report's measure)."""
    d = Path(args.work) / f"run-{args.run}"
    ck, c = checkpoints(d), curves(d)
    within = args.within or float("inf")
    rate = {}
    for tk in ("qkv", "fairseq"):
        upd, secs = last_checkpoint(ck[tk], within)
        rate[tk] = upd / secs * c[tk]["tokens_per_update"]
        print(f"{tk}: {upd} updates in {secs:.0f} s = {upd / secs:.3f} updates/s, {rate[tk]:,.0f} target tokens/s "
              f"(its own log, the whole run: {c[tk]['tokens_per_s']:,.0f})")
    print(f"qkv vs fairseq: {rate['qkv'] / rate['fairseq']:.2f}× (its own logs: "
          f"{c['qkv']['tokens_per_s'] / c['fairseq']['tokens_per_s']:.2f}×; run {args.run}, commit "
          f"{json.loads((d / 'race.json').read_text())['commit']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("prepare", "train", "evaluate", "decode", "report", "speed", "_worker"))
    ap.add_argument("--work", default="/work/race", help="working directory (data, runs; default: %(default)s)")
    ap.add_argument("--venv", default="/tmp/fs/venv", help="fairseq's virtual environment (setup.sh)")
    ap.add_argument("--run", type=int, default=1, help="run number: its seed; odd runs put qkv on core 0, even on core 1")
    ap.add_argument("--minutes", type=float, default=60, help="wall clock of the race (default: %(default)s)")
    ap.add_argument("--interval", type=int, default=100, help="updates between validations and checkpoints")
    ap.add_argument("--average", type=int, default=5, help="checkpoints averaged at the end")
    ap.add_argument("--limit", type=int, default=0, help="decode: qkv and CTranslate2 decode only the first N test sentences "
                    "(a quick check of the workers; fairseq-generate decodes all of them; no BLEU)")
    ap.add_argument("--within", type=float, default=0, help="speed: only the checkpoints of the first S seconds (0: all)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # _worker: qkv | ct2-qkv | ct2-fairseq
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--beam", type=int, default=BEAM, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    {"prepare": prepare, "train": train, "evaluate": evaluate, "decode": decode, "report": report,
     "speed": speed, "_worker": worker}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
