"""The machine's float32 matrix-multiply peak through torch (the denominator of MFU).

Square 2048 GEMMs and the shapes of the model's largest training matmuls (a batch of tokens
times the FFN and output-projection weights); for each shape the best of a few timed calls after
a warm-up. The peak is the best over shapes."""

from __future__ import annotations

import time

import torch


def run(task: str, spec: dict, threads: int) -> dict:
    m = spec["model"]
    n_tok = spec["train"]["batch"] * spec["train"]["tgt_len"]
    shapes = [(2048, 2048, 2048), (n_tok, m["d_model"], m["d_ff"]), (n_tok, m["d_ff"], m["d_model"]),
              (n_tok, m["d_model"], m["vocab"])]
    if spec.get("quick"):
        shapes = [(256, 256, 256)]
    results = []
    for (mm, k, n) in shapes:
        a, b = torch.randn(mm, k), torch.randn(k, n)
        c = torch.empty(mm, n)
        torch.mm(a, b, out=c)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - t0)
        flop = 2.0 * mm * k * n
        results.append({"m": mm, "k": k, "n": n, "best_gflops": flop / min(times) / 1e9,
                        "median_gflops": flop / sorted(times)[len(times) // 2] / 1e9})
    return {"task": "matmul", "shapes": results, "peak_gflops": max(r["best_gflops"] for r in results)}
