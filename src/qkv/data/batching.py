"""Batches: length-bucketed token-budget batching and padding collate.

"Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens" (section 5.1). :func:`token_budget_batches` does this: it sorts examples by length and
cuts the sorted list so that each batch, padded, holds at most ``max_tokens`` tokens per side.
Sorting first keeps the padding small (see :func:`padding_fraction`). The batching itself (no
torch in it: ``qkv preprocess`` uses it too) is in :mod:`qkv.data.buckets`.

:func:`collate` turns token lists into the tensors the model sees (batch-first, PAD on the right):

    src     = x_1 .. x_n EOS
    tgt_in  = BOS y_1 .. y_m          (the decoder input, shifted right)
    tgt_out = y_1 .. y_m EOS          (what the decoder must predict at each position)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from qkv.config import BOS, EOS, PAD
from qkv.data.buckets import BatchPlan, LengthIndex, budget_batches, token_budget_batches


@dataclass
class Batch:
    """Padded tensors for one batch; ``indices`` are the examples' positions in the dataset."""

    src: torch.Tensor  # (B, S) long
    tgt_in: torch.Tensor | None  # (B, T) long; None when decoding
    tgt_out: torch.Tensor | None  # (B, T) long; None when decoding
    indices: list[int]

    @property
    def n_src_tokens(self) -> int:
        """Non-PAD source tokens (EOS included)."""
        return int((self.src != PAD).sum())

    @property
    def n_tgt_tokens(self) -> int:
        """Non-PAD target tokens to predict (EOS included); 0 without a target."""
        return 0 if self.tgt_out is None else int((self.tgt_out != PAD).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with the tensors on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(self, src=move(self.src), tgt_in=move(self.tgt_in), tgt_out=move(self.tgt_out))

    def pin_memory(self) -> "Batch":
        """A copy in page-locked host memory (CUDA only), whose ``to(cuda, non_blocking=True)`` does not wait."""

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return dataclasses.replace(self, src=pin(self.src), tgt_in=pin(self.tgt_in), tgt_out=pin(self.tgt_out))

    def __len__(self) -> int:
        return self.src.size(0)


def _pad(rows: list[list[int]]) -> torch.Tensor:
    """Right-pad lists of ids with PAD into a (B, max_len) long tensor."""
    return pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True, padding_value=PAD)


def collate(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]] | None,
    indices: Sequence[int] | None = None,
) -> Batch:
    """Build a :class:`Batch`: EOS ends the source, BOS starts ``tgt_in``, EOS ends ``tgt_out``.

    ``tgt_ids=None`` (decoding) leaves ``tgt_in`` and ``tgt_out`` as None.
    ``indices`` default to ``0..B-1``.
    """
    src = _pad([[*s, EOS] for s in src_ids])
    tgt_in = tgt_out = None
    if tgt_ids is not None:
        if len(tgt_ids) != len(src_ids):
            raise ValueError(f"collate: {len(src_ids)} sources but {len(tgt_ids)} targets")
        tgt_in = _pad([[BOS, *t] for t in tgt_ids])
        tgt_out = _pad([[*t, EOS] for t in tgt_ids])
    index_list = list(indices) if indices is not None else list(range(len(src_ids)))
    return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, indices=index_list)


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lens: Sequence[int], tgt_lens: Sequence[int]
) -> float:
    """Share of PAD among all positions of the padded batches, source and target together.

    Each side of an example occupies ``len + 1`` real positions (EOS, or BOS/EOS shifted);
    a batch occupies ``batch_size * longest`` positions per side.
    """
    padded = real = 0
    for batch in batches:
        for lens in (src_lens, tgt_lens):
            sizes = [lens[i] + 1 for i in batch]
            padded += len(batch) * max(sizes)
            real += sum(sizes)
    return (padded - real) / padded if padded else 0.0


__all__ = ["Batch", "collate", "padding_fraction", "token_budget_batches", "budget_batches", "BatchPlan", "LengthIndex"]
