"""Forced scoring against beam search: does `qkv score` give each beam output its beam log-probability?

    python benchmarks/score_check.py MODEL --src test.en [--beam-size 5] [--nbest 5] [--limit 1000]

Decodes --src with beam search (n-best), scores every hypothesis again by forced decoding
(:func:`qkv.decoding.forced.forced_logprobs`, what `qkv score` runs) on the hypothesis' own
token ids, and reports the largest and the mean |forced - beam| log-probability difference, and
how many hypotheses agree within 1e-5. Beam search and forced decoding run the same step function
but in other batch shapes, so float32 rounding may differ slightly; ``--float64`` runs both in
float64, which leaves only a difference of method. Prints one Markdown row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory of a translation model")
    ap.add_argument("--src", required=True, help="source sentences, one a line (plain or gzip)")
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--nbest", type=int, default=5)
    ap.add_argument("--limit", type=int, default=1000, help="first N sentences (default 1000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--float64", action="store_true",
                    help="run the model in float64 for both searches: what is left is the algorithms' "
                         "difference, not float32 rounding")
    args = ap.parse_args()

    import torch

    import qkv
    from qkv.data.corpus import read_lines
    from qkv.decoding.batch import decode_sentences
    from qkv.decoding.forced import forced_logprobs

    torch.set_num_threads(args.threads)
    model = qkv.load(args.model)
    if args.float64:
        model.model.double()
    src = read_lines(args.src)[: args.limit]
    ids = model.tokenizers.src.encode(src)
    cfg = dataclasses.replace(model.decode_cfg, beam_size=args.beam_size, nbest=args.nbest)
    start = time.perf_counter()
    hyps = decode_sentences(model.model, ids, cfg)
    pairs = [(s, h) for s, nbest in zip(ids, hyps) for h in nbest]
    forced = forced_logprobs(model.model, [s for s, _ in pairs], [h.tokens for _, h in pairs])
    diffs = [abs(sum(lp) - h.logprob) for (_, h), lp in zip(pairs, forced)]
    within = sum(d <= 1e-5 for d in diffs)
    seconds = time.perf_counter() - start
    print(f"{len(src)} sentences, {len(pairs)} hypotheses (beam {args.beam_size}, n-best {args.nbest}), "
          f"{seconds:.0f} s")
    print(f"|forced - beam log-probability|: max {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}; "
          f"within 1e-5: {within} of {len(diffs)} ({100 * within / len(diffs):.2f}%)")
    from peers.common import git_commit  # torch-free helpers beside this script

    commit = git_commit()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU, {args.threads} thread(s)" + \
        (", float64" if args.float64 else ", float32")
    print(f"| {len(pairs)} | {max(diffs):.2e} | {sum(diffs) / len(diffs):.2e} | {100 * within / len(diffs):.2f}% | "
          f"{machine} | {datetime.date.today().isoformat()} | {commit} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
