"""Label-smoothed cross-entropy, the training loss of the paper (section 5.4).

"During training, we employed label smoothing of value eps_ls = 0.1 [Szegedy et al., 2016].
This hurts perplexity, as the model learns to be more unsure, but improves accuracy and BLEU
score." The loss is returned as a *sum* over target tokens; the trainer divides by the number
of target tokens in the (accumulated) batch, so that every token weighs the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.config import PAD


def label_smoothed_nll_loss(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int = PAD
) -> tuple[Tensor, Tensor]:
    """Cross-entropy against the label-smoothed target distribution, summed over tokens.

    For a target token y out of a vocabulary of size V, the one-hot target is replaced by

        q(k) = (1 - eps) * [k == y] + eps / V          (uniform over all V, y included)

    and the loss of one position is the cross-entropy H(q, p) with p = softmax(logits):

        loss = -sum_k q(k) log p(k)
             = (1 - eps) * (-log p(y)) + (eps / V) * sum_k (-log p(k))

    This is the same as ``F.cross_entropy(..., label_smoothing=eps)``. With eps = 0 it is the
    negative log-likelihood. Positions whose target is ``ignore_index`` (padding) count 0.

    Args:
        logits: (..., V) unnormalised scores, any float dtype (computed in float32).
        target: (...) token ids, the same leading shape as ``logits``.
        epsilon: eps_ls in [0, 1); the paper uses 0.1.
        ignore_index: target id that contributes nothing (PAD).

    Returns:
        (loss_sum, nll_sum): float32 scalars summed over the non-ignored positions. ``nll_sum``
        is the un-smoothed -log p(y), for perplexity = exp(nll_sum / n_tokens).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon}")
    vocab_size = logits.size(-1)
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (..., V), float32 even for bf16 logits
    keep = target != ignore_index  # (...)
    safe_target = target.masked_fill(~keep, 0)  # ignored ids may be out of range (e.g. -100)
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -log_probs.sum(dim=-1)  # (...) sum_k -log p(k)
    loss = (1.0 - epsilon) * nll + (epsilon / vocab_size) * smooth
    zero = loss.new_zeros(())
    return torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum()
