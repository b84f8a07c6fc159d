"""Batches: length-bucketed token-budget batching and padding collate.

"Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens" (section 5.1). :func:`token_budget_batches` does this: it sorts examples by length and
cuts the sorted list so that each batch, padded, holds at most ``max_tokens`` tokens per side.
Sorting first keeps the padding small (see :func:`padding_fraction`).

:func:`collate` turns token lists into the tensors the model sees (batch-first, PAD on the right):

    src     = x_1 .. x_n EOS
    tgt_in  = BOS y_1 .. y_m          (the decoder input, shifted right)
    tgt_out = y_1 .. y_m EOS          (what the decoder must predict at each position)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from qkv.config import BOS, EOS, PAD


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


def token_budget_batches(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int] | None,
    max_tokens: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> list[list[int]]:
    """Group example indices into length-bucketed batches of at most ``max_tokens`` per side.

    Lengths are token counts without BOS/EOS; one is added for the EOS (source) or the BOS/EOS
    (target) that :func:`collate` adds. The examples are sorted by (source length, target
    length) and cut greedily so that ``batch_size * longest <= max_tokens`` on both sides, the
    padded size of the batch. An example longer than the budget gets a batch of its own.

    With ``shuffle``, ties in the sort are broken randomly and the batch order is shuffled,
    both from a generator seeded by ``(seed, epoch)``: the same arguments give the same batches,
    another epoch gives others. ``tgt_lens=None`` batches on the source side only.

    The lists of :func:`budget_batches`, which computes them (the form large corpora use).
    """
    return budget_batches(src_lens, tgt_lens, max_tokens, shuffle, seed, epoch).tolist()


class BatchPlan:
    """The batches of one epoch in two arrays: ``order`` (example indices, batch after batch) and
    ``bounds`` (batch ``b`` is ``order[bounds[b]:bounds[b + 1]]``). Indexing gives a batch as a list
    of ints, slicing a list of them; 30 million examples take 8 bytes each, not Python lists."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray) -> None:
        self.order, self.bounds = order, bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        if b < 0:
            b += len(self)
        if not 0 <= b < len(self):
            raise IndexError(b)
        return self.order[self.bounds[b] : self.bounds[b + 1]].tolist()

    def __iter__(self):
        for b in range(len(self)):
            yield self[b]

    def tolist(self) -> list[list[int]]:
        return list(self)


def budget_batches(
    src_lens: Sequence[int] | np.ndarray,
    tgt_lens: Sequence[int] | np.ndarray | None,
    max_tokens: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> BatchPlan:
    """:func:`token_budget_batches` as a :class:`BatchPlan`, computed with numpy: stable sorts of
    the lengths (after a seeded permutation when shuffling) and a greedy cut that looks at one batch's
    worth of examples at a time."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    src = np.asarray(src_lens)
    tgt = np.zeros(len(src), dtype=np.int64) if tgt_lens is None else np.asarray(tgt_lens)
    if len(tgt) != len(src):
        raise ValueError(f"{len(src)} source lengths but {len(tgt)} target lengths")
    n = len(src)
    if n == 0:
        return BatchPlan(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    if rng is not None:
        rng.shuffle(order)
    # sort by (source, target) length, stable: equal lengths keep the (random) order above
    top_t = int(tgt.max()) + 1
    n_keys = (int(src.max()) + 1) * top_t
    if n_keys <= 2**16:  # one 16-bit key (one radix sort), and the sorted widths from its counts
        key = src.astype(np.uint16) * np.uint16(top_t) + tgt.astype(np.uint16)  # in the file's order: no gather
        order = order[np.argsort(key[order], kind="stable")]
        sorted_key = np.repeat(np.arange(n_keys, dtype=np.int32), np.bincount(key, minlength=n_keys))
        s, t = sorted_key // top_t + 1, sorted_key % top_t + 1  # padded widths: + EOS / BOS
    else:
        order = order[np.argsort(_sort_key(tgt[order]), kind="stable")]
        order = order[np.argsort(_sort_key(src[order]), kind="stable")]
        s = src[order].astype(np.int32) + 1  # padded widths: + EOS / BOS
        t = tgt[order].astype(np.int32) + 1
    bounds = _cut(s, t, max_tokens)
    if rng is not None:
        perm = rng.permutation(len(bounds) - 1)
        sizes = np.diff(bounds)[perm]
        starts = bounds[:-1][perm]
        order = np.concatenate([order[a : a + k] for a, k in zip(starts.tolist(), sizes.tolist())]) \
            if len(perm) < 4096 else _gather(order, starts, sizes)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
    return BatchPlan(order, bounds.astype(np.int64))


def _sort_key(lengths: np.ndarray) -> np.ndarray:
    """Lengths as the narrowest unsigned type (numpy's stable sort is a radix sort for 16 bits)."""
    top = int(lengths.max()) if len(lengths) else 0
    return lengths.astype(np.uint16 if top < 2**16 else np.int64, copy=False)


def _gather(order: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``order[starts[0]:starts[0]+sizes[0]], order[starts[1]:...], ...`` concatenated, vectorized."""
    ends = np.cumsum(sizes)
    idx = np.arange(ends[-1], dtype=np.int64) - np.repeat(ends - sizes - starts, sizes)
    return order[idx]


def _cut(s: np.ndarray, t: np.ndarray, max_tokens: int) -> np.ndarray:
    """Batch boundaries of the greedy cut over examples sorted by (source, target) width (widths
    ``s``, ``t`` include the added token): a batch grows while ``size * longest <= max_tokens`` on
    both sides; the first example of a batch always joins it.

    Within a run of equal source width ``S`` the target widths are sorted, so a batch of k examples
    starting at p fits iff ``k * S <= max_tokens`` and ``k * t[p + k - 1] <= max_tokens``: its size is
    found from the previous batch's by a few integer steps. A batch that reaches the end of its run
    may go on into the next and is cut by :func:`_cut_one`, which looks at every example."""
    n = len(s)
    bounds = [0]
    change = (np.flatnonzero(s[1:] != s[:-1]) + 1).tolist()
    p = 0
    for g0, g1 in zip([0, *change], [*change, n]):
        if p >= g1:
            continue
        width = int(s[g0])
        cap = max_tokens // width
        tg = t[g0:g1].tolist()  # sorted within the run
        k = 1
        while p < g1:
            hi = min(cap, g1 - p)
            if hi < 1:  # one example wider than the budget: a batch of its own
                k = 1
            else:
                k = max(1, min(k, hi))
                while k < hi and (k + 1) * tg[p + k - g0] <= max_tokens:
                    k += 1
                while k > 1 and k * tg[p + k - 1 - g0] > max_tokens:
                    k -= 1
            if p + k == g1 and g1 < n:  # up to the end of the run: it may take examples of the next
                k = _cut_one(s, t, p, max_tokens) - p
            p += k
            bounds.append(p)
    return np.asarray(bounds, dtype=np.int64)


def _cut_one(s: np.ndarray, t: np.ndarray, p: int, max_tokens: int) -> int:
    """The end of the batch that starts at ``p``, looking at every example it could take."""
    w = min(len(s) - p, max_tokens // int(s[p]) + 1)  # s grows along the order: no batch is longer
    k = np.arange(1, w + 1)
    fits = (k * s[p : p + w] <= max_tokens) & (k * np.maximum.accumulate(t[p : p + w]) <= max_tokens)
    bad = np.flatnonzero(~fits[1:])
    return p + (1 + int(bad[0]) if len(bad) else w)


def _cut_reference(s: np.ndarray, t: np.ndarray, max_tokens: int) -> np.ndarray:
    """:func:`_cut` example by example (for tests)."""
    bounds, p = [0], 0
    while p < len(s):
        p = _cut_one(s, t, p, max_tokens)
        bounds.append(p)
    return np.asarray(bounds, dtype=np.int64)


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
