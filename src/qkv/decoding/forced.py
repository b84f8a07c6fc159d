"""Forced decoding: the log-probability a model gives to a given target (fairseq's
``--score-reference``, CTranslate2's ``score_batch``), for scoring, reranking and filtering.

The target is fed through the model's incremental ``start``/``step`` interface, the very step
function greedy and beam search decode with, so the score of a beam-search output equals its
beam ``logprob``: log p(y | x) = Σ_t log softmax(step logits)[y_t], EOS included.
"""

from __future__ import annotations

import torch

from qkv.data.batching import collate
from qkv.errors import QkvError
from qkv.masks import real_tokens


@torch.inference_mode()
def forced_logprobs(model: torch.nn.Module, src_ids: list[list[int]], tgt_ids: list[list[int]],
                    batch_size: int = 64) -> list[list[float]]:
    """log p(y_t | y_<t, x) of each target token and of the final EOS (``len(tgt) + 1`` values per
    pair), in input order. Source and target ids are without EOS/BOS."""
    if len(src_ids) != len(tgt_ids):
        raise QkvError(f"{len(src_ids)} sources but {len(tgt_ids)} targets")
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in src_ids]
    order = sorted(range(len(src_ids)), key=lambda i: (len(src_ids[i]), len(tgt_ids[i])))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = collate([src_ids[i] for i in idx], [tgt_ids[i] for i in idx]).to(device)
            steps = model.max_steps(real_tokens(batch.src).sum(dim=1))  # step calls each row may take (None: no end)
            if steps is not None:
                steps = torch.as_tensor(steps).expand(len(idx)).tolist()
                for row, i in enumerate(idx):
                    if len(tgt_ids[i]) + 1 > steps[row]:
                        raise QkvError(f"pair {i + 1}: its target ({len(tgt_ids[i])} tokens and EOS) is longer than "
                                       f"this model can read ({steps[row]} positions; learned positions end there)")
            state = model.start(batch.src)
            columns = []
            for t in range(batch.tgt_in.size(1)):
                logits, state = model.step(batch.tgt_in[:, t], state)
                logp = torch.log_softmax(logits.float(), dim=-1)  # as beam search scores
                columns.append(logp.gather(1, batch.tgt_out[:, t : t + 1]).squeeze(1))
            table = torch.stack(columns, dim=1).cpu()  # (B, T)
            for row, i in enumerate(idx):
                out[i] = table[row, : len(tgt_ids[i]) + 1].tolist()
    finally:
        model.train(was_training)
    return out


__all__ = ["forced_logprobs"]
