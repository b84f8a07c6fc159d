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
        logits: (..., V) unnormalised scores, any float dtype (computed in float32, or in float64
            for float64 logits: :func:`loss_dtype`).
        target: (...) token ids, the same leading shape as ``logits``.
        epsilon: eps_ls in [0, 1); the paper uses 0.1.
        ignore_index: target id that contributes nothing (PAD).

    Returns:
        (loss_sum, nll_sum): scalars of that dtype summed over the non-ignored positions. ``nll_sum``
        is the un-smoothed -log p(y), for perplexity = exp(nll_sum / n_tokens).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon}")
    vocab_size = logits.size(-1)
    # (..., V) in float32 even for bf16 logits, converted inside the kernel: no float32 copy of the logits
    # besides this one (and in the backward, the gradient comes back in the logits' dtype)
    log_probs = torch.log_softmax(logits, dim=-1, dtype=loss_dtype(logits.dtype))
    keep = target != ignore_index  # (...)
    safe_target = target.masked_fill(~keep, 0)  # ignored ids may be out of range (e.g. -100)
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -log_probs.sum(dim=-1)  # (...) sum_k -log p(k)
    loss = (1.0 - epsilon) * nll + (epsilon / vocab_size) * smooth
    zero = loss.new_zeros(())
    return torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum()


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the loss computes in: float32 for half-precision inputs (bf16, fp16), never less
    precise than the input (float64 stays float64, so a float64 check is exact to float64)."""
    return torch.promote_types(dtype, torch.float32)


# --- the output projection and the loss in one pass, chunk by chunk -----------------------------------

#: Logit elements computed at once by :func:`linear_label_smoothed_nll_loss`: about 2M (float32:
#: 8 MB), so that a chunk's logits stay in a large last-level cache through the loss's elementwise
#: passes, but at least ``d`` rows (every chunk also reads and writes the whole (V, d) gradient of the
#: projection) and at most ``CHUNK_MAX_ELEMENTS`` (64 MB).
CHUNK_ELEMENTS = 1 << 21
CHUNK_MAX_ELEMENTS = 1 << 24


def default_chunk(vocab: int, d: int) -> int:
    """Rows per chunk of :func:`linear_label_smoothed_nll_loss` for a (vocab, d) projection:
    6,000 x 128 (the Multi30k recipe) -> 349 rows, 8,000 x 256 -> 262, 37,000 x 512 (base) -> 453."""
    return max(1, CHUNK_ELEMENTS // vocab, min(CHUNK_MAX_ELEMENTS // vocab, d))


class _LinearLabelSmoothedNLL(torch.autograd.Function):
    """loss = sum_i H(q_i, softmax(h_i Wᵀ)) with the gradient computed in the same pass.

    For one position with logits z = W h (V,), p = softmax(z) and the smoothed target q
    (see :func:`label_smoothed_nll_loss`):

        loss   = -sum_k q(k) log p(k) = (1 - eps) (lse - z_y) + (eps / V) (V lse - sum_k z_k)
        dloss/dz = p - q = p - (1 - eps) onehot(y) - eps / V
        dloss/dh = (p - q) W,      dloss/dW = sum_i (p_i - q_i)ᵀ h_i

    The rows are processed ``chunk`` at a time: each chunk's logits are made, turned into p - q
    in place and multiplied back straight away, so the (N, V) logits, their log-softmax and the
    gradients of both never exist in full. The gradients are computed in the forward (when
    asked) and only scaled by the incoming gradient in the backward: the three matrix products
    are the ones the unfused projection + loss would do, the elementwise passes are fewer.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float, chunk: int, need_grad: bool):
        n, vocab = hidden.size(0), weight.size(0)
        acc = loss_dtype(hidden.dtype)  # float32, float64 for float64 inputs
        loss_sum = hidden.new_zeros((), dtype=acc)
        nll_sum = hidden.new_zeros((), dtype=acc)
        grad_hidden = torch.empty_like(hidden) if need_grad else None  # (N, d)
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_grad else None  # (V, d)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]  # (C, d)
            y = target[start:start + chunk, None]  # (C, 1)
            z = torch.mm(h, weight.t()).to(acc)  # (C, V) logits
            logp = torch.log_softmax(z, dim=-1)  # (C, V)
            nll = -logp.gather(1, y).squeeze(1)  # (C,)
            nll_sum += nll.sum()
            loss_sum += (1.0 - epsilon) * nll.sum() - (epsilon / vocab) * logp.sum()
            if need_grad:
                g = logp.exp_()  # (C, V): p, in place of log p
                g.scatter_add_(1, y, g.new_full(y.shape, -(1.0 - epsilon)))  # p - (1 - eps) onehot(y)
                if epsilon:
                    g.sub_(epsilon / vocab)  # p - q
                g = g.to(hidden.dtype)
                grad_hidden[start:start + chunk] = torch.mm(g, weight.to(hidden.dtype))  # (C, d)
                grad_weight.addmm_(g.t().to(acc), h.to(acc))  # (V, d)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), \
            None, None, None, None


def linear_label_smoothed_nll_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float, ignore_index: int = PAD,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`label_smoothed_nll_loss` of the logits ``hidden @ weight.T``, without making them.

    The same value and the same gradients (to float rounding) as
    ``label_smoothed_nll_loss(F.linear(hidden, weight), target, epsilon, ignore_index)``, but the
    output projection and the loss run together, ``chunk`` positions at a time, over the
    non-ignored positions only (padding costs nothing). This is where a Transformer's training
    step spends its elementwise time: the logits are (tokens x vocabulary), 3,072 x 37,000 at the
    paper's base shapes, and the unfused loss passes over a tensor of that size about ten times.

    Args:
        hidden: (..., d) the decoder's final states (before the output projection).
        weight: (V, d) the output projection (the shared embedding matrix when tied).
        target: (...) token ids; ``ignore_index`` positions count 0.
        epsilon: eps_ls in [0, 1).
        chunk: positions per chunk (default: :func:`default_chunk`).

    Returns:
        (loss_sum, nll_sum) as :func:`label_smoothed_nll_loss`; only ``loss_sum`` has a gradient.
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match target {tuple(target.shape)}")
    if hidden.size(-1) != weight.size(1):
        raise ValueError(f"hidden size {hidden.size(-1)} does not match the projection {tuple(weight.shape)}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon}")
    keep = (target != ignore_index).reshape(-1).nonzero().squeeze(1)  # (N,) the positions that count
    h = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)  # (N, d)
    y = target.reshape(-1).index_select(0, keep)  # (N,)
    chunk = chunk or default_chunk(weight.size(0), weight.size(1))
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearLabelSmoothedNLL.apply(h, weight, y, float(epsilon), chunk, need_grad)
