"""Tests for qkv.data.batching: collate layout, the token budget, determinism, padding."""

from __future__ import annotations

import random

import pytest
import torch

from qkv.config import BOS, EOS, PAD
from qkv.data.batching import collate, padding_fraction, token_budget_batches

# --- collate -----------------------------------------------------------------------------------------


def test_collate_layout() -> None:
    batch = collate([[5, 6, 7], [8]], [[9], [10, 11, 12]], indices=[40, 41])
    assert (BOS, EOS, PAD) == (2, 3, 0)
    assert torch.equal(batch.src, torch.tensor([[5, 6, 7, 3], [8, 3, 0, 0]]))
    assert torch.equal(batch.tgt_in, torch.tensor([[2, 9, 0, 0], [2, 10, 11, 12]]))
    assert torch.equal(batch.tgt_out, torch.tensor([[9, 3, 0, 0], [10, 11, 12, 3]]))
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    assert batch.indices == [40, 41]
    assert batch.n_src_tokens == 6  # 3 + 1 and 1 + 1
    assert batch.n_tgt_tokens == 6  # 1 + 1 and 3 + 1
    assert len(batch) == 2


def test_collate_without_target() -> None:
    batch = collate([[4], [5, 6]], None)
    assert torch.equal(batch.src, torch.tensor([[4, 3, 0], [5, 6, 3]]))
    assert batch.tgt_in is None and batch.tgt_out is None
    assert batch.indices == [0, 1]
    assert batch.n_tgt_tokens == 0
    moved = batch.to("cpu")
    assert torch.equal(moved.src, batch.src) and moved.tgt_in is None


def test_collate_empty_sentence() -> None:
    batch = collate([[]], [[]])
    assert torch.equal(batch.src, torch.tensor([[3]]))
    assert torch.equal(batch.tgt_in, torch.tensor([[2]]))
    assert torch.equal(batch.tgt_out, torch.tensor([[3]]))


def test_collate_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        collate([[4], [5]], [[6]])


# --- token_budget_batches ---------------------------------------------------------------------------


def random_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    src = [rng.randint(1, 60) for _ in range(n)]
    tgt = [max(1, s + rng.randint(-5, 10)) for s in src]
    return src, tgt


def test_small_literal_cases() -> None:
    # each example takes 2 positions per side (token + EOS / BOS): two fit in 4
    assert token_budget_batches([1, 1, 1, 1], [1, 1, 1, 1], max_tokens=4, shuffle=False) == [[0, 1], [2, 3]]
    # sorted by (source, target) length without shuffling
    assert token_budget_batches([5, 1, 3, 3], [0, 0, 2, 1], max_tokens=100, shuffle=False) == [[1, 3, 2, 0]]
    # the target side alone can close a batch: 3 * (9 + 1) > 20
    assert token_budget_batches([1, 1, 1], [9, 9, 9], max_tokens=20, shuffle=False) == [[0, 1], [2]]


def test_budget_respected_and_every_index_once() -> None:
    src, tgt = random_lengths(600)
    src[17], tgt[17] = 300, 5  # longer than the budget on its own
    max_tokens = 200
    batches = token_budget_batches(src, tgt, max_tokens, shuffle=True, seed=3, epoch=1)
    assert sorted(i for b in batches for i in b) == list(range(600))
    assert [17] in batches
    for b in batches:
        padded_src = len(b) * max(src[i] + 1 for i in b)
        padded_tgt = len(b) * max(tgt[i] + 1 for i in b)
        assert len(b) == 1 or (padded_src <= max_tokens and padded_tgt <= max_tokens)
    # greedy cutting fills batches: most are more than half full on their longer side
    full = [b for b in batches if len(b) * max(max(src[i], tgt[i]) + 1 for i in b) > max_tokens // 2]
    assert len(full) >= 0.9 * len(batches)


def test_deterministic_per_seed_and_epoch() -> None:
    src, tgt = random_lengths(300)
    first = token_budget_batches(src, tgt, 150, shuffle=True, seed=7, epoch=0)
    assert token_budget_batches(src, tgt, 150, shuffle=True, seed=7, epoch=0) == first
    other_epoch = token_budget_batches(src, tgt, 150, shuffle=True, seed=7, epoch=1)
    assert other_epoch != first
    assert sorted(map(sorted, other_epoch)) != sorted(map(sorted, first))  # not only the order: ties differ too
    assert token_budget_batches(src, tgt, 150, shuffle=True, seed=8, epoch=0) != first
    # without shuffling the epoch does not matter
    assert token_budget_batches(src, tgt, 150, shuffle=False, epoch=0) == token_budget_batches(
        src, tgt, 150, shuffle=False, epoch=5
    )


def test_source_only_batching() -> None:
    batches = token_budget_batches([3, 3, 3, 3, 3], None, max_tokens=8, shuffle=False)
    assert batches == [[0, 1], [2, 3], [4]]


def reference_batches(src, tgt, max_tokens, shuffle, seed, epoch) -> list[list[int]]:
    """Example by example: a stable sort by (source, target) length; with shuffle, the examples of each
    pair of lengths reordered by that bucket's seeded permutation (``_permute``, tested on its own
    below); the greedy cut (a batch grows while size * widest <= max_tokens per side); the seeded batch
    order."""
    import numpy as np

    from qkv.data.buckets import _ROUNDS, _permute

    n = len(src)
    tgt = [0] * n if tgt is None else tgt
    order = sorted(range(n), key=lambda i: (src[i], tgt[i]))
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    if rng is not None:
        buckets: dict[tuple[int, int], list[int]] = {}
        for i in order:
            buckets.setdefault((src[i], tgt[i]), []).append(i)
        keys = rng.integers(0, 2**64 - 1, size=(len(buckets), _ROUNDS), dtype=np.uint64, endpoint=True)
        order = []
        for j, members in enumerate(buckets.values()):
            for q in range(len(members)):
                order.append(members[int(_permute(np.array([q]), len(members), keys[j])[0])])
    batches: list[list[int]] = []
    for i in order:
        b = batches[-1] if batches else None
        if b is not None:
            k = len(b) + 1
            if k * max(src[j] + 1 for j in [*b, i]) <= max_tokens and k * max(tgt[j] + 1 for j in [*b, i]) <= max_tokens:
                b.append(i)
                continue
        batches.append([i])
    if rng is not None and batches:
        batches = [batches[p] for p in rng.permutation(len(batches)).tolist()]
    return batches


@pytest.mark.parametrize("chunk,max_keys", [(1 << 20, 1 << 22), (7, 1 << 22), (5, 1)])
def test_budget_batches_equal_the_example_by_example_reference(monkeypatch, chunk, max_keys) -> None:
    """The counting sort (done a chunk at a time), the cut on the counts of each length pair and the
    batches read position by position through the bucket permutations give the batches of the plain
    definition; so does the fallback for lengths too large to count (max_keys 1)."""
    from qkv.data import buckets as batching

    monkeypatch.setattr(batching, "_CHUNK", chunk)
    monkeypatch.setattr(batching, "_MAX_KEYS", max_keys)
    rng = random.Random(5)
    for case in range(150):
        n = rng.randrange(0, 120)
        top = rng.choice([2, 6, 40, 300])
        src = [rng.randrange(top) for _ in range(n)]
        tgt = None if case % 5 == 0 else [rng.randrange(rng.choice([2, 6, 40, 300])) for _ in range(n)]
        max_tokens = rng.choice([1, 4, 30, 200, 2000])
        shuffle = case % 3 != 0
        got = token_budget_batches(src, tgt, max_tokens, shuffle=shuffle, seed=case, epoch=2)
        assert got == reference_batches(src, tgt, max_tokens, shuffle, case, 2), case


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000, 4097, 100_003])
def test_permute_is_a_permutation(n) -> None:
    """Every key set gives a bijection of range(n) (Feistel rounds, and cycle walking back into range)."""
    import numpy as np

    from qkv.data.buckets import _ROUNDS, _permute

    keys = np.random.default_rng(n).integers(0, 2**63, size=(3, _ROUNDS), dtype=np.uint64)
    for k in keys:
        image = _permute(np.arange(n), n, k)
        assert sorted(image.tolist()) == list(range(n))
        part = np.arange(n)[::3]  # any subset maps to the same values as within the whole
        assert _permute(part, n, k).tolist() == image[::3].tolist()


def test_permute_looks_uniformly_random() -> None:
    """Over many keys, where one element lands is uniform (chi-square over 10 bins), neighbours do not
    stay neighbours, and fixed points are about as rare as in a uniformly random permutation (mean 1)."""
    import numpy as np

    from qkv.data.buckets import _ROUNDS, _permute

    n, trials = 1000, 2000
    keys = np.random.default_rng(0).integers(0, 2**63, size=(trials, _ROUNDS), dtype=np.uint64)
    images = np.stack([_permute(np.arange(n), n, k) for k in keys])
    for q in (0, 1, 500, 999):
        observed = np.bincount(images[:, q] * 10 // n, minlength=10)
        chi2 = float((((observed - trials / 10) ** 2) / (trials / 10)).sum())
        assert chi2 < 27.9, (q, observed)  # the 0.001 quantile of chi-square with 9 degrees of freedom
    adjacent = (np.abs(np.diff(images, axis=1)) == 1).mean()
    assert adjacent < 0.01  # about 2 / n for a random permutation
    fixed = (images == np.arange(n)).sum(axis=1).mean()
    assert 0.8 < fixed < 1.2
    # the order of a pair of elements is a coin toss
    assert abs((images[:, 10] < images[:, 11]).mean() - 0.5) < 0.05


def test_length_index_from_a_file_and_up_to(tmp_path) -> None:
    """An index whose order is read from a .npy file with pread gives the batches of the in-memory one;
    ``up_to`` leaves out the buckets over a length, as dropping those examples would."""
    import numpy as np

    from qkv.data.buckets import BatchPlan, LengthIndex

    rng = random.Random(2)
    src = [rng.randrange(1, 30) for _ in range(3000)]
    tgt = [rng.randrange(1, 30) for _ in range(3000)]
    memory = LengthIndex.build(src, tgt)
    np.save(tmp_path / "order.npy", memory.order)
    mapped = np.load(tmp_path / "order.npy", mmap_mode="r")
    fh = open(tmp_path / "order.npy", "rb", buffering=0)
    on_file = LengthIndex(mapped, memory.src, memory.tgt, memory.counts, file=(fh, mapped.offset))
    try:
        for shuffle in (False, True):
            a = BatchPlan(memory, 200, shuffle, seed=4, epoch=3).tolist()
            assert BatchPlan(on_file, 200, shuffle, seed=4, epoch=3).tolist() == a
        short = [i for i in range(3000) if src[i] <= 20 and tgt[i] <= 20]
        kept = BatchPlan(on_file.up_to(20), 200, shuffle=False).tolist()
        expected = token_budget_batches([src[i] for i in short], [tgt[i] for i in short], 200, shuffle=False)
        assert kept == [[short[i] for i in b] for b in expected]
        assert sorted(i for b in BatchPlan(on_file.up_to(20), 200, seed=1).tolist() for i in b) == short
    finally:
        fh.close()


# --- padding ----------------------------------------------------------------------------------------


def pad_share(batches: list[list[int]], src: list[int], tgt: list[int]) -> float:
    """Independent reference: count pads position by position."""
    pads = total = 0
    for b in batches:
        for lens in (src, tgt):
            width = max(lens[i] + 1 for i in b)
            for i in b:
                total += width
                pads += width - (lens[i] + 1)
    return pads / total


def test_padding_fraction_literal() -> None:
    # src sizes 2 and 4 -> 8 positions, 2 pads; tgt sizes 3 and 3 -> 6 positions, 0 pads
    assert padding_fraction([[0, 1]], [1, 3], [2, 2]) == pytest.approx(2 / 14)
    assert padding_fraction([[0], [1]], [1, 3], [2, 2]) == 0.0


def test_bucketing_pads_less_than_random_batches() -> None:
    src, tgt = random_lengths(1000, seed=1)
    bucketed = token_budget_batches(src, tgt, 400, shuffle=True, seed=1, epoch=0)
    order = list(range(1000))
    random.Random(0).shuffle(order)
    k = len(bucketed)
    unsorted = [order[j * 1000 // k : (j + 1) * 1000 // k] for j in range(k)]  # same number of batches
    assert padding_fraction(bucketed, src, tgt) == pytest.approx(pad_share(bucketed, src, tgt))
    assert padding_fraction(unsorted, src, tgt) == pytest.approx(pad_share(unsorted, src, tgt))
    assert pad_share(bucketed, src, tgt) < 0.15 < 0.3 < pad_share(unsorted, src, tgt)
