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
    """The batches of one epoch as arrays, not Python lists: batch ``b`` is
    ``order[starts[b] : starts[b] + sizes[b]]`` (``order``: example indices, int32 below 2**31
    examples). Indexing gives a batch as a list of ints, slicing a list of them; 30 million examples
    take 4 bytes each. ``BatchPlan(order, bounds)`` (batch ``b`` is ``order[bounds[b]:bounds[b + 1]]``)
    is the same with the batches in the order of the array."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, starts: np.ndarray | None = None,
                 sizes: np.ndarray | None = None) -> None:
        self.order = order
        bounds = np.asarray(bounds, dtype=np.int64)
        self.starts = bounds[:-1] if starts is None else np.asarray(starts, dtype=np.int64)
        self.sizes = np.diff(bounds) if sizes is None else np.asarray(sizes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        if b < 0:
            b += len(self)
        if not 0 <= b < len(self):
            raise IndexError(b)
        start = int(self.starts[b])
        return self.order[start : start + int(self.sizes[b])].tolist()

    def __iter__(self):
        for b in range(len(self)):
            yield self[b]

    def tolist(self) -> list[list[int]]:
        return list(self)


_CHUNK = 1 << 20  # examples per step of the sort: its temporaries are this long, never the corpus
_MAX_KEYS = 1 << 22  # (source, target) length pairs counted at once (a 32 MB table); more: sorts


def budget_batches(
    src_lens: Sequence[int] | np.ndarray,
    tgt_lens: Sequence[int] | np.ndarray | None,
    max_tokens: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> BatchPlan:
    """:func:`token_budget_batches` as a :class:`BatchPlan`, computed with numpy in memory that stays
    near 4 bytes per example: a seeded permutation of the examples (when shuffling), a stable counting
    sort of it by (source, target) length done a chunk at a time, and the greedy cut computed on the
    counts of each length pair (every example of a pair of lengths has the same padded widths), not
    example by example. The batches are then listed in a seeded random order, without moving the
    examples."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    src = src_lens if isinstance(src_lens, np.ndarray) else np.asarray(src_lens)
    tgt = None if tgt_lens is None else tgt_lens if isinstance(tgt_lens, np.ndarray) else np.asarray(tgt_lens)
    n = len(src)
    if tgt is not None and len(tgt) != n:
        raise ValueError(f"{n} source lengths but {len(tgt)} target lengths")
    if n == 0:
        return BatchPlan(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    if rng is not None:
        rng.shuffle(order)
    top_s = _max(src) + 1
    top_t = 1 if tgt is None else _max(tgt) + 1
    if top_s * top_t <= _MAX_KEYS:
        order, counts = _counting_sort(order, src, tgt, top_t, top_s * top_t)
        keys = np.flatnonzero(counts)
        bounds = _cut_counts(keys // top_t + 1, keys % top_t + 1, counts[keys], max_tokens)
    else:  # lengths too large for a table of counts: two stable sorts, the cut example by example
        t0 = np.zeros(n, dtype=np.uint16) if tgt is None else tgt
        order = order[np.argsort(_sort_key(t0[order]), kind="stable")]
        order = order[np.argsort(_sort_key(src[order]), kind="stable")]
        bounds = _cut(src[order].astype(np.int32) + 1, t0[order].astype(np.int32) + 1, max_tokens)
    starts, sizes = bounds[:-1], np.diff(bounds)
    if rng is not None:
        perm = rng.permutation(len(starts))
        starts, sizes = starts[perm], sizes[perm]
    return BatchPlan(order, bounds, starts, sizes)


def _max(lengths: np.ndarray) -> int:
    return int(lengths.max()) if len(lengths) else 0


def _counting_sort(order: np.ndarray, src: np.ndarray, tgt: np.ndarray | None, top_t: int,
                   n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """``order`` stably sorted by the key ``src * top_t + tgt`` of its examples, and the count of each
    key. A chunk of ``order`` at a time is sorted (a radix sort for keys of 16 bits) and its examples
    written where their keys' places in the output say: the temporaries are a chunk long."""
    n = len(order)
    key_dtype = np.uint16 if n_keys <= 2**16 else np.uint32

    def keys_of(ix: np.ndarray | slice) -> np.ndarray:
        k = np.array(src[ix], dtype=key_dtype)  # a copy (a slice of src would be a view)
        if tgt is not None:
            k *= key_dtype(top_t)
            k += tgt[ix].astype(key_dtype, copy=False)
        return k

    counts = np.zeros(n_keys, dtype=np.int64)
    for a in range(0, n, _CHUNK):  # in file order: the lengths arrays are read sequentially
        counts += np.bincount(keys_of(slice(a, a + _CHUNK)), minlength=n_keys)
    cursor = np.zeros(n_keys, dtype=np.int64)
    np.cumsum(counts[:-1], out=cursor[1:])
    out = np.empty_like(order)
    for a in range(0, n, _CHUNK):
        ix = order[a : a + _CHUNK]
        k = keys_of(ix)
        by_key = np.argsort(k, kind="stable")
        k = k[by_key]
        chunk_counts = np.bincount(k, minlength=n_keys)
        first = np.zeros(n_keys, dtype=np.int64)  # where each key's run starts within the sorted chunk
        np.cumsum(chunk_counts[:-1], out=first[1:])
        dest = np.arange(len(k), dtype=np.int64)
        dest += (cursor - first)[k]
        out[dest] = ix[by_key]
        cursor += chunk_counts
    return out, counts


def _cut_counts(s: np.ndarray, t: np.ndarray, counts: np.ndarray, max_tokens: int) -> np.ndarray:
    """:func:`_cut` of examples sorted by (source, target) width given as runs: ``counts[j]`` examples
    of widths ``s[j]``, ``t[j]`` (the runs in sorted order). The same greedy rule: a batch grows while
    ``size * longest <= max_tokens`` on both sides, its first example always joins it; batches inside
    a run all have the run's capacity, so each run costs a few steps, not one per example."""
    pieces = [np.zeros(1, dtype=np.int64)]
    p = 0  # examples placed
    k = 0  # examples in the open batch (ending at p)
    longest = 0  # its widest side so far
    for sj, tj, cj in zip(s.tolist(), t.tolist(), counts.tolist()):
        w = max(sj, tj, longest)
        take = min(cj, max_tokens // w - k) if k else 0
        if k and take <= 0:  # the open batch is full: close it
            pieces.append(np.array([p], dtype=np.int64))
            k, longest, w, take = 0, 0, max(sj, tj), 0
        if take > 0:  # the open batch takes some of the run
            p += take
            k += take
            longest = w
            cj -= take
            if cj == 0:
                continue
            pieces.append(np.array([p], dtype=np.int64))
            k, longest = 0, 0
        w = max(sj, tj)
        cap = max(1, max_tokens // w)
        full, rest = divmod(cj, cap)
        if full:
            pieces.append(p + cap * np.arange(1, full + 1, dtype=np.int64))
            p += cap * full
        if rest:  # a batch left open: the next run may add to it
            p += rest
            k, longest = rest, w
        else:
            k, longest = 0, 0
    if k:
        pieces.append(np.array([p], dtype=np.int64))
    return np.concatenate(pieces)


def _sort_key(lengths: np.ndarray) -> np.ndarray:
    """Lengths as the narrowest unsigned type (numpy's stable sort is a radix sort for 16 bits)."""
    top = int(lengths.max()) if len(lengths) else 0
    return lengths.astype(np.uint16 if top < 2**16 else np.int64, copy=False)


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
