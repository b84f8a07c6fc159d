"""Length-bucketed batches under a token budget, computed without a list of the examples.

The examples are grouped once by their (source length, target length) pair (:class:`LengthIndex`:
the example indices sorted by length pair, and a table of the pairs and their counts). An epoch's
batches (:class:`BatchPlan`) are cut greedily from the sorted examples so that each batch, padded,
holds at most ``max_tokens`` tokens per side; every example of a length pair has the same padded
widths, so the cut is computed on the table, a few steps per length pair, and is the same every
epoch. What changes from epoch to epoch is which examples of a length pair fill its places (a
seeded pseudo-random permutation of each pair's examples, computed position by position:
:func:`_permute`) and the order of the batches (a seeded shuffle). A batch's example indices are
computed when it is asked for; for a corpus that ``qkv preprocess`` wrote, they are read from its
index file. So the memory an epoch needs is the table and the batch boundaries, not 4 or 8 bytes an
example: at 30 million pairs, the difference between flat memory and 120-240 MB more.

No torch here: :mod:`qkv.data.binarized` (``qkv preprocess``) writes the index with this module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from qkv.errors import CorpusError

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

    With ``shuffle``, the examples of each pair of lengths are put in a pseudo-random order and the
    batch order is shuffled, both seeded by ``(seed, epoch)``: the same arguments give the same
    batches, another epoch gives others. ``tgt_lens=None`` batches on the source side only.

    The lists of :func:`budget_batches`, which computes them (the form large corpora use).
    """
    return budget_batches(src_lens, tgt_lens, max_tokens, shuffle, seed, epoch).tolist()


_CHUNK = 1 << 20  # examples per step of the sort: its temporaries are this long, never the corpus
_MAX_KEYS = 1 << 22  # (source, target) length pairs counted at once (a 32 MB table); more: sorts


class LengthIndex:
    """The examples grouped by length pair, once for all epochs: ``order`` lists the example indices
    sorted (stably) by (source length, target length); bucket ``j`` holds the ``counts[j]`` examples of
    lengths ``src[j]``, ``tgt[j]``, at ``order[starts[j] : starts[j] + counts[j]]``.

    ``order`` is an array in memory (:meth:`build`) or a file that ``qkv preprocess`` wrote (``file``:
    an open file and the byte offset of the array in it), read with ``pread`` a batch at a time, so the
    process holds the bucket table (a few thousand rows) and never the corpus's order."""

    def __init__(self, order: np.ndarray, src: np.ndarray, tgt: np.ndarray, counts: np.ndarray,
                 starts: np.ndarray | None = None, file: tuple | None = None) -> None:
        self.order, self.file = order, file
        self.src = np.asarray(src, dtype=np.int64)
        self.tgt = np.asarray(tgt, dtype=np.int64)
        self.counts = np.asarray(counts, dtype=np.int64)
        if starts is None:
            starts = np.zeros(len(self.counts), dtype=np.int64)
            np.cumsum(self.counts[:-1], out=starts[1:])
        self.starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.counts.sum())

    @property
    def table(self) -> np.ndarray:
        """``(K, 3)`` int64 rows ``(source length, target length, count)``: what ``qkv preprocess`` saves."""
        return np.stack([self.src, self.tgt, self.counts], axis=1) if len(self.counts) else np.zeros((0, 3), np.int64)

    @classmethod
    def build(cls, src_lens: Sequence[int] | np.ndarray, tgt_lens: Sequence[int] | np.ndarray | None,
              out: np.ndarray | None = None) -> "LengthIndex":
        """Index lengths in memory (``out``: where to write the order, e.g. a file's memory map). A stable
        counting sort by length pair, a chunk of examples at a time (temporaries a chunk long); lengths too
        large for a table of counts are sorted instead."""
        src = src_lens if isinstance(src_lens, np.ndarray) else np.asarray(src_lens, dtype=np.int64)
        tgt = None if tgt_lens is None else tgt_lens if isinstance(tgt_lens, np.ndarray) else np.asarray(
            tgt_lens, dtype=np.int64)
        n = len(src)
        if tgt is not None and len(tgt) != n:
            raise ValueError(f"{n} source lengths but {len(tgt)} target lengths")
        if out is None:
            out = np.empty(n, dtype=index_dtype(n))
        if n == 0:
            return cls(out, [], [], [])
        top_s = int(src.max()) + 1
        top_t = 1 if tgt is None else int(tgt.max()) + 1
        if top_s * top_t <= _MAX_KEYS:
            counts = _counting_sort(src, tgt, top_t, top_s * top_t, out)
            keys = np.flatnonzero(counts)
            return cls(out, keys // top_t, keys % top_t, counts[keys])
        key = src.astype(np.int64) * top_t + (0 if tgt is None else tgt.astype(np.int64))
        out[:] = np.argsort(key, kind="stable")
        keys, counts = np.unique(key, return_counts=True)
        return cls(out, keys // top_t, keys % top_t, counts)

    def up_to(self, max_len: int) -> "LengthIndex":
        """The buckets whose lengths are at most ``max_len`` on both sides (``order`` is not copied)."""
        keep = (self.src <= max_len) & (self.tgt <= max_len)
        return LengthIndex(self.order, self.src[keep], self.tgt[keep], self.counts[keep], self.starts[keep],
                           self.file)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """``order[positions]``: from memory, or read from the file (one ``pread`` per run of nearby
        positions; nothing is mapped, so the file's pages stay out of the process's memory)."""
        if self.file is None:
            return np.asarray(self.order[positions])
        fh, base = self.file
        size = self.order.dtype.itemsize
        out = np.empty(len(positions), dtype=self.order.dtype)
        by_pos = np.argsort(positions, kind="stable")
        p = positions[by_pos]
        # runs of positions less than 256 elements apart are read in one piece
        cuts = np.flatnonzero(np.diff(p) > 256) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(p)]):
            lo, hi = int(p[a]), int(p[b - 1]) + 1
            data = os.pread(fh.fileno(), (hi - lo) * size, base + lo * size)
            if len(data) != (hi - lo) * size:
                raise CorpusError(f"{fh.name}: {len(data)} bytes where {(hi - lo) * size} were expected at "
                                  f"element {lo} (the file changed after it was opened)")
            out[by_pos[a:b]] = np.frombuffer(data, dtype=self.order.dtype)[p[a:b] - lo]
        if len(out) and (int(out.min()) < 0 or int(out.max()) >= len(self.order)):
            raise CorpusError(f"{fh.name}: a pair index outside 0..{len(self.order) - 1} (the file is damaged; "
                              "run qkv preprocess again)")
        return out


def index_dtype(n: int) -> np.dtype:
    """int32 for the example indices of fewer than 2**31 examples, else int64."""
    return np.dtype(np.int32 if n < 2**31 else np.int64)


class BatchPlan:
    """The batches of one epoch, computed from a :class:`LengthIndex` without a list of the examples:
    batch ``b`` covers the positions ``starts[b] : starts[b] + sizes[b]`` of the examples sorted by
    length pair (the greedy cut depends on the bucket counts only, so it is the same every epoch); with
    ``shuffle`` each bucket's examples are taken in a pseudo-random order (:func:`_permute`, keyed by the
    seed, the epoch and the bucket) and the batches in a seeded random order. A batch is read when it is
    indexed; indexing gives it as a list of ints, slicing gives a list of them."""

    def __init__(self, index: LengthIndex, max_tokens: int, shuffle: bool = True, seed: int = 0,
                 epoch: int = 0) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.index = index
        self.cum = np.zeros(len(index.counts) + 1, dtype=np.int64)  # first sorted position of each bucket
        np.cumsum(index.counts, out=self.cum[1:])
        bounds = _cut_counts(index.src + 1, index.tgt + 1, index.counts, max_tokens) if len(index) else np.zeros(1, np.int64)
        self.starts, self.sizes = bounds[:-1], np.diff(bounds)
        self.keys = None
        if shuffle:
            rng = np.random.default_rng([seed, epoch])
            self.keys = rng.integers(0, 2**64 - 1, size=(len(index.counts), _ROUNDS), dtype=np.uint64, endpoint=True)
            perm = rng.permutation(len(self.starts))
            self.starts, self.sizes = self.starts[perm], self.sizes[perm]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        if b < 0:
            b += len(self)
        if not 0 <= b < len(self):
            raise IndexError(b)
        pos = np.arange(int(self.starts[b]), int(self.starts[b]) + int(self.sizes[b]), dtype=np.int64)
        bucket = np.searchsorted(self.cum, pos, side="right") - 1
        local = pos - self.cum[bucket]
        if self.keys is not None:
            for j in np.unique(bucket).tolist():  # a batch spans one bucket, or a few short ones
                m = bucket == j
                local[m] = _permute(local[m], int(self.index.counts[j]), self.keys[j])
        return self.index.take(self.index.starts[bucket] + local).tolist()

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
    """:func:`token_budget_batches` as a :class:`BatchPlan` over a :class:`LengthIndex` built in memory
    (about 4 bytes per example)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    return BatchPlan(LengthIndex.build(src_lens, tgt_lens), max_tokens, shuffle, seed, epoch)


_ROUNDS = 4  # of the Feistel network: four rounds of a pseudo-random function make a pseudo-random permutation
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijective hash of 64-bit integers (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _permute(q: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """``pi(q)`` for a pseudo-random permutation ``pi`` of ``range(n)`` chosen by ``keys`` (one uint64
    per round), element-wise, without a table of ``n`` entries: a balanced Feistel network on the
    smallest even number of bits that holds ``n`` (a permutation of up to ``4 n`` values), applied
    again to the values that land outside ``range(n)`` until they land inside ("cycle walking", which
    keeps it a permutation of ``range(n)``)."""
    if n <= 1:
        return q
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    shift, mask, top = np.uint64(half), np.uint64((1 << half) - 1), np.uint64(n)
    x = np.asarray(q, dtype=np.uint64).copy()
    todo = np.arange(len(x))
    while len(todo):
        y = x[todo]
        for k in keys:
            left, right = y >> shift, y & mask
            y = (right << shift) | (left ^ (_mix(right ^ k) & mask))
        x[todo] = y
        todo = todo[y >= top]
    return x.astype(np.int64)


def _counting_sort(src: np.ndarray, tgt: np.ndarray | None, top_t: int, n_keys: int, out: np.ndarray) -> np.ndarray:
    """Write into ``out`` the example indices stably sorted by the key ``src * top_t + tgt``; return the
    count of each key. A chunk of examples at a time is sorted (a radix sort for keys of 16 bits) and
    written where their keys' places in the output say: the temporaries are a chunk long."""
    n = len(src)
    key_dtype = np.uint16 if n_keys <= 2**16 else np.uint32

    def keys_of(ix: slice) -> np.ndarray:
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
    for a in range(0, n, _CHUNK):
        k = keys_of(slice(a, a + _CHUNK))
        by_key = np.argsort(k, kind="stable")
        k = k[by_key]
        chunk_counts = np.bincount(k, minlength=n_keys)
        first = np.zeros(n_keys, dtype=np.int64)  # where each key's run starts within the sorted chunk
        np.cumsum(chunk_counts[:-1], out=first[1:])
        dest = np.arange(len(k), dtype=np.int64)
        dest += (cursor - first)[k]
        out[dest] = by_key + a
        cursor += chunk_counts
    return counts


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
