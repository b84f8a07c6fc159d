"""Multi30k, one command per direction: train, average, decode test_2016_flickr once, score.

    python recipes/multi30k/run.py en-de [--data data/multi30k] [--out runs/multi30k-en-de]

Steps (each skipped when its output already exists, so an interrupted recipe continues):
0. ``qkv preprocess`` of train and val into ``OUT/data-bin`` (the tokenizer the config asks for, trained
   on the training text, and the token ids as memory-mapped arrays); the pairs dropped are those
   ``qkv train`` drops from text files (an empty side, a side over ``max_len`` tokens);
1. ``qkv train --data OUT/data-bin --config recipes/multi30k/PAIR.toml``, validating on val (settings
   are chosen on val only); ``--resume`` if the run exists;
2. ``qkv average``: the last 5 and the last 10 step checkpoints;
3. choose on val only: decode val with each candidate (best, last, average of 5, average of 10)
   and each length penalty α of ``--length-penalties``, and keep the pair with the highest val
   sacreBLEU (with ``--val-only`` the recipe stops here and writes ``OUT/val_choice.json``: compare
   settings, e.g. the configs of ``recipes/multi30k/tuning/``, on val, then run the winner without it);
4. decode test_2016_flickr once, with that model and α, and the config's beam (5);
5. score: sacreBLEU (cased, detokenized, 13a), BLEU-4 on lowercased, normalized, Moses-tokenized
   text (the published convention: ``qkv.metrics.moses_tokenize``), chrF; write ``OUT/scores.json``,
   ``OUT/test.hyp`` and ``OUT/valid_curve.png`` (validation BLEU and loss against steps), and print
   a Markdown row for docs/results.md.

``--length-norm length --early-stopping`` decodes as fairseq does (lp = |Y|^α, a sentence done once
``beam_size`` hypotheses have ended; α 1 is fairseq's default ``--lenpen``). A search other than the
default writes its own files (``val_choice-length-early.json``, ``test-length-early.hyp``,
``scores-length-early.json``), so those of the default search are kept.

``--lowercase-tokenized`` trains on lowercased, Moses-tokenized text instead of raw cased text, as the
published Multi30k systems did (``tokenize_for_training``: ``-a``, hyphens split as ``@-@``; written
once to ``OUT/data/``; the raw files are not changed). Its output is lowercased and tokenized, so it
is chosen on val and scored on test in the published convention only (BLEU-4 and chrF, both on
text brought to that convention's form); it has no cased sacreBLEU. Runs without the flag also
record the val score in the published convention, so that the two kinds of run can be compared
on val.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fetch import data_dir  # noqa: E402 (recipes/fetch.py)

HERE = Path(__file__).resolve().parent
PAIRS = ("en-de", "en-fr", "de-en", "en-cs")


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def plot_curve(metrics: Path, png: Path, title: str, lowercase_tokenized: bool = False) -> None:
    """Validation BLEU (greedy, sample) and loss against steps, from the run's metrics.jsonl.
    ``lowercase_tokenized``: the run's val sample is lowercased, Moses-tokenized text, and the axis says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    valid = [r for r in rows if "valid_loss" in r]
    steps = [r["step"] for r in valid]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(steps, [r.get("valid_bleu", float("nan")) for r in valid], "o-", color="tab:blue", label="valid BLEU")
    ax1.set_xlabel("update step")
    ylabel = "BLEU (greedy, lc tokenized val sample)" if lowercase_tokenized else "BLEU (sacreBLEU, greedy, val sample)"
    ax1.set_ylabel(ylabel, color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(steps, [r["valid_loss"] for r in valid], "s--", color="tab:red", label="valid loss")
    ax2.set_ylabel("loss per token (the training criterion)", color="tab:red")  # label-smoothed if ε > 0
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def averaged_from(path: Path) -> list[str]:
    """The names of the step checkpoints an averaged checkpoint was made from (its config.json)."""
    try:
        return [Path(p).name for p in json.loads((path / "config.json").read_text(encoding="utf-8"))["averaged_from"]]
    except (OSError, ValueError, KeyError):
        return []


def tokenize_for_training(lines: list[str], lang: str) -> list[str]:
    """The text ``--lowercase-tokenized`` trains on: ``tokenizer.perl -l LANG -a -no-escape``, then
    lowercased (through sacremoses). Hyphens are split off as ``@-@`` (``-a``), as fairseq's WMT
    preparation does; the scoring (``qkv.metrics.moses_tokenize``) merges them back, since the
    published Multi30k scores are computed on text tokenized without ``-a``."""
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, aggressive_dash_splits=True, escape=False, return_str=True).lower() for line in lines]


def prepare_lowercase_tokenized(files: dict[str, Path], folder: Path) -> dict[str, Path]:
    """Write each file lowercased and Moses-tokenized (:func:`tokenize_for_training`) to
    ``folder/NAME``, once; return the new paths. A file is written under a temporary name and
    renamed when complete, so an interrupted run leaves no half file."""
    from qkv.data.corpus import read_lines

    folder.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for name, path in files.items():
        target = folder / name
        if not target.exists():
            lines = tokenize_for_training(read_lines(path), name.rsplit(".", 1)[1])
            partial = target.with_name(target.name + ".partial")
            partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            partial.replace(target)
            print(f"wrote {target} ({len(lines)} lines, lowercased and Moses-tokenized from {path})",
                  file=sys.stderr, flush=True)
        prepared[name] = target
    return prepared


def preprocess_command(qkv: list[str], config: str, files: dict[str, Path], src: str, tgt: str, out: Path,
                       tokenizer_from: str | None) -> list[str]:
    """``qkv preprocess`` with the tokenizer and ``max_len`` of the config's [train] table (or its
    defaults), keeping every pair ``qkv train`` would keep from the text files."""
    from qkv.config import TrainConfig, load_toml

    t = {**{k: getattr(TrainConfig(), k) for k in ("tokenizer", "vocab_size", "joint_vocab", "max_len")},
         **load_toml(config).get("train", {})}
    cmd = qkv + ["preprocess", "--src-train", str(files[f"train.{src}"]), "--tgt-train", str(files[f"train.{tgt}"]),
                 "--src-valid", str(files[f"val.{src}"]), "--tgt-valid", str(files[f"val.{tgt}"]),
                 "--max-len", str(t["max_len"]), "--max-ratio", "0", "--keep-identical", "--out", str(out)]
    if tokenizer_from:
        return cmd + ["--tokenizer-from", tokenizer_from]
    return cmd + ["--tokenizer", t["tokenizer"], "--vocab-size", str(t["vocab_size"])] + \
        ([] if t["joint_vocab"] else ["--separate-vocab"])


def run_facts(out: Path, translator) -> dict:
    """Parameters, training seconds (all resumed parts) and mean training tokens/s of the run in ``out``."""
    import torch

    state = torch.load(out / "last" / "trainer_state.pt", map_location="cpu", weights_only=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tok_s = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1]
    valid = [r for r in rows if "valid_loss" in r]
    return {
        "arch": translator.model.cfg.arch,
        # the alignment score of a recurrent model with attention (a Transformer has none to name)
        "attention": None if translator.model.cfg.arch == "transformer" else translator.model.cfg.attention,
        "parameters": sum(p.numel() for p in translator.model.parameters()),
        "train_seconds": float(state["elapsed"]),
        "steps": int(state["step"]),
        "epochs": int(state["epoch"]),
        "train_tokens_per_s": sum(tok_s) / len(tok_s) if tok_s else None,
        "valid_curve": [[r["step"], round(r["valid_loss"], 4), round(r.get("valid_bleu", float("nan")), 2)]
                        for r in valid],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", choices=PAIRS, help="translation direction")
    ap.add_argument("--data", default=str(data_dir("multi30k")),
                    help="folder with {train,val,test_2016_flickr}.LANG.gz "
                         "(default: data/multi30k in the clone, where fetch.py writes, or ../shared/data/multi30k "
                         "beside it where only that is present: %(default)s)")
    ap.add_argument("--out", help="run directory (default: runs/multi30k-PAIR)")
    ap.add_argument("--config", help="config file (default: recipes/multi30k/PAIR.toml)")
    ap.add_argument("--average", type=int, default=10, help="also try the average of the newest N step checkpoints")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--max-time", type=float, default=None,
                    help="cap training at this many seconds (cumulative over resumes), instead of the config's max_time")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="cap training at this many updates, instead of the config's max_steps; with --max-time 0 "
                         "a run trains exactly as many updates on any machine (docs/results.md gives each row's count)")
    ap.add_argument("--select", choices=("val-bleu", "best"), default="val-bleu",
                    help="val-bleu: decode val with each candidate checkpoint and keep the best (step 3); best: "
                         "take OUT/best (lowest validation loss) without decoding val (saves time on slow models)")
    ap.add_argument("--length-penalties", default="0.6,1.0,1.5,2.0",
                    help="comma-separated α values of the length penalty ((5+|Y|)/6)^α tried on val with each "
                         "candidate checkpoint (default: %(default)s; one value: no search)")
    ap.add_argument("--length-norm", choices=("gnmt", "length"), default="gnmt",
                    help="the length normalisation of beam search: gnmt, lp = ((5+|Y|)/6)^α (the paper's), or length, "
                         "lp = |Y|^α (fairseq's --lenpen); with --early-stopping and α 1, fairseq's default decoding")
    ap.add_argument("--early-stopping", action="store_true",
                    help="end each sentence's beam search once beam_size hypotheses have ended (fairseq's rule) "
                         "instead of when no live hypothesis can beat them")
    ap.add_argument("--val-only", action="store_true",
                    help="stop after step 3: write OUT/val_choice.json (the val scores of every candidate and "
                         "alpha, and the choice) and leave test_2016_flickr untouched; for comparing settings "
                         "on val before the one test decoding of the final model")
    ap.add_argument("--lowercase-tokenized", action="store_true",
                    help="train and decode on lowercased, Moses-tokenized text (tokenizer.perl -a -no-escape, then "
                         "lowercase, as the published systems trained on tokenized text), written to OUT/data/; "
                         "choose on val and score test in the published convention only (no cased sacreBLEU for "
                         "such a model)")
    ap.add_argument("--tokenizer-from", help="reuse this checkpoint's (or .model file's) subword model instead of "
                                             "training one, e.g. the Transformer run's, to compare on one vocabulary")
    args = ap.parse_args()
    try:
        alphas = [float(a) for a in args.length_penalties.split(",")]
    except ValueError:
        ap.error(f"--length-penalties: expected comma-separated numbers, got {args.length_penalties!r}")
    if not alphas or any(a < 0 for a in alphas):
        ap.error(f"--length-penalties: expected numbers >= 0, got {args.length_penalties!r}")
    if args.max_steps is not None and args.max_steps <= 0:
        ap.error(f"--max-steps: expected a positive number of updates, got {args.max_steps}")
    if args.max_time is not None and args.max_time < 0:
        ap.error(f"--max-time: expected seconds >= 0 (0: no limit), got {args.max_time:g}")

    src, tgt = args.pair.split("-")
    data = Path(args.data)
    files = {f"{split}.{lang}": data / f"{split}.{lang}.gz"
             for split in ("train", "val") + (() if args.val_only else ("test_2016_flickr",))
             for lang in (src, tgt)}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        print(f"multi30k recipe: missing data files: {', '.join(missing)} (give --data)", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/multi30k-{args.pair}")
    config = args.config or str(HERE / f"{args.pair}.toml")
    raw = dict(files)  # references are always read from the raw files
    if args.lowercase_tokenized:
        files = prepare_lowercase_tokenized(files, out / "data")
    qkv = [sys.executable, "-m", "qkv"]
    search = {"length_norm": args.length_norm, "early_stopping": args.early_stopping}  # beam search options
    # val_choice.json, test.hyp, scores.json for the default search; another search writes its own
    # files beside them (e.g. scores-length-early.json), so that neither overwrites the other's
    suffix = ("" if search == {"length_norm": "gnmt", "early_stopping": False} else
              f"-{args.length_norm}{'-early' if args.early_stopping else ''}")
    choice_file = out / f"val_choice{suffix}.json"

    started = time.time()
    binarized = out / "data-bin"
    if not (binarized / "manifest.json").is_file():
        run(preprocess_command(qkv, config, files, src, tgt, binarized, args.tokenizer_from))
    train = qkv + ["train", "--config", config, "--out", str(out), "--data", str(binarized)]
    if args.threads:
        train += ["--threads", str(args.threads)]
    if args.max_time is not None:
        train += ["--max-time", str(args.max_time)]
    if args.max_steps is not None:
        train += ["--max-steps", str(args.max_steps)]
    if (out / "last").exists():
        train += ["--resume"]
    run(train)
    train_seconds = time.time() - started

    import torch

    import qkv as qkv_lib
    from qkv.data.corpus import read_lines
    from qkv.metrics import bleu, bleu_tok_lc, chrf, moses_tokenize
    from qkv.checkpoint import list_checkpoints

    if args.threads:
        torch.set_num_threads(args.threads)
    candidates = {"best": out / "best", "last": out / "last"}
    if args.select == "best":
        candidates = {"best": out / "best"}
    steps = list_checkpoints(out) if args.select == "val-bleu" else []
    for n in sorted({min(5, len(steps)), min(args.average, len(steps))} - {0, 1}):
        averaged = out / f"average{n}"
        if averaged.exists() and averaged_from(averaged) != [p.name for p in steps[-n:]]:
            shutil.rmtree(averaged)  # made before the run was resumed: not the newest n any more
        if not averaged.exists():
            run(qkv + ["average", str(out), "--last", str(n), "--out", str(averaged)])
        candidates[f"average of the last {n}"] = averaged
    val_src, val_ref = read_lines(files[f"val.{src}"]), read_lines(raw[f"val.{tgt}"])
    lc = args.lowercase_tokenized
    metric_name = "BLEU, lc Moses-tok" if lc else "sacreBLEU"
    # candidate -> {alpha: val score}: sacreBLEU, or (--lowercase-tokenized) the published convention
    val_scores: dict[str, dict[str, float]] = {}
    val_lc_scores: dict[str, dict[str, float]] = {}  # candidate -> {alpha: val BLEU in the published convention}
    val_lc_summaries: dict[str, dict[str, str]] = {}  # the same with precisions, brevity penalty, length ratio
    best_val, chosen, alpha = -1.0, "best", alphas[0]  # without a search: best/ and the only alpha
    for name, path in candidates.items() if len(candidates) * len(alphas) > 1 else ():
        model = qkv_lib.load(path)
        val_scores[name] = {}
        for a in alphas:
            hyps = model.translate(val_src, length_penalty=a, **search)
            published_val = bleu_tok_lc(hyps, val_ref, tgt, hyps_tokenized=lc)
            score_lc = published_val.score
            val_lc_summaries.setdefault(name, {})[f"{a:g}"] = published_val.summary
            score = score_lc if lc else bleu(hyps, val_ref).score
            val_scores[name][f"{a:g}"] = score
            val_lc_scores.setdefault(name, {})[f"{a:g}"] = score_lc
            print(f"val {metric_name} of {name} ({path}), alpha {a:g}: {score:.2f}"
                  + ("" if lc else f" (lc Moses-tok {score_lc:.2f})"), file=sys.stderr, flush=True)
            if score > best_val:
                best_val, chosen, alpha = score, name, a

    provenance = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": " ".join(["python", "recipes/multi30k/run.py", *sys.argv[1:]]),
    }
    if args.val_only:
        choice = {"pair": args.pair, "config": config, "lowercase_tokenized": lc, "chosen_on_val": chosen,
                  "path": str(candidates[chosen]), "length_penalty": alpha, **search,
                  "val_sacrebleu": None if lc else (best_val if val_scores else None),
                  "val_sacrebleu_by_length_penalty": {} if lc else val_scores,
                  "val_bleu_lc_moses": val_lc_scores[chosen][f"{alpha:g}"] if val_scores else None,
                  "val_bleu_lc_moses_by_length_penalty": val_lc_scores,
                  "val_bleu_lc_moses_summary_by_length_penalty": val_lc_summaries,
                  **run_facts(out, qkv_lib.load(candidates[chosen])), **provenance}
        choice_file.write_text(json.dumps(choice, indent=2), encoding="utf-8")
        scored = f", val {metric_name} {best_val:.2f}" if val_scores else " (nothing to choose between: not decoded)"
        print(f"val only: {chosen} at alpha {alpha:g}{scored}; test_2016_flickr not decoded ({choice_file})")
        return 0

    sources, refs = read_lines(files[f"test_2016_flickr.{src}"]), read_lines(raw[f"test_2016_flickr.{tgt}"])
    model = qkv_lib.load(candidates[chosen])
    t0 = time.time()
    hyps = model.translate(sources, length_penalty=alpha, **search)
    decode_seconds = time.time() - t0
    (out / f"test{suffix}.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    published = bleu_tok_lc(hyps, refs, tgt, hyps_tokenized=lc)
    scores = {
        "pair": args.pair,
        "lowercase_tokenized": lc,
        # a model that writes lowercased tokenized text has no cased, detokenized score
        "bleu_sacrebleu": None if lc else bleu(hyps, refs).score,
        "bleu_sacrebleu_signature": None if lc else bleu(hyps, refs).signature,
        "bleu_lc_moses": published.score,
        "bleu_lc_moses_signature": published.signature,
        "bleu_lc_moses_summary": published.summary,  # precisions, brevity penalty, length ratio
        # chrF of the cased raw text, or (--lowercase-tokenized) of both sides in the published
        # convention's form (lowercased, normalized, tokenized without -a: qkv.metrics.moses_tokenize)
        "chrf": (chrf(moses_tokenize(hyps, tgt, tokenized=True), moses_tokenize(refs, tgt)) if lc
                 else chrf(hyps, refs)).score,
        "decode": {"beam_size": model.decode_cfg.beam_size, "length_penalty": alpha, **search,
                   "length_penalty_chosen_on_val_from": alphas, "seconds": decode_seconds},
        "model": {"chosen_on_val": chosen, "path": str(candidates[chosen]),
                  "val_sacrebleu_by_length_penalty": {} if lc else val_scores,
                  "val_bleu_lc_moses_by_length_penalty": val_lc_scores,
                  "val_bleu_lc_moses_summary_by_length_penalty": val_lc_summaries},
        "train_seconds_this_invocation": train_seconds,
        **run_facts(out, model),
        **provenance,
    }
    (out / f"scores{suffix}.json").write_text(json.dumps(scores, indent=2), encoding="utf-8")
    try:
        title = f"Multi30k {args.pair}{' (lowercased, Moses-tokenized)' if lc else ''}: validation"
        plot_curve(out / "metrics.jsonl", out / "valid_curve.png", title, lc)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    cased = "n/a (lowercased model)" if lc else f"{scores['bleu_sacrebleu']:.2f}"
    print(f"| {args.pair} | {scores['bleu_lc_moses']:.2f} | {cased} | {scores['chrf']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
