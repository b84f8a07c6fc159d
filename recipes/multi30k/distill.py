"""Sequence-level knowledge distillation data for Multi30k (Kim and Rush, 2016).

    python recipes/multi30k/distill.py TEACHER [TEACHER ...] --pair en-de --length-penalty 2.0 \\
        --out runs/m30k-ende-distilled-data --threads 2

The teacher (one checkpoint, or several sharing one tokenizer, decoded as an ensemble: the mean
of their next-token distributions, :func:`qkv.load_ensemble`) translates every training source
with beam search (its saved beam size; ``--length-penalty``: the GNMT α, chosen on val, e.g. by
``benchmarks/multi30k_ensemble.py``). ``OUT`` becomes a Multi30k data folder for
``recipes/multi30k/run.py --data OUT``: the training targets are the teacher's translations, the
sources and the val and test_2016_flickr files are copies of the raw ones. A student trained on it
learns to imitate the teacher's output instead of the references; val and test are the real ones.

The sources are those the teacher reads: ``RUN/data/train.SRC`` beside the first checkpoint for a
``--lowercase-tokenized`` run, whose output is then tokenized text; it is detokenized (``@-@``
merged back) so that the folder holds raw-form text like the original, which the recipe's
``--lowercase-tokenized`` tokenizes again. Translation goes a chunk at a time into
``OUT/train.TGT.partial``: an interrupted run continues where it stopped, and the final
``train.TGT.gz`` appears only when every line is done.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fetch import data_dir  # noqa: E402 (recipes/fetch.py)

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("teachers", nargs="+", help="checkpoint directories of the teacher (several: an ensemble)")
    ap.add_argument("--pair", default="en-de", help="SRC-TGT (default: %(default)s)")
    ap.add_argument("--data", default=str(data_dir("multi30k")),
                    help="the raw Multi30k folder "
                         "(default: data/multi30k in the clone, where fetch.py writes, or ../shared/data/multi30k "
                         "beside it where only that is present: %(default)s)")
    ap.add_argument("--length-penalty", type=float, required=True,
                    help="GNMT α of the teacher's beam search (choose it on val)")
    ap.add_argument("--chunk", type=int, default=1000, help="lines translated between progress lines and saves "
                                                           "(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", required=True, help="the new data folder")
    args = ap.parse_args()
    if args.pair.count("-") != 1:
        ap.error(f"--pair: expected SRC-TGT, e.g. en-de, got {args.pair!r}")
    if args.length_penalty < 0:
        ap.error(f"--length-penalty: expected a number >= 0, got {args.length_penalty:g}")
    if args.chunk <= 0:
        ap.error(f"--chunk: expected a positive number of lines, got {args.chunk}")

    import torch

    import qkv
    from qkv.data.corpus import read_lines
    from qkv.errors import QkvError
    from qkv.metrics import moses_detokenize

    src_lang, tgt_lang = args.pair.split("-")
    data, out = Path(args.data), Path(args.out)
    raw = {f"{s}.{lang}.gz": data / f"{s}.{lang}.gz" for s in ("train", "val", "test_2016_flickr")
           for lang in (src_lang, tgt_lang)}
    missing = [str(p) for p in raw.values() if not p.is_file()]
    if missing:
        print(f"distill: missing data files: {', '.join(missing)} (give --data)", file=sys.stderr)
        return 2
    target = out / f"train.{tgt_lang}.gz"
    if target.exists():
        print(f"distill: {target} exists already; nothing to do", file=sys.stderr)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        teacher = qkv.load_ensemble(args.teachers)
        local = Path(args.teachers[0]).parent / "data" / f"train.{src_lang}"
        tokenized = local.is_file()  # the teacher reads and writes lowercased, tokenized text
        sources = read_lines(local if tokenized else raw[f"train.{src_lang}.gz"])
    except QkvError as e:
        print(f"distill: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name, path in raw.items():  # the real sources, val and test, unchanged
        if name != target.name and not (out / name).exists():
            shutil.copyfile(path, out / name)

    partial = out / f"train.{tgt_lang}.partial"
    done = len(partial.read_text(encoding="utf-8").splitlines()) if partial.exists() else 0
    if done:
        print(f"distill: continuing after {done} lines already in {partial}", file=sys.stderr, flush=True)
    started = time.time()
    with open(partial, "a", encoding="utf-8") as fh:
        for start in range(done, len(sources), args.chunk):
            chunk = sources[start : start + args.chunk]
            fh.write("".join(h + "\n" for h in teacher.translate(chunk, length_penalty=args.length_penalty)))
            fh.flush()
            n = start + len(chunk)
            rate = (n - done) / (time.time() - started)
            print(f"distill: {n}/{len(sources)} lines ({rate:.1f} lines/s, about "
                  f"{(len(sources) - n) / rate / 60:.0f} min left)", file=sys.stderr, flush=True)
    hyps = partial.read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(sources):
        print(f"distill: {partial} has {len(hyps)} lines for {len(sources)} sources; delete it and run again",
              file=sys.stderr)
        return 2
    if tokenized:  # back to raw form, as the original targets are (the recipe tokenizes it again)
        hyps = moses_detokenize(hyps, tgt_lang)
    tmp = target.with_name(target.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        fh.write("".join(h + "\n" for h in hyps))
    tmp.replace(target)
    partial.unlink()
    (out / "distill.json").write_text(json.dumps({
        "teachers": args.teachers, "pair": args.pair, "length_penalty": args.length_penalty,
        "beam_size": teacher.decode_cfg.beam_size, "lines": len(hyps), "seconds_this_invocation": time.time() - started,
        "command": " ".join(["python", "recipes/multi30k/distill.py", *sys.argv[1:]]),
    }, indent=2), encoding="utf-8")
    print(f"distill: wrote {target} ({len(hyps)} lines); train a student with "
          f"python recipes/multi30k/run.py {args.pair} --data {out} ...", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
