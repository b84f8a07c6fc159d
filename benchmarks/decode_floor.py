"""What one decoding step at batch 1 costs in PyTorch's calls alone, against CTranslate2's whole step.

    python benchmarks/decode_floor.py RUN/best [--threads 1] [--json OUT]

Times each PyTorch call that one eager decoder step of the model makes at batch 1, with the model's
own weights, in tight loops (2,000 calls, best of 5): per layer the matrix products (fused QKV, W^O,
the cross-attention query and its W^O, the FFN's two), two attention calls (SDPA over 16 keys) and
three layer norms; then the output projection. Their sum is a floor under any step that calls
PyTorch once per operation, whatever the Python around it. Against it, per output token (EOS
included), greedy at batch 1 on the first 20 test_2016_flickr sentences, the whole translate call
(tokenisation, encoder, search) included, best of 5: CTranslate2 4.x on the same conversion
(``--engine ctranslate2``; needs the export extra) and qkv's own decoder, with its eager greedy loop
(``scripted_greedy=False``) and with its default, the loop in TorchScript around the traced step.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv

TEST_SET = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "multi30k" / "test_2016_flickr.en.gz"


def per_call(fn, calls: int = 2000, rounds: int = 5) -> float:
    """Microseconds per call of ``fn()``, best of ``rounds`` loops."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def per_token(tr, lines: list[str], **overrides) -> float:
    """Microseconds per output token (EOS included) of greedy decoding at batch 1, best of 5."""
    out = tr.translate(lines, beam_size=1, batch_size=1, **overrides)
    tokens = sum(len(ids) + 1 for ids in tr.tokenizers.tgt.encode(out))
    best = min(_timed(lambda: tr.translate(lines, beam_size=1, batch_size=1, **overrides)) for _ in range(5))
    return best / tokens * 1e6


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a translation Transformer checkpoint directory")
    ap.add_argument("--test", default=str(TEST_SET), help="source sentences, one per line (.gz or plain)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tr = qkv.load(args.model)
    m = tr.model
    d = m.cfg.d_model
    x = torch.randn(1, d)
    rows = []
    with torch.inference_mode():
        layer = m.decoder_layers[0]
        sa, ca, ffn = layer.self_attn, layer.cross_attn, layer.ffn
        h, d_k = sa.n_heads, sa.d_k
        q, kv = torch.randn(1, h, 1, d_k), torch.randn(1, h, 16, d_k)
        hidden = torch.randn(1, ffn.w_1.out_features)
        n = len(m.decoder_layers)
        ops = [
            ("fused QKV product", n, lambda: F.linear(x, sa.in_proj.weight, sa.in_proj.bias)),
            ("self-attention W^O", n, lambda: F.linear(x, sa.out_proj.weight, sa.out_proj.bias)),
            ("cross-attention query", n, lambda: F.linear(x, ca.in_proj.weight[:d], ca.in_proj.bias[:d])),
            ("cross-attention W^O", n, lambda: F.linear(x, ca.out_proj.weight, ca.out_proj.bias)),
            ("FFN W_1", n, lambda: F.linear(x, ffn.w_1.weight, ffn.w_1.bias)),
            ("FFN W_2", n, lambda: F.linear(hidden, ffn.w_2.weight, ffn.w_2.bias)),
            ("attention (SDPA, 16 keys)", 2 * n, lambda: F.scaled_dot_product_attention(q, kv, kv)),
            ("layer norm", 3 * n, lambda: F.layer_norm(x, (d,), layer.res_self.norm.weight, layer.res_self.norm.bias)),
            ("output projection", 1, lambda: F.linear(x, m.output_weight)),
        ]
        for name, count, fn in ops:
            rows.append({"op": name, "calls_per_step": count, "us_per_call": per_call(fn)})
    floor = sum(r["calls_per_step"] * r["us_per_call"] for r in rows)
    opener = gzip.open if args.test.endswith(".gz") else open
    with opener(args.test, "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(20), f)]
    qkv_tok = per_token(tr, lines, scripted_greedy=False)  # the eager loop
    scripted_tok = per_token(tr, lines)  # the default: the loop in TorchScript around the traced step
    try:
        ct2 = qkv.load(args.model, engine="ctranslate2", threads=args.threads)
        ct2_tok = per_token(ct2, lines)
    except Exception as e:  # the export extra missing: the floor alone
        print(f"CTranslate2 not timed: {e}")
        ct2_tok = None
    print(f"{'PyTorch call (batch 1)':<28}{'calls/step':>11}{'µs/call':>9}{'µs/step':>9}")
    for r in rows:
        print(f"{r['op']:<28}{r['calls_per_step']:>11}{r['us_per_call']:>9.1f}{r['calls_per_step'] * r['us_per_call']:>9.0f}")
    print(f"{'floor: their sum':<48}{floor:>9.0f}")
    print(f"qkv eager, whole translate call: {qkv_tok:.0f} µs per output token")
    print(f"qkv scripted greedy loop (the default), whole translate call: {scripted_tok:.0f} µs per output token")
    if ct2_tok is not None:
        print(f"CTranslate2, whole translate call: {ct2_tok:.0f} µs per output token; "
              f"0.8× CTranslate2 allows {ct2_tok / 0.8:.0f} µs; the floor alone is {floor / (ct2_tok / 0.8):.2f} of that")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "ops": rows,
                                               "floor_us": floor, "qkv_us_per_token": qkv_tok,
                                               "qkv_scripted_us_per_token": scripted_tok,
                                               "ct2_us_per_token": ct2_tok, "commit": commit,
                                               "date": datetime.date.today().isoformat()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
