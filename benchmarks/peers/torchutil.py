"""Torch helpers for the torch-based workers (qkv, Hugging Face, torch.nn): threads, batches,
the shared loss and optimizer, and the timed training loop that every training system runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from peers.common import timed, token_rows


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (only possible once per process)
        pass


def train_batch(spec: dict, bos: int, eos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``src (B, S)`` = S-1 tokens + EOS; ``tgt_in (B, T)`` = BOS + T-1 tokens; ``tgt_out`` = T-1 tokens + EOS.

    Every sentence has the same length (no padding), so every system does the same work; each
    system still builds and applies its padding masks as it would for a padded batch."""
    tr, v = spec["train"], spec["model"]["vocab"]
    src = [row + [eos] for row in token_rows(tr["batch"], tr["src_len"] - 1, v, seed=1)]
    tgt = token_rows(tr["batch"], tr["tgt_len"] - 1, v, seed=2)
    return (torch.tensor(src), torch.tensor([[bos] + r for r in tgt]), torch.tensor([r + [eos] for r in tgt]))


def decode_src(spec: dict, eos: int, n_rows: int | None = None) -> torch.Tensor:
    d, v = spec["decode"], spec["model"]["vocab"]
    rows = token_rows(d["batch"], d["src_len"] - 1, v, seed=3)[: n_rows or d["batch"]]
    return torch.tensor([r + [eos] for r in rows])


def adam(params, spec: dict) -> torch.optim.Optimizer:
    """Adam(0.9, 0.98, 1e-9) as the paper; torch's default implementation (foreach on CPU)."""
    return torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


def smoothed_ce_sum(logits: torch.Tensor, target: torch.Tensor, pad: int, eps: float) -> torch.Tensor:
    """Label-smoothed cross-entropy summed over non-PAD targets, the peers' loss."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1),
                           ignore_index=pad, label_smoothing=eps, reduction="sum")


def generic_train_step(model, opt, forward_loss, n_tokens: int, clip_norm: float):
    """forward + loss / n_tokens + backward + clip + Adam step + zero_grad, as qkv's trainer does."""

    def step():
        model.train()
        loss = forward_loss()
        (loss / n_tokens).backward()
        loss.item()  # qkv's trainer logs the loss each step (a sync); the peers do the same
        if clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_training(step, spec: dict) -> list[float]:
    tr = spec["train"]
    timed(step, tr["warmup"])
    return timed(step, tr["steps"])


def sinusoidal(n: int, d: int) -> torch.Tensor:
    """The paper's PE table (interleaved sin/cos), for the torch.nn.Transformer peer."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    div = torch.pow(10000.0, torch.arange(0, d, 2, dtype=torch.float64) / d)
    pe = torch.empty(n, d, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos / div), torch.cos(pos / div)
    return pe.float()


def flops(spec: dict) -> dict:
    """Training and forward FLOPs per target token from qkv.info.transformer_flops (same formula for all)."""
    from qkv.config import ModelConfig
    from qkv.info import transformer_flops

    m, tr = spec["model"], spec["train"]
    cfg = ModelConfig(d_model=m["d_model"], n_heads=m["n_heads"], d_ff=m["d_ff"], n_encoder_layers=m["layers"],
                      n_decoder_layers=m["layers"], src_vocab_size=m["vocab"], tgt_vocab_size=m["vocab"])
    f = transformer_flops(cfg, tr["src_len"], tr["tgt_len"], m["vocab"])
    return {"train_flops_per_token": f.training, "forward_flops_per_token": f.forward}


__all__ = ["set_threads", "train_batch", "decode_src", "adam", "smoothed_ce_sum", "generic_train_step",
           "time_training", "sinusoidal", "flops"]
