"""Real (non-padding) tokens per update from a recipe's batching, against the paper's 25,000 + 25,000.

    python benchmarks/update_tokens.py --config recipes/wmt14/big.toml --processes 8 --update-freq 1 \
        --synthetic 2000000
    python benchmarks/update_tokens.py --config recipes/wmt14/big.toml --processes 8 \
        --multi30k /work/shared/data/multi30k --tokenizer-from RUN/best

Cuts one epoch into batches exactly as ``qkv train`` does: the recipe's ``update_tokens`` shared out
over ``processes x update_freq`` batches (:func:`qkv.config.per_process_batch`), each batch cut by
:func:`qkv.data.buckets.budget_batches` with the recipe's seed, pairs longer than ``max_len`` skipped as
training skips them, and an update the ``processes x update_freq`` consecutive batches of the epoch's
order (:meth:`qkv.training.trainer.Trainer._groups`). Counts per update, per side: the real tokens the
model reads (source pieces + EOS; target pieces + EOS, the tokens the loss predicts) and the padded
size. The epoch's last update (a partial group) is left out.

The pairs' lengths (in pieces, without EOS):

* ``--synthetic N``: N length pairs drawn (seeded) from an assumed WMT-like distribution, not measured on
  WMT: source length log-normal with median 24 and sigma 0.6 (mean about 29 pieces), target = source x a
  log-normal ratio (median 1.08, sigma 0.15), both at least 1;
* ``--multi30k DIR``: Multi30k's train.en.gz / train.de.gz (29,000 pairs) tokenized with the
  SentencePiece model of ``--tokenizer-from`` (a stand-in with real sentences, much shorter than WMT's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np


def synthetic_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = np.maximum(1, np.rint(rng.lognormal(np.log(24.0), 0.6, n))).astype(np.int64)
    tgt = np.maximum(1, np.rint(src * rng.lognormal(np.log(1.08), 0.15, n))).astype(np.int64)
    return src, tgt


def multi30k_lengths(folder: str, tokenizer_from: str) -> tuple[np.ndarray, np.ndarray]:
    from qkv.data.corpus import read_lines
    from qkv.data.tokenizer import TokenizerPair

    tok = TokenizerPair.load(tokenizer_from)
    src = tok.src.encode(read_lines(f"{folder}/train.en.gz"))
    tgt = tok.tgt.encode(read_lines(f"{folder}/train.de.gz"))
    return np.array([len(s) for s in src]), np.array([len(t) for t in tgt])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a recipe's TOML (its update_tokens, max_len, seed)")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--update-freq", type=int, default=1)
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic WMT-like length pairs")
    ap.add_argument("--multi30k", default="", help="the Multi30k folder (train.en.gz, train.de.gz)")
    ap.add_argument("--tokenizer-from", default="", help="with --multi30k: a checkpoint whose SentencePiece to use")
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic lengths")
    args = ap.parse_args()

    from dataclasses import replace

    from qkv.cli import resolve_configs
    from qkv.config import per_process_batch
    from qkv.data.buckets import budget_batches

    _, train, _ = resolve_configs(argparse.Namespace(config=args.config, preset=None))
    train = per_process_batch(replace(train, update_freq=args.update_freq), args.processes)
    if args.synthetic:
        src, tgt = synthetic_lengths(args.synthetic, args.seed)
        sample = f"{args.synthetic:,} synthetic WMT-like length pairs (seed {args.seed})"
    elif args.multi30k:
        src, tgt = multi30k_lengths(args.multi30k, args.tokenizer_from)
        sample = f"Multi30k train ({len(src):,} pairs, pieces of {args.tokenizer_from})"
    else:
        ap.error("give --synthetic N or --multi30k DIR --tokenizer-from CKPT")
    keep = (src <= train.max_len) & (tgt <= train.max_len)
    src, tgt = src[keep], tgt[keep]
    plan = budget_batches(src, tgt, train.max_tokens, shuffle=True, seed=train.seed, epoch=0)
    size = args.processes * args.update_freq
    s_real, t_real, s_pad, t_pad = [], [], [], []
    for start in range(0, len(plan) - size + 1, size):
        batches = [np.array(plan[b]) for b in range(start, start + size)]
        s_real.append(sum(int((src[b] + 1).sum()) for b in batches))
        t_real.append(sum(int((tgt[b] + 1).sum()) for b in batches))
        s_pad.append(sum(len(b) * int(src[b].max() + 1) for b in batches))
        t_pad.append(sum(len(b) * int(tgt[b].max() + 1) for b in batches))

    def describe(xs):
        return {"mean": round(statistics.fmean(xs)), "median": round(statistics.median(xs)), "min": min(xs),
                "max": max(xs)}

    out = {"config": args.config, "sample": sample, "pairs": int(len(src)), "processes": args.processes,
           "update_freq": args.update_freq, "update_tokens": train.update_tokens,
           "max_tokens_per_batch": train.max_tokens, "updates": len(s_real),
           "source_real": describe(s_real), "target_real": describe(t_real),
           "source_padded": describe(s_pad), "target_padded": describe(t_pad)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
