"""CTranslate2's beam search against qkv's on the same export: how many outputs are equal, and why the
others differ.

    python benchmarks/ct2_beam_agreement.py RUN/best --src test_2016_flickr.en.gz --n 1000

Exports the checkpoint to CTranslate2 (float32) in a temporary folder and decodes the first N non-empty
source lines, one sentence a call, with the model's saved beam size and α:

* qkv with ``length_norm="length"`` and ``early_stopping`` (CTranslate2's ranking and stopping rule);
* CTranslate2 with the options the model card names (beam_size, length_penalty, min_decoding_length =
  qkv's min_len) and each sentence's qkv length limit as max_decoding_length.

``--engine``: CTranslate2 through ``qkv.load(CKPT, engine="ctranslate2")`` instead (``qkv translate
--engine ctranslate2``: one call for the sentences, qkv's per-sentence limits, EOS forced at the limit
and the hypotheses it ended ranked again), its score the engine's.

For each pair that differs, both outputs are scored from the checkpoint's own network (teacher-forced)
under both rules: qkv's, log P / |Y|^α with the model's own log-probabilities and |Y| counting </s>;
CTranslate2's, log P' / |Y|^α with log-probabilities renormalised over the tokens qkv never emits (the
export gives them a -1e4 bias), |Y| counting </s> too. CTranslate2's reported scores are checked
against the second (max difference printed, outputs ended by </s>). Prints a JSON summary; needs ``pip install -c
constraints.txt -e ".[export]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory of a translation model")
    ap.add_argument("--src", required=True, help="source sentences, one a line (plain or gzip)")
    ap.add_argument("--n", type=int, default=1000, help="first N non-empty lines (default 1000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", action="store_true",
                    help="CTranslate2 through qkv.load(engine='ctranslate2') instead of the raw export")
    args = ap.parse_args()

    import ctranslate2
    import sentencepiece as spm
    import torch

    import qkv
    from qkv.config import BOS, EOS
    from qkv.data.corpus import read_lines
    from qkv.decoding import banned_ids, max_output_len
    from qkv.decoding.batch import decode_sentences
    from qkv.export import export

    torch.set_num_threads(args.threads)
    model = qkv.load(args.model)
    dec = model.decode_cfg
    alpha = dec.length_penalty
    src = [s for s in read_lines(args.src) if s.strip()][: args.n]
    ids = model.tokenizers.src.encode(src)
    budget = [int(max_output_len(torch.tensor([len(i) + 1]), dec.max_len_a, dec.max_len_b)[0]) for i in ids]
    cfg = dataclasses.replace(dec, length_norm="length", early_stopping=True)
    ours = [h[0].tokens for h in decode_sentences(model.model, ids, cfg)]

    tgt = model.tokenizers.tgt
    theirs, reported = [], []
    if args.engine:
        engine = qkv.load(args.model, engine="ctranslate2", threads=args.threads)
        best = [h[0] for h in engine.hypotheses(src, **{f: getattr(cfg, f) for f in (
            "beam_size", "length_penalty", "length_norm", "early_stopping", "max_len_a", "max_len_b", "min_len")})]
        theirs, reported = [h.tokens for h in best], [h.score for h in best]
    else:
        out = os.path.join(tempfile.mkdtemp(), "ct2")
        export(args.model, "ctranslate2", out)
        translator = ctranslate2.Translator(out, intra_threads=args.threads)
        sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "source.spm"))
        for s, b in zip(src, budget):
            r = translator.translate_batch([sp.encode(s, out_type=str)], beam_size=dec.beam_size, length_penalty=alpha,
                                           min_decoding_length=dec.min_len, max_decoding_length=b,
                                           return_scores=True)[0]
            theirs.append([tgt.sp.piece_to_id(p) for p in r.hypotheses[0]])
            reported.append(r.scores[0])

    banned = list(banned_ids(tgt))
    net = model.model.eval()

    @torch.inference_mode()
    def logps(i: int, y: list[int]) -> tuple[float, float]:
        """(qkv's log P, the renormalised log P') of y (with </s>) for source i, teacher-forced."""
        x = torch.tensor([ids[i] + [EOS]])
        y_in, y_out = torch.tensor([[BOS] + y]), torch.tensor(y + [EOS])
        z = net(x, y_in)[0].float()  # (|y|+1, V)
        own = torch.log_softmax(z, -1)
        z2 = z.clone()
        z2[:, banned] = -float("inf")
        renorm = torch.log_softmax(z2, -1)
        pick = lambda t: float(t.gather(1, y_out[:, None]).sum())  # noqa: E731
        return pick(own), pick(renorm)

    def qkv_score(lp: float, y: list[int]) -> float:
        return lp / (len(y) + 1) ** alpha

    def ct2_score(lp2: float, y: list[int]) -> float:
        return lp2 / (len(y) + 1) ** alpha

    equal = sum(a == b for a, b in zip(ours, theirs))
    at_limit = [i for i in range(len(src)) if len(ours[i]) >= budget[i] or len(theirs[i]) >= budget[i]]
    rows, score_check = [], 0.0
    for i in range(len(src)):
        lp, lp2 = logps(i, theirs[i])
        if len(theirs[i]) < budget[i] or args.engine:  # ended by </s> (the raw export ends one at the limit without)
            score_check = max(score_check, abs(ct2_score(lp2, theirs[i]) - reported[i]))
        if ours[i] == theirs[i]:
            continue
        olp, olp2 = logps(i, ours[i])
        rows.append({"i": i, "at_limit": i in at_limit,
                     "qkv_rule_prefers_qkv": qkv_score(olp, ours[i]) >= qkv_score(lp, theirs[i]),
                     "ct2_rule_prefers_ct2": ct2_score(lp2, theirs[i]) >= ct2_score(olp2, ours[i]),
                     "lengths": [len(ours[i]), len(theirs[i])]})
    from peers.common import git_commit  # torch-free helpers beside this script

    summary = {
        "model": args.model, "ctranslate2_through": "qkv.load(engine='ctranslate2')" if args.engine else "the export",
        "sentences": len(src), "source": args.src, "beam_size": dec.beam_size, "alpha": alpha,
        "equal": equal, "differ": len(rows), "differ_at_the_length_limit": sum(r["at_limit"] for r in rows),
        "differ_where_each_rule_prefers_its_own_output": sum(r["qkv_rule_prefers_qkv"] and r["ct2_rule_prefers_ct2"]
                                                             for r in rows),
        "max_abs_difference_ct2_reported_score_vs_renormalised_rule": score_check,
        "ctranslate2": ctranslate2.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads, "commit": git_commit(), "differences": rows[:50],
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
