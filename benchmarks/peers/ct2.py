"""CTranslate2, decoding the Marian model converted by ``hf_marian.convert_to_ct2``.

This module must never import torch (its worker asserts it): torch's idle OpenMP threads keep
spinning in a process that loaded it and halve CTranslate2's speed on 2 cores. ``translate_batch``
with source token strings (the same ids as the other systems, EOS appended), ``beam_size`` 1 or k,
``min_decoding_length = max_decoding_length = out_len``, ``intra_threads = threads``, ``inter_threads = 1``
(ct2-f32, ct2-int8), or CTranslate2's throughput setting (ct2-f32-par, ct2-int8-par): ``inter_threads =
threads`` one-thread workers decoding ``threads`` sub-batches at once (on this 2-core machine one
batch over 2 intra-op threads gains little over 1 thread; the split batches scale).
"""

from __future__ import annotations

import sys

from peers.common import decode_result, timed, token_rows


def run(task: str, spec: dict, threads: int, model_dir: str, compute_type: str, parallel: bool = False) -> dict:
    """``parallel``: CTranslate2's throughput setting instead of one multi-threaded batch:
    ``inter_threads = threads`` workers of one thread each, the batch cut into ``threads``
    sub-batches (``max_batch_size``) that they decode at the same time. Same thread count."""
    import ctranslate2

    d, v = spec["decode"], spec["model"]["vocab"]
    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type,
                                        intra_threads=1 if parallel else threads,
                                        inter_threads=threads if parallel else 1)
    rows = [[f"w{i}" for i in r] + ["</s>"] for r in token_rows(d["batch"], d["src_len"] - 1, v, seed=3)]
    n = d["out_len"]
    max_batch = -(-d["batch"] // threads) if parallel else 0
    kwargs = dict(beam_size=1 if task == "greedy" else d["beam_size"], max_decoding_length=n,
                  min_decoding_length=n, max_batch_size=max_batch, return_scores=False)
    if task != "greedy":
        kwargs["length_penalty"] = d["length_penalty"]

    def go(batch):
        out = translator.translate_batch(batch, **kwargs)
        lengths = {len(r.hypotheses[0]) for r in out}
        assert lengths == {n}, f"CTranslate2 output lengths {lengths}, expected {n}"

    go(rows[: min(8, len(rows))])  # warm-up
    seconds = timed(lambda: go(rows), d["reps"])
    assert "torch" not in sys.modules, "the CTranslate2 worker imported torch"
    return decode_result(spec, task, seconds, ctranslate2=ctranslate2.__version__, compute_type=compute_type,
                         intra_threads=1 if parallel else threads, inter_threads=threads if parallel else 1,
                         max_batch_size=max_batch)
