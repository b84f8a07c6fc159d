"""Beam search in the exported models against qkv's own: time and identical lines.

    python benchmarks/export_beam.py MODEL --src test.en [--n 50] [--threads 1] [--batch-size 1] [--never]

Exports MODEL (a translation checkpoint) with ``qkv export`` to Hugging Face Marian and to
CTranslate2 in a temporary directory, then decodes the first N source lines with the model's
saved beam size and length penalty:

* qkv:          ``qkv.load(MODEL).translate`` with its saved settings (what ``qkv translate`` runs);
* qkv (length): the same with ``length_norm="length"``, Hugging Face's and CTranslate2's ranking
  (log P / |Y|^α), the reference for the identical-lines counts;
* hf:           ``MarianMTModel.generate`` with the written ``generation_config.json``, batches of
  --batch-size sentences, each call given qkv's length limit for its longest source
  (``max_new_tokens`` = max_len_a · |x| + max_len_b + 1), as the model card's code does;
* hf, "never":  (--never) the same with the settings exports wrote before: ``early_stopping="never"``,
  ``max_new_tokens`` 1025 (slow: the search runs to the limit);
* ct2:          ``ctranslate2.Translator.translate_batch`` (float32, ``min_decoding_length=0``, each
  sentence qkv's limit), against qkv with ``length_norm="length"`` and then also ``early_stopping``.

Each system runs once after a warm-up of 5 sentences; wall time (time.perf_counter) of the whole
set. Prints a Markdown table; the figures depend on the machine's load (say which). Needs
``pip install -c constraints.txt -e ".[export]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory of a translation model")
    ap.add_argument("--src", required=True, help="source sentences, one a line (plain or gzip)")
    ap.add_argument("--n", type=int, default=50, help="first N non-empty sentences (default 50)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1, help="sentences per generate() call (default 1)")
    ap.add_argument("--never", action="store_true",
                    help='also time generate() with early_stopping "never" and max_new_tokens 1025')
    args = ap.parse_args()

    import ctranslate2
    import sentencepiece as spm
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    import qkv
    from qkv.data.corpus import read_lines
    from qkv.decoding import MAX_OUTPUT_LEN, max_output_len
    from qkv.decoding.batch import decode_sentences
    from qkv.export import export

    torch.set_num_threads(args.threads)
    model = qkv.load(args.model)
    dec = model.decode_cfg
    src = [s for s in read_lines(args.src) if s.strip()][: args.n]
    src_ids = model.tokenizers.src.encode(src)

    def limit(ids: list[list[int]]) -> int:  # qkv's budget for the longest source (tokens + EOS)
        return int(max_output_len(torch.tensor([max(len(i) for i in ids) + 1]), dec.max_len_a, dec.max_len_b)[0])

    def qkv_tokens(cfg) -> list[list[int]]:
        return [h[0].tokens for h in decode_sentences(model.model, src_ids, cfg)]

    tmp = tempfile.mkdtemp()
    export(args.model, "hf", os.path.join(tmp, "hf"))
    export(args.model, "ctranslate2", os.path.join(tmp, "ct2"))
    hf = MarianMTModel.from_pretrained(os.path.join(tmp, "hf")).eval()
    tok = MarianTokenizer.from_pretrained(os.path.join(tmp, "hf"))
    translator = ctranslate2.Translator(os.path.join(tmp, "ct2"), device="cpu", intra_threads=args.threads)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "ct2", "source.spm"))

    def hf_tokens(**overrides) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for start in range(0, len(src_ids), args.batch_size):
                ids = src_ids[start : start + args.batch_size]
                batch = tok(src[start : start + args.batch_size], return_tensors="pt", padding=True)
                kw = {"max_new_tokens": limit(ids) + 1, **overrides}
                for row in hf.generate(**batch, **kw).tolist():
                    out.append([t for t in row[1:] if t not in (0, 3)])  # BOS first; EOS, PAD after
        return out

    pieces = [sp.encode(s, out_type=str) for s in src]
    tgt_piece = model.tokenizers.tgt.id_to_piece

    def ct2_tokens() -> list[list[str]]:
        return [translator.translate_batch([p], beam_size=dec.beam_size, length_penalty=dec.length_penalty,
                                           min_decoding_length=dec.min_len, max_decoding_length=limit([i]))[0]
                .hypotheses[0] for p, i in zip(pieces, src_ids)]

    # warm-up
    decode_sentences(model.model, src_ids[:5], dec)
    hf_tokens()
    ct2_tokens()

    length = dataclasses.replace(dec, length_norm="length")
    rows = []
    ours, t_qkv = timed(lambda: qkv_tokens(dec))
    ours_len, t_len = timed(lambda: qkv_tokens(length))
    ours_es = qkv_tokens(dataclasses.replace(length, early_stopping=True))
    theirs, t_hf = timed(hf_tokens)
    rows.append((f"qkv beam {dec.beam_size}, α {dec.length_penalty:g}, {dec.length_norm} (its saved settings)",
                 t_qkv, "—"))
    rows.append(("qkv, length_norm length (HF's and CTranslate2's ranking)", t_len, "—"))
    same = sum(a == b for a, b in zip(theirs, ours_len))
    rows.append((f"HF generate, the written generation_config (early_stopping false), per call qkv's limit, "
                 f"{args.batch_size} sentence(s) a call", t_hf, f"{same} of {len(src)} (vs qkv length)"))
    if args.never:
        old, t_old = timed(lambda: hf_tokens(early_stopping="never", max_new_tokens=MAX_OUTPUT_LEN + 1))
        same_old = sum(a == b for a, b in zip(old, ours_len))
        rows.append(('HF generate, early_stopping "never", max_new_tokens 1025 (the earlier export)', t_old,
                     f"{same_old} of {len(src)} (vs qkv length)"))
    ct2, t_ct2 = timed(ct2_tokens)
    as_pieces = lambda runs: [[tgt_piece(t) for t in r] for r in runs]  # noqa: E731
    rows.append(("CTranslate2 float32, beam, min_decoding_length 0, per sentence qkv's limit", t_ct2,
                 f"{sum(a == b for a, b in zip(ct2, as_pieces(ours_len)))} of {len(src)} (vs qkv length); "
                 f"{sum(a == b for a, b in zip(ct2, as_pieces(ours_es)))} of {len(src)} "
                 "(vs qkv length + early_stopping)"))

    from peers.common import git_commit  # torch-free helpers beside this script

    print(f"model {args.model}: {sum(p.numel() for p in model.model.parameters()):,} parameters; "
          f"{len(src)} sentences of {args.src}; {platform.machine()}, {os.cpu_count()} cores, "
          f"{args.threads} thread(s); commit {git_commit()}")
    print("| system | wall time (s) | lines identical |\n| --- | --- | --- |")
    for name, seconds, same in rows:
        print(f"| {name} | {seconds:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
