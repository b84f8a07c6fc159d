"""An ensemble of Multi30k models, with its length penalty chosen on val and test decoded once.

    python benchmarks/multi30k_ensemble.py runs/m30k-ende-fairseq-tiny-bpe10k/average10 \\
        runs/m30k-ende-fairseq-tiny-bpe10k-seed2/average10 ... --threads 2 \\
        --out benchmarks/results/multi30k-en-de-ensemble.json            # val only
    python benchmarks/multi30k_ensemble.py MEMBERS... --test --out ...   # then test, once

The members (checkpoint directories that share one tokenizer, e.g. runs of one config with
different seeds) decode as one model (:func:`qkv.load_ensemble`: the mean of their next-token
distributions at each step), with beam search and the first member's saved decoding settings
(beam 5 in the Multi30k recipes). Val is decoded once per length penalty α of
``--length-penalties`` and scored in the published convention (BLEU-4 on lowercased,
Moses-tokenized text); the best α on val is kept. Only with ``--test`` is test_2016_flickr then
decoded, once, with that α; the scores go to stdout and to ``--out``.

This is an ensemble of M models, M times the parameters and decoding cost of one: it is not
comparable with a single-model result such as the published 41.02 of one small Transformer.

The sources are those the models read: ``RUN/data/SPLIT.SRC`` beside the first member for a
``--lowercase-tokenized`` run (whose output is then taken as tokenized), else the raw files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("members", nargs="+", help="checkpoint directories of the ensemble (one tokenizer)")
    ap.add_argument("--pair", default="en-de", help="SRC-TGT (default: %(default)s)")
    ap.add_argument("--data", default="../shared/data/multi30k", help="the raw Multi30k folder (default: %(default)s)")
    ap.add_argument("--length-penalties", default="0.6,1.0,1.5,2.0",
                    help="GNMT α values to choose from on val, comma-separated (default: %(default)s)")
    ap.add_argument("--test", action="store_true",
                    help="after the choice on val, decode test_2016_flickr once with the chosen α")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", help="also write the results here as JSON")
    args = ap.parse_args()

    import torch

    import qkv
    from qkv.data.corpus import read_lines
    from qkv.errors import QkvError
    from qkv.metrics import bleu_tok_lc, chrf, moses_tokenize

    if args.pair.count("-") != 1:
        ap.error(f"--pair: expected SRC-TGT, e.g. en-de, got {args.pair!r}")
    try:
        alphas = [float(a) for a in args.length_penalties.split(",")]
    except ValueError:
        ap.error(f"--length-penalties: expected numbers separated by commas, got {args.length_penalties!r}")
    src_lang, tgt_lang = args.pair.split("-")
    data = Path(args.data)
    raw = {f"{s}.{lang}": data / f"{s}.{lang}.gz" for s in ("val", "test_2016_flickr") for lang in (src_lang, tgt_lang)}
    missing = [str(p) for p in raw.values() if not p.is_file()]
    if missing:
        print(f"multi30k_ensemble: missing data files: {', '.join(missing)} (give --data)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = qkv.load_ensemble(args.members)
    except QkvError as e:
        print(f"multi30k_ensemble: {e}", file=sys.stderr)
        return 2
    local = Path(args.members[0]).parent / "data"
    tokenized = (local / f"val.{src_lang}").is_file()  # a --lowercase-tokenized run reads and writes tokenized text

    def sources(split: str) -> list[str]:
        return read_lines(local / f"{split}.{src_lang}" if tokenized else raw[f"{split}.{src_lang}"])

    result: dict = {
        "members": args.members, "pair": args.pair, "beam_size": model.decode_cfg.beam_size,
        "length_norm": model.decode_cfg.length_norm, "val_bleu_lc_moses_by_length_penalty": {},
        "val_bleu_lc_moses_summary_by_length_penalty": {},
    }
    val_src, val_ref = sources("val"), read_lines(raw[f"val.{tgt_lang}"])
    best, alpha = -1.0, alphas[0]
    for a in alphas:
        t0 = time.time()
        hyps = model.translate(val_src, length_penalty=a)
        score = bleu_tok_lc(hyps, val_ref, tgt_lang, hyps_tokenized=tokenized)
        result["val_bleu_lc_moses_by_length_penalty"][f"{a:g}"] = score.score
        result["val_bleu_lc_moses_summary_by_length_penalty"][f"{a:g}"] = score.summary
        print(f"val, alpha {a:g}: {score.summary} ({time.time() - t0:.0f} s)", flush=True)
        if score.score > best:
            best, alpha = score.score, a
    result.update({"length_penalty": alpha, "val_bleu_lc_moses": best})
    print(f"chosen on val: alpha {alpha:g}, BLEU {best:.2f}", flush=True)

    if args.test:
        refs = read_lines(raw[f"test_2016_flickr.{tgt_lang}"])
        t0 = time.time()
        hyps = model.translate(sources("test_2016_flickr"), length_penalty=alpha)
        seconds = time.time() - t0
        published = bleu_tok_lc(hyps, refs, tgt_lang, hyps_tokenized=tokenized)
        result["test"] = {
            "bleu_lc_moses": published.score, "bleu_lc_moses_signature": published.signature,
            "bleu_lc_moses_summary": published.summary,
            # both sides in the published convention's form, as the recipe computes it
            "chrf": chrf(moses_tokenize(hyps, tgt_lang, tokenized=tokenized), moses_tokenize(refs, tgt_lang)).score,
            "decode_seconds": seconds,
        }
        print(f"test_2016_flickr: {published.summary}  chrF {result['test']['chrf']:.2f}  ({seconds:.0f} s)")
    result.update({
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "threads": torch.get_num_threads(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": " ".join(["python", "benchmarks/multi30k_ensemble.py", *sys.argv[1:]]),
    })
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
