"""How long a Multi30k model's output is against the references, on val, for several beam searches.

    python benchmarks/multi30k_lengths.py runs/m30k-ende-fairseq-tiny/average10 \
        --search gnmt:2.0 --search length-early:1.0 --out benchmarks/results/lengths.json

For the checkpoint, decode the val sources once per ``--search`` (``gnmt:ALPHA``, ``length:ALPHA``,
``gnmt-early:ALPHA`` or ``length-early:ALPHA``: the length normalisation, fairseq's early stopping
or not, and α) and print the BLEU-4 of the published convention with its precisions, brevity
penalty and length ratio. Test is never decoded here. It also prints, for val and
test_2016_flickr, the reference tokens per source token in that convention: a property of the
data alone, which says how much longer or shorter the references of one split are than those of
the other for sources of the same length.

The sources are those the model reads: ``OUT/data/val.SRC`` beside the checkpoint for a
``--lowercase-tokenized`` run (whose output is then taken as tokenized), else the raw ``val.SRC.gz``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_search(text: str) -> dict:
    try:
        kind, alpha = text.split(":")
        norm, _, early = kind.partition("-")
        if norm not in ("gnmt", "length") or early not in ("", "early"):
            raise ValueError
        return {"length_norm": norm, "early_stopping": early == "early", "length_penalty": float(alpha)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected gnmt:ALPHA, length:ALPHA, gnmt-early:ALPHA or length-early:ALPHA, got {text!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory (e.g. runs/m30k-ende-fairseq-tiny/average10)")
    ap.add_argument("--pair", default="en-de", help="SRC-TGT (default: %(default)s)")
    ap.add_argument("--data", default="../shared/data/multi30k", help="the raw Multi30k folder (default: %(default)s)")
    ap.add_argument("--search", type=parse_search, action="append", required=True,
                    help="a beam search to try, as NORM[-early]:ALPHA (repeatable), e.g. gnmt:2.0, length-early:1.0")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", help="also write the results here as JSON")
    args = ap.parse_args()

    import torch

    import qkv
    from qkv.data.corpus import read_lines
    from qkv.errors import QkvError
    from qkv.metrics import bleu_tok_lc, moses_tokenize

    if args.pair.count("-") != 1:
        ap.error(f"--pair: expected SRC-TGT, e.g. en-de, got {args.pair!r}")
    src_lang, tgt_lang = args.pair.split("-")
    data = Path(args.data)
    raw = {f"{s}.{lang}": data / f"{s}.{lang}.gz" for s in ("val", "test_2016_flickr") for lang in (src_lang, tgt_lang)}
    missing = [str(p) for p in raw.values() if not p.is_file()]
    if missing:
        print(f"multi30k_lengths: missing data files: {', '.join(missing)} (give --data)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = qkv.load(args.model)
    except QkvError as e:
        print(f"multi30k_lengths: {e}", file=sys.stderr)
        return 2

    result: dict = {"model": args.model, "pair": args.pair, "references_per_source_token": {}, "val": []}
    for split in ("val", "test_2016_flickr"):
        n_src = sum(len(s.split()) for s in moses_tokenize(read_lines(raw[f"{split}.{src_lang}"]), src_lang))
        n_ref = sum(len(s.split()) for s in moses_tokenize(read_lines(raw[f"{split}.{tgt_lang}"]), tgt_lang))
        result["references_per_source_token"][split] = {"source_tokens": n_src, "reference_tokens": n_ref,
                                                         "ratio": n_ref / n_src}
        print(f"{split}: {n_ref} reference tokens / {n_src} source tokens = {n_ref / n_src:.4f}")

    local = Path(args.model).parent / "data" / f"val.{src_lang}"
    tokenized = local.is_file()  # a --lowercase-tokenized run: it reads and writes tokenized text
    src_file = local if tokenized else raw[f"val.{src_lang}"]
    sources, refs = read_lines(src_file), read_lines(raw[f"val.{tgt_lang}"])
    for search in args.search:
        hyps = model.translate(sources, **search)
        score = bleu_tok_lc(hyps, refs, tgt_lang, hyps_tokenized=tokenized)
        result["val"].append({**search, "bleu_lc_moses": score.score, "summary": score.summary})
        print(f"val, {search}: {score.summary}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
