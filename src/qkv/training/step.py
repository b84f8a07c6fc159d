"""The training step as a GPU runs it: compiled whole, on shapes from a fixed set, without host syncs.

A training update (:meth:`qkv.training.trainer.Trainer.train_step`) is the forward, the label-smoothed
loss, the backward and the optimizer's step. Three things decide how fast it runs on a GPU:

* **Compiled whole** (``compile``): :func:`loss_function` compiles the forward *and* the loss as one
  ``torch.compile(fullgraph=True)`` graph, so any construct dynamo cannot trace is an error, not a
  silent graph break; AOTAutograd compiles the backward of that graph (``.backward()`` then runs it
  with no Python between the kernels). The optimizer's step is not compiled: on CUDA it is Adam's
  fused kernel, one launch for all parameters. The CPU's chunked loss
  (:func:`qkv.losses.linear_label_smoothed_nll_loss`: a Python loop over chunks and a ``nonzero``)
  is not traced; a compiled step takes the loss from the logits, which inductor fuses.
* **Shapes from a fixed set** (:func:`pad_batch`): a compiled graph is specialised to what it was
  traced with, and a token-budget batch has any number of rows and any length. The rows and both
  lengths are rounded up to multiples of :data:`PAD_MULTIPLE` (8): the extra columns are PAD (masked
  in attention, ignored by the loss) and an extra row is a one-token source (EOS) and decoder input
  (BOS) with an all-PAD target, so it takes no part in the loss or the gradients. Every size is then
  one of ``max_len / 8 + 1`` values, never 0 or 1 (sizes dynamo would specialise on), and a multiple
  of 8 (what tensor cores want). Every size is marked dynamic from the first trace, so the whole set
  compiles to one graph: ``tests/test_step.py`` counts the graphs over batches of many lengths.
* **No host syncs** (:func:`sync_free_update`): the update never waits for the device. The tokens
  that normalise the loss are counted on the host, before the copy; the gradient norm, the loss
  sums and whether they are finite stay on the device; a non-finite update is skipped *by the
  device*, through the fused optimizer's ``found_inf`` input (the mechanism torch's GradScaler
  uses: the kernel leaves weights, moments and step count as they were). The trainer reads the
  figures back every :data:`READ_EVERY` updates (a progress line, a metrics record), before a
  validation or a checkpoint, and at the end. ``tests/test_step.py`` runs updates with ``.item()``,
  ``.tolist()``, ``.cpu()``, ``bool()``, ``float()`` and ``nonzero`` made to raise, on the CPU;
  ``benchmarks/gpu_train.py`` runs a compiled update under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from qkv.config import BOS, EOS, PAD
from qkv.data.batching import Batch

#: Rows and lengths of a compiled step's batches are rounded up to a multiple of this.
PAD_MULTIPLE = 8
#: The trainer reads a sync-free step's figures back every this many updates (its progress lines).
READ_EVERY = 50
#: Where the trainer's updates are sync-free by default (elsewhere: ``Trainer(sync_free=True)``).
SYNC_FREE_DEVICES = ("cuda",)


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n`` (and at least ``multiple``)."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_batch(batch, multiple: int = PAD_MULTIPLE):
    """``batch`` with its rows, source length and target length rounded up to multiples of ``multiple``.

    Only a translation :class:`~qkv.data.batching.Batch` (source, decoder input and target) is
    padded; any other batch is returned as it is. The loss and the gradients are those of the batch
    unpadded: extra columns are PAD, and an extra row is ``EOS`` / ``BOS`` followed by PAD with an
    all-PAD target (no position of it counts in the loss; a one-token source keeps every attention
    row with a key to attend to)."""
    if not isinstance(batch, Batch) or batch.tgt_in is None or batch.tgt_out is None:
        return batch
    rows, s, t = batch.src.size(0), batch.src.size(1), batch.tgt_in.size(1)
    R, S, T = round_up(rows, multiple), round_up(s, multiple), round_up(t, multiple)
    if (R, S, T) == (rows, s, t):
        return batch

    def grow(x: torch.Tensor, length: int, first: int | None) -> torch.Tensor:
        x = F.pad(x, (0, length - x.size(1)), value=PAD)  # (rows, length)
        if R > rows:
            extra = x.new_full((R - rows, length), PAD)  # (R - rows, length)
            if first is not None:
                extra[:, 0] = first
            x = torch.cat([x, extra])  # (R, length)
        return x

    return dataclasses.replace(batch, src=grow(batch.src, S, EOS), tgt_in=grow(batch.tgt_in, T, BOS),
                               tgt_out=grow(batch.tgt_out, T, None))


def loss_function(task, module: torch.nn.Module, train_cfg, device: torch.device, amp_dtype: torch.dtype | None,
                  compile: bool):
    """``loss(batch) -> (loss_sum, nll_sum)``: the task's training loss of ``module`` under autocast
    (``amp_dtype``, or full precision for None); with ``compile``, forward and loss compiled together
    as one graph (``fullgraph=True``, dynamic sizes)."""

    def loss(batch):
        autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
        with autocast:
            return task.loss(module, batch, train_cfg)

    if not compile:
        return loss
    compiled = torch.compile(loss, fullgraph=True)

    def compiled_loss(batch):
        for t in _tensors(batch):  # every size symbolic from the first trace: one graph for the shape set
            for dim in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        with _distinct_sizes():
            return compiled(batch)

    compiled_loss.eager = loss  # what is compiled (for torch._dynamo.explain)
    return compiled_loss


def _tensors(batch) -> list[torch.Tensor]:
    """The tensors a batch object holds (a dataclass or any object with attributes, or a tuple)."""
    values = batch if isinstance(batch, (tuple, list)) else vars(batch).values()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _distinct_sizes():
    """While dynamo traces: sizes that happen to be equal (a source and a target of the same padded
    length) get symbols of their own, so that the graph is not specialised to their equality (duck
    shaping) and recompiled the first time they differ."""
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "use_duck_shape") or not hasattr(config, "patch"):
        return contextlib.nullcontext()  # an older torch: equal sizes may cost one more graph
    return config.patch(use_duck_shape=False)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip an update on the device (a fused Adam, AdamW or SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        all(g.get("fused") for g in optimizer.param_groups)


def grad_norm(params: list[torch.Tensor], clip_norm: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (a 0-d tensor on ``device``), clipping them
    to ``clip_norm`` on the way when it is > 0; nothing is read back to the host."""
    if not params:
        return torch.zeros((), device=device)
    if clip_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip_norm)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def sync_free_update(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss_sum: torch.Tensor,
                     clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimizer's step after the backward, skipped on the device when the loss or the gradient
    norm is not finite. Returns ``(grad_norm, finite)``, both 0-d tensors left on the device.
    ``optimizer`` must be fused (:func:`supports_found_inf`)."""
    norm = grad_norm([p for p in params if p.grad is not None], clip_norm, loss_sum.device)
    finite = torch.isfinite(loss_sum) & torch.isfinite(norm)
    optimizer.found_inf = (~finite).to(torch.float32)  # 1: the fused kernel leaves everything as it was
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    optimizer.zero_grad(set_to_none=True)
    return norm, finite
