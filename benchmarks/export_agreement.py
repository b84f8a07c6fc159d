"""Does the Hugging Face export decode as qkv does? Greedy outputs and teacher-forced logits.

    python benchmarks/export_agreement.py MODEL --src test.en [--n 1000] [--threads 1]

Exports MODEL with ``qkv export --format hf`` into a temporary directory, loads it with
``transformers.MarianMTModel`` and ``MarianTokenizer``, and compares with qkv on the first N
source lines: greedy ``generate`` (one length limit for all, the largest of qkv's per-sentence
limits, given to both) against ``qkv translate --beam-size 1``, line by line; and the logits of
a teacher-forced batch (the first 32 sources with qkv's greedy outputs as targets), max |Δ|.
Prints one Markdown row for docs/results.md. Needs ``pip install -c constraints.txt -e ".[export]"``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory of a translation model")
    ap.add_argument("--src", required=True, help="source sentences, one a line (plain or gzip)")
    ap.add_argument("--n", type=int, default=1000, help="first N sentences (default 1000)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from transformers import MarianMTModel, MarianTokenizer

    import qkv
    from qkv.data.batching import collate
    from qkv.data.corpus import read_lines
    from qkv.decoding.greedy import max_output_len
    from qkv.export import export

    torch.set_num_threads(args.threads)
    model = qkv.load(args.model)
    src = [s for s in read_lines(args.src)[: args.n] if s.strip()]
    src_len = torch.tensor([len(ids) + 1 for ids in model.tokenizers.src.encode(src)])
    limit = int(max_output_len(src_len, model.decode_cfg.max_len_a, model.decode_cfg.max_len_b).max())
    ours = model.translate(src, beam_size=1, max_len_a=0.0, max_len_b=limit)
    with tempfile.TemporaryDirectory() as tmp:
        export(args.model, "hf", os.path.join(tmp, "hf"))
        hf = MarianMTModel.from_pretrained(os.path.join(tmp, "hf")).eval()
        tok = MarianTokenizer.from_pretrained(os.path.join(tmp, "hf"))
    theirs = []
    with torch.inference_mode():
        for start in range(0, len(src), 32):
            batch = tok(src[start : start + 32], return_tensors="pt", padding=True)
            out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=limit + 1)
            theirs += tok.batch_decode(out, skip_special_tokens=True)
        # teacher-forced logits on one batch: qkv's own model against the export
        src_ids = model.tokenizers.src.encode(src[:32])
        tgt_ids = model.tokenizers.tgt.encode(ours[:32])
        b = collate(src_ids, tgt_ids)
        ref = model.model(b.src, b.tgt_in).float()
        got = hf(input_ids=b.src, attention_mask=(b.src != 0).long(), decoder_input_ids=b.tgt_in).logits.float()
        real = (b.tgt_in != 0).unsqueeze(-1)
        real[:, 0] = True  # BOS
        delta = float(((ref - got).abs() * real).max())
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy: {same} of {len(src)} lines identical ({100 * same / len(src):.2f}%); "
          f"teacher-forced logits, 32 sentences: max |Δ| {delta:.2e}")
    from peers.common import git_commit  # torch-free helpers beside this script

    commit = git_commit()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU, {args.threads} thread(s)"
    print(f"| {same} of {len(src)} ({100 * same / len(src):.2f}%) | {delta:.2e} | {machine} | "
          f"{datetime.date.today().isoformat()} | {commit} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
