"""Tests for qkv.decoding on hand-built probability tables (in the style of OpenNMT-py's
tests/test_beam_search.py): a fake model whose next-token distribution is a table lookup on
(sentence id, prefix), so every expected result below can be computed by hand."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import Tensor

from qkv.config import BOS, EOS, PAD, UNK, DecodeConfig
from qkv.decoding import Hypothesis, beam_search, greedy, max_output_len
from qkv.decoding.beam_search import length_penalty
from qkv.errors import ConfigError

A, B, C = 4, 5, 6  # ordinary tokens
V = 7  # vocabulary: PAD UNK BOS EOS A B C

Table = Callable[[int, tuple[int, ...]], Tensor]  # (sentence id, prefix without BOS) -> logits (V,)


@dataclass
class FakeState:
    prefixes: Tensor  # (N, t) tokens fed so far, BOS first
    sent: Tensor  # (N,) sentence id of each row

    def reorder(self, indices: Tensor) -> "FakeState":
        return FakeState(self.prefixes[indices], self.sent[indices])


class TableModel:
    """start/step/reorder over a table; src[:, 0] is the sentence id. Records step batch sizes."""

    def __init__(self, table: Table):
        self.table = table
        self.batch_sizes: list[int] = []

    def start(self, src: Tensor) -> FakeState:
        return FakeState(torch.empty((src.size(0), 0), dtype=torch.long), src[:, 0].clone())

    def step(self, tokens: Tensor, state: FakeState) -> tuple[Tensor, FakeState]:
        self.batch_sizes.append(tokens.size(0))
        prefixes = torch.cat([state.prefixes, tokens.unsqueeze(1)], dim=1)  # (N, t+1)
        logits = torch.stack(
            [self.table(int(s), tuple(p[1:].tolist())) for s, p in zip(state.sent, prefixes)]
        )
        return logits, FakeState(prefixes, state.sent)


def dist(probs: dict[int, float]) -> Tensor:
    """Logits whose softmax is exactly ``probs`` (missing tokens get probability 0)."""
    p = torch.zeros(V, dtype=torch.float64)
    for tok, prob in probs.items():
        p[tok] = prob
    return p.log().float()


def src_of(sent_ids: list[int]) -> Tensor:
    return torch.tensor([[s, EOS] for s in sent_ids])


def random_table(seed: int, eos_bias: float = 0.4) -> Table:
    """Tie-free random logits, a deterministic function of (seed, sentence, prefix);
    EOS gets likelier with length so that sentences end at different steps."""

    def table(sent: int, prefix: tuple[int, ...]) -> Tensor:
        rng = random.Random(hash((seed, sent) + prefix))
        logits = torch.tensor([rng.gauss(0.0, 2.0) for _ in range(V)])
        logits[EOS] += eos_bias * len(prefix)
        return logits

    return table


def table_logprob(table: Table, sent: int, tokens: list[int]) -> float:
    """Independent scorer: sum of the model's log p over tokens + EOS (softmax over all V)."""
    total = 0.0
    for t, tok in enumerate(tokens + [EOS]):
        logits = table(sent, tuple(tokens[:t])).double()
        total += float(torch.log_softmax(logits, dim=0)[tok])
    return total


# --- the hand-computed cases -----------------------------------------------------------------------


def greedy_trap(sent: int, prefix: tuple[int, ...]) -> Tensor:
    """p(A)=.5 p(B)=.4 p(EOS)=.1 first; after A: EOS .4, A .35, B .25; after B: EOS .9, A .06, B .04."""
    table = {
        (): {A: 0.5, B: 0.4, EOS: 0.1},
        (A,): {EOS: 0.4, A: 0.35, B: 0.25},
        (B,): {EOS: 0.9, A: 0.06, B: 0.04},
    }
    return dist(table.get(prefix, {EOS: 1.0}))


def test_beam_finds_sequence_greedy_misses():
    # Greedy: A (.5), then EOS (.4): P(A EOS) = .5 * .4 = .20.
    # Beam 2, step 0: live A (.5), B (.4); EOS (.1) ranks 3rd of the 2k=4 candidates: not kept.
    # Step 1 candidates: B EOS = .4*.9 = .36, A EOS = .5*.4 = .20, A A = .175, A B = .125, ...
    # The top k=2 are both EOS -> 2 finished -> done. Best: [B] with P = .36 > .20.
    model = TableModel(greedy_trap)
    assert greedy(model, src_of([0]), torch.tensor([5])) == [[A]]
    model = TableModel(greedy_trap)
    [[best]] = beam_search(model, src_of([0]), 2, 0.0, torch.tensor([5]), nbest=1)
    assert model.batch_sizes == [2, 2]  # stopped after step 1 (k finished), not at max_len 5
    assert best.tokens == [B]
    assert best.logprob == pytest.approx(math.log(0.36), abs=1e-5)
    assert best.score == pytest.approx(math.log(0.36), abs=1e-5)  # alpha = 0: lp = 1


def length_trap(sent: int, prefix: tuple[int, ...]) -> Tensor:
    table = {
        (): {A: 0.6, B: 0.4},
        (A,): {EOS: 0.55, C: 0.45},
        (B,): {C: 0.9, EOS: 0.1},
        (B, C): {EOS: 0.9, C: 0.1},
        (A, C): {EOS: 0.6, C: 0.4},
    }
    return dist(table.get(prefix, {EOS: 1.0}))


# Beam 2 on length_trap (the search itself does not depend on alpha):
#   step 0: live A (.6), B (.4)
#   step 1: B C = .36, A EOS = .33, A C = .27, B EOS = .04 -> finished [A] (P .33); live B C, A C
#   step 2: B C EOS = .324, A C EOS = .162, A C C = .108, B C C = .036
#           -> finished [B C] (P .324); 2 finished -> done.
#   alpha = 0: log .33 = -1.10866 > log .324 = -1.12701          -> [A] wins
#   alpha = 1: lp(|[A] EOS|=2) = 7/6, lp(|[B C] EOS|=3) = 8/6
#              -1.10866 * 6/7 = -0.95028 < -1.12701 * 6/8 = -0.84526 -> [B C] wins
def test_length_penalty_changes_winner():
    [[short]] = beam_search(TableModel(length_trap), src_of([0]), 2, 0.0, torch.tensor([10]))
    [[long]] = beam_search(TableModel(length_trap), src_of([0]), 2, 1.0, torch.tensor([10]))
    assert short.tokens == [A]
    assert long.tokens == [B, C]


def test_nbest_order_and_scores():
    hyps = beam_search(TableModel(length_trap), src_of([0]), 2, 1.0, torch.tensor([10]), nbest=2)[0]
    assert [h.tokens for h in hyps] == [[B, C], [A]]
    assert hyps[0].logprob == pytest.approx(-1.1270118, abs=1e-5)  # log .324
    assert hyps[0].score == pytest.approx(-0.8452589, abs=1e-5)  # log .324 * 6/8
    assert hyps[1].logprob == pytest.approx(-1.1086626, abs=1e-5)  # log .33
    assert hyps[1].score == pytest.approx(-0.9502822, abs=1e-5)  # log .33 * 6/7
    assert all(isinstance(h, Hypothesis) for h in hyps)


def test_length_penalty_formula():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)  # (5+1)/6 = 1
    assert length_penalty(7, 1.0) == pytest.approx(2.0)  # 12/6
    assert length_penalty(10, 0.5) == pytest.approx(math.sqrt(2.5))  # sqrt(15/6)
    assert length_penalty(123, 0.0) == 1.0
    assert torch.allclose(length_penalty(torch.tensor([1.0, 7.0]), 1.0), torch.tensor([1.0, 2.0]))


def test_max_output_len():
    assert max_output_len(torch.tensor([3, 10]), 1.0, 50).tolist() == [53, 60]
    assert max_output_len(torch.tensor([3, 10]), 1.5, 2).tolist() == [6, 17]  # floor(6.5), 17


# --- EOS handling and max_len -------------------------------------------------------------------


def never_ends(sent: int, prefix: tuple[int, ...]) -> Tensor:
    """EOS almost never: A .6, B .39, EOS .01 after every prefix."""
    return dist({A: 0.6, B: 0.39, EOS: 0.01})


def test_max_len_forces_eos():
    # Greedy emits A until the budget, then EOS is forced.
    max_len = torch.tensor([3, 0, 1])
    assert greedy(TableModel(never_ends), src_of([0, 1, 2]), max_len) == [[A, A, A], [], [A]]
    # Beam: the forced EOS is scored with the model's own p(EOS) = .01.
    hyps = beam_search(TableModel(never_ends), src_of([0, 1, 2]), 2, 0.6, max_len, nbest=2)
    assert hyps[0][0].tokens == [A, A, A]
    assert hyps[0][0].logprob == pytest.approx(3 * math.log(0.6) + math.log(0.01), abs=1e-4)
    assert hyps[0][0].score == pytest.approx(hyps[0][0].logprob / (9 / 6) ** 0.6, abs=1e-4)
    assert all(len(h.tokens) == 3 for h in hyps[0])
    assert [h.tokens for h in hyps[1]] == [[]]  # max_len 0: only beam 0 is live at step 0
    assert hyps[1][0].logprob == pytest.approx(math.log(0.01), abs=1e-5)
    assert [h.tokens for h in hyps[2]] == [[A], [B]]


def test_eos_ends_early_and_is_not_returned():
    # After A: EOS is certain, so greedy stops at 1 token even with a large budget.
    table = lambda s, p: dist({A: 0.7, B: 0.3}) if p == () else dist({EOS: 1.0})  # noqa: E731
    assert greedy(TableModel(table), src_of([0]), torch.tensor([50])) == [[A]]
    hyps = beam_search(TableModel(table), src_of([0]), 2, 0.6, torch.tensor([50]), nbest=2)[0]
    assert [h.tokens for h in hyps] == [[A], [B]]
    assert [h.logprob for h in hyps] == pytest.approx([math.log(0.7), math.log(0.3)], abs=1e-5)


def test_special_tokens_are_never_emitted():
    """PAD, UNK and BOS (the default ``banned``) and any id passed in ``banned`` are never emitted,
    however likely; the scores keep the model's own probabilities (no renormalisation)."""
    table = lambda s, p: dist({PAD: 0.3, BOS: 0.2, UNK: 0.2, A: 0.15, B: 0.1, EOS: 0.05})  # noqa: E731
    assert greedy(TableModel(table), src_of([0]), torch.tensor([2])) == [[A, A]]
    assert greedy(TableModel(table), src_of([0]), torch.tensor([2]), banned=(PAD, UNK, BOS, A)) == [[B, B]]
    hyps = beam_search(TableModel(table), src_of([0]), 3, 0.0, torch.tensor([2]), nbest=3, banned=(PAD, UNK, BOS, A))[0]
    # Only B (.1) and EOS (.05) may be emitted. EOS always ranks 2nd of the live candidates (< k), so
    # it finishes each step: [] = .05, [B] = .1 * .05 = .005, [B B] = .1 * .1 * .05 = .0005 (EOS
    # forced at max_len 2).
    assert [h.tokens for h in hyps] == [[], [B], [B, B]]
    expected = [math.log(0.05), math.log(0.005), math.log(0.0005)]
    assert [h.logprob for h in hyps] == pytest.approx(expected, abs=1e-5)
    default = beam_search(TableModel(table), src_of([0]), 3, 0.0, torch.tensor([2]), nbest=3)[0]
    assert {t for h in default for t in h.tokens} == {A, B}


# --- batching, pruning and agreement between decoders -------------------------------------------------


def test_finished_sentences_are_pruned():
    # Sentence 0 has max_len 0: forced to finish at step 0, then only sentence 1's rows run.
    model = TableModel(never_ends)
    beam_search(model, src_of([0, 1]), 2, 0.0, torch.tensor([0, 4]))
    assert model.batch_sizes == [4, 2, 2, 2, 2]  # (B*k)=4 rows, then 1 sentence * k=2
    model = TableModel(never_ends)
    greedy(model, src_of([0, 1]), torch.tensor([0, 4]))
    assert model.batch_sizes == [2, 1, 1, 1, 1]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_size_one_equals_greedy(alpha: float):
    table = random_table(seed=1, eos_bias=0.3)
    ids, max_len = list(range(12)), torch.tensor([6, 1, 0, 9, 4, 7, 3, 8, 2, 5, 9, 6])
    expected = greedy(TableModel(table), src_of(ids), max_len)
    hyps = beam_search(TableModel(table), src_of(ids), 1, alpha, max_len)
    assert [h[0].tokens for h in hyps] == expected
    for sent, h in zip(ids, hyps):
        assert h[0].logprob == pytest.approx(table_logprob(table, sent, h[0].tokens), abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_batched_equals_one_by_one(beam_size: int):
    table = random_table(seed=2)
    ids, max_len = [0, 1, 2, 3, 4, 5], torch.tensor([1, 4, 7, 2, 6, 0])
    model = TableModel(table)
    batched = beam_search(model, src_of(ids), beam_size, 0.6, max_len, nbest=beam_size)
    # pruning: rows only ever shrink, by whole sentences
    assert model.batch_sizes[0] == len(ids) * beam_size
    assert all(a >= b for a, b in zip(model.batch_sizes, model.batch_sizes[1:]))
    assert all(n % beam_size == 0 for n in model.batch_sizes)
    assert model.batch_sizes[-1] < model.batch_sizes[0]
    greedy_batched = greedy(TableModel(table), src_of(ids), max_len)
    for i, sent in enumerate(ids):
        one = max_len[i : i + 1]
        single = beam_search(TableModel(table), src_of([sent]), beam_size, 0.6, one, nbest=beam_size)[0]
        assert [h.tokens for h in batched[i]] == [h.tokens for h in single]
        assert [h.score for h in batched[i]] == pytest.approx([h.score for h in single], abs=1e-5)
        assert greedy_batched[i] == greedy(TableModel(table), src_of([sent]), one)[0]
        for h in batched[i]:
            assert len(h.tokens) <= int(max_len[i])
            assert h.logprob == pytest.approx(table_logprob(table, sent, h.tokens), abs=1e-4)
            assert h.score == pytest.approx(h.logprob / ((5 + len(h.tokens) + 1) / 6) ** 0.6, abs=1e-5)


def test_wide_beam_is_exhaustive():
    # With k at least the number of possible outputs, beam search finishes every sequence:
    # compare with brute-force enumeration over {A, B, C}^<=2 + EOS (1 + 3 + 9 = 13; UNK is never emitted).
    table = random_table(seed=3, eos_bias=0.0)
    tokens = [A, B, C]
    outputs = [list(seq) for n in range(3) for seq in itertools.product(tokens, repeat=n)]
    scored = sorted(
        ((table_logprob(table, 0, y) / ((5 + len(y) + 1) / 6) ** 0.6, y) for y in outputs), reverse=True
    )
    hyps = beam_search(TableModel(table), src_of([0]), 13, 0.6, torch.tensor([2]), nbest=13)[0]
    assert [h.tokens for h in hyps] == [y for _, y in scored]
    assert [h.score for h in hyps] == pytest.approx([s for s, _ in scored], abs=1e-4)


def test_int_max_len_and_bad_arguments():
    assert greedy(TableModel(never_ends), src_of([0, 1]), 2) == [[A, A], [A, A]]
    with pytest.raises(ConfigError, match="nbest"):
        beam_search(TableModel(never_ends), src_of([0]), 2, 0.6, 3, nbest=3)
    with pytest.raises(ConfigError, match="beam_size"):
        beam_search(TableModel(never_ends), src_of([0]), 0, 0.6, 3)
    assert beam_search(TableModel(never_ends), src_of([]).view(0, 2), 2, 0.6, 3) == []


def test_early_poor_finishers_do_not_cut_off_the_best_hypothesis():
    """Regression: with fairseq's rule (stop once k hypotheses have finished) the empty
    hypothesis (step 0) and [B] (step 1) fill a beam of 2 while the best hypothesis [A A] is
    still live; it must be found.

        P([])    = 0.3                 log = -1.204
        P([B])   = 0.1 * 1.0   = 0.10  log = -2.303
        P([A])   = 0.6 * 0.1   = 0.06  log = -2.813
        P([A A]) = 0.6 * 0.9 * 1.0 = 0.54  log = -0.616   <- the best
    """

    def table(sent: int, prefix: tuple[int, ...]) -> Tensor:
        if prefix == ():
            return dist({A: 0.6, EOS: 0.3, B: 0.1})
        if prefix == (A,):
            return dist({A: 0.9, EOS: 0.1})
        return dist({EOS: 1.0})

    hyps = beam_search(TableModel(table), src_of([0]), 2, 0.0, 10, nbest=2)[0]
    assert hyps[0].tokens == [A, A]
    assert hyps[0].logprob == pytest.approx(math.log(0.54), abs=1e-5)
    assert hyps[1].tokens == [] and hyps[1].logprob == pytest.approx(math.log(0.3), abs=1e-5)


def poor_finishers(sent: int, prefix: tuple[int, ...]) -> Tensor:
    """The table of the test above."""
    if prefix == ():
        return dist({A: 0.6, EOS: 0.3, B: 0.1})
    if prefix == (A,):
        return dist({A: 0.9, EOS: 0.1})
    return dist({EOS: 1.0})


def test_early_stopping_is_fairseqs_rule():
    """early_stopping=True: done as soon as k hypotheses have finished, as fairseq does. On the
    table above, beam 2: step 0 finishes [] (rank 2 of the top 2); step 1's top 2 are A A (.54) and
    B EOS (.10), so [B] finishes and the sentence is done with [] and [B]; [A A] is never finished."""
    model = TableModel(poor_finishers)
    hyps = beam_search(model, src_of([0]), 2, 0.0, 10, nbest=2, early_stopping=True)[0]
    assert model.batch_sizes == [2, 2]  # two steps, then done
    assert [h.tokens for h in hyps] == [[], [B]]
    assert [h.logprob for h in hyps] == pytest.approx([math.log(0.3), math.log(0.1)], abs=1e-5)


def test_early_stopping_keeps_the_first_k_to_finish():
    """Beam 2, early stopping, alpha 0. Step 0: A (.6), EOS (.25), B (.15): [] finishes (rank 2).
    Step 1: A A (.33), A C (.27), B EOS (.15, rank 3: not finished). Step 2: A A EOS (.33) and
    A C EOS (.27) both finish, but one slot is left: fairseq takes the higher-ranked, [A A], and
    the sentence is done with [A A] and [] (.25), although [A C] beats []. The default rule keeps
    the 2 best: [A A] and [A C]."""

    def table(sent: int, prefix: tuple[int, ...]) -> Tensor:
        if prefix == ():
            return dist({A: 0.6, EOS: 0.25, B: 0.15})
        if prefix == (A,):
            return dist({A: 0.55, C: 0.45})
        return dist({EOS: 1.0})

    hyps = beam_search(TableModel(table), src_of([0]), 2, 0.0, 10, nbest=2, early_stopping=True)[0]
    assert [h.tokens for h in hyps] == [[A, A], []]
    assert [h.logprob for h in hyps] == pytest.approx([math.log(0.33), math.log(0.25)], abs=1e-5)
    hyps = beam_search(TableModel(table), src_of([0]), 2, 0.0, 10, nbest=2)[0]
    assert [h.tokens for h in hyps] == [[A, A], [A, C]]
    assert [h.logprob for h in hyps] == pytest.approx([math.log(0.33), math.log(0.27)], abs=1e-5)


def test_length_norm_divides_by_the_length_to_the_alpha():
    """length_norm="length": lp = |Y| ** alpha, |Y| counting EOS (fairseq's --lenpen). On
    length_trap with alpha 1: [A] scores log(.33) / 2 = -0.55433, [B C] log(.324) / 3 = -0.37567."""
    hyps = beam_search(TableModel(length_trap), src_of([0]), 2, 1.0, 10, nbest=2, length_norm="length")[0]
    assert [h.tokens for h in hyps] == [[B, C], [A]]
    assert [h.score for h in hyps] == pytest.approx([math.log(0.324) / 3, math.log(0.33) / 2], abs=1e-5)
    hyps = beam_search(TableModel(length_trap), src_of([0]), 2, 0.5, 10, nbest=2, length_norm="length")[0]
    assert [h.score for h in hyps] == pytest.approx([math.log(0.324) / 3 ** 0.5, math.log(0.33) / 2 ** 0.5],
                                                    abs=1e-5)
    with pytest.raises(ConfigError, match="length_norm"):
        beam_search(TableModel(length_trap), src_of([0]), 2, 1.0, 10, length_norm="fairseq")
    with pytest.raises(ConfigError, match="length_norm"):
        DecodeConfig(length_norm="fairseq").validate()


@pytest.mark.parametrize("beam", [1, 3])
def test_min_len_blocks_eos_until_reached(beam):
    """EOS is by far the likeliest token, yet no output is shorter than min_len."""

    def table(sent: int, prefix: tuple[int, ...]) -> Tensor:
        return dist({EOS: 0.7, A: 0.2, B: 0.1})

    model = TableModel(table)
    if beam == 1:
        out = greedy(model, src_of([0, 1]), 9, min_len=4)
        assert out == [[A, A, A, A], [A, A, A, A]]
    else:
        hyps = beam_search(model, src_of([0]), beam, 0.0, 9, nbest=1, min_len=4)[0]
        assert hyps[0].tokens == [A, A, A, A]
        assert hyps[0].logprob == pytest.approx(4 * math.log(0.2) + math.log(0.7), abs=1e-5)
    # max_len below min_len: max_len wins (EOS forced at the limit)
    assert greedy(TableModel(table), src_of([0]), 2, min_len=4) == [[A, A]]


@pytest.mark.parametrize("beam", [1, 3])
def test_drop_finished_false_gives_the_same_results(beam):
    """drop_finished=False (kept only so benchmarks/means.py can measure the saving) keeps every
    row in the batch to the end, and changes nothing in the output."""
    table = random_table(seed=4)
    ids, max_len = list(range(8)), torch.tensor([0, 5, 2, 9, 1, 7, 3, 6])
    dropping, keeping = TableModel(table), TableModel(table)
    if beam == 1:
        assert greedy(keeping, src_of(ids), max_len, drop_finished=False) == greedy(dropping, src_of(ids), max_len)
    else:
        expected = beam_search(dropping, src_of(ids), beam, 0.6, max_len, nbest=beam)
        got = beam_search(keeping, src_of(ids), beam, 0.6, max_len, nbest=beam, drop_finished=False)
        assert got == expected  # tokens, scores and log-probs
    assert set(keeping.batch_sizes) == {len(ids) * beam}  # no row ever dropped
    assert dropping.batch_sizes[-1] < len(ids) * beam
    assert len(keeping.batch_sizes) == len(dropping.batch_sizes)  # same number of steps


def test_greedy_choice_is_the_argmax_of_the_masked_log_probs():
    """greedy picks from the raw logits: the same token as argmax(force_eos(log_probs(logits)))."""
    from qkv.decoding.greedy import force_eos, greedy_choice, log_probs

    torch.manual_seed(0)
    for before_min_len in (False, True):
        logits = torch.randn(50, 12) * 3
        logits[:10, 0] = 100.0  # PAD would win, must not be chosen
        logits[10:20, 2] = 100.0  # BOS likewise
        logits[20:30, 3] = 100.0  # EOS wins unless before min_len
        at_limit = torch.rand(50) < 0.3
        want = force_eos(log_probs(logits), at_limit, before_min_len).argmax(-1)
        got = greedy_choice(logits.clone(), at_limit, before_min_len)
        assert torch.equal(got, want)
        assert not torch.isin(got, torch.tensor([0, 2])).any()


# --- special tokens: never emitted, from any checkpoint ----------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
SPECIAL_TEXT = ("<cls>", "[MASK]", "<sep>", "<unk>", "<pad>", "<s>", "\u2047")  # \u2047: how UNK decodes


class FavouringSpecials(torch.nn.Module):
    """A model whose step adds ``boost`` to the logits of ``ids``: unmasked, they would win every step."""

    def __init__(self, model: torch.nn.Module, ids: list[int], boost: float):
        super().__init__()
        self.model, self.ids, self.boost, self.cfg = model, ids, boost, model.cfg

    def start(self, src):
        return self.model.start(src)

    def step(self, tokens, state):
        logits, state = self.model.step(tokens, state)
        logits = logits.clone()
        logits[:, self.ids] += self.boost
        return logits, state

    def max_source_len(self):
        return self.model.max_source_len()

    def max_steps(self, src_lengths):
        return self.model.max_steps(src_lengths)


def random_weights_favouring_specials(name: str, boost: float):
    """The fixture checkpoint ``name`` with random weights and every special id but EOS boosted."""
    import qkv

    frontend = qkv.load(FIXTURES / name)
    torch.manual_seed(0)
    for p in frontend.model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    specials = [i for i in range(frontend.tokenizers.tgt.vocab_size) if i != EOS and
                (i in (PAD, UNK, BOS) or frontend.tokenizers.tgt.id_to_piece(i) in SPECIAL_TEXT)]
    frontend.model = FavouringSpecials(frontend.model, specials, boost)
    return frontend, specials


@pytest.mark.parametrize("name", ["translate-transformer", "translate-lstm-general", "prefix_lm-transformer"])
@pytest.mark.parametrize("beam", [1, 4])
def test_translators_never_emit_special_tokens(name, beam):
    model, specials = random_weights_favouring_specials(name, boost=5.0)
    assert len(specials) == (6 if name.startswith("prefix_lm") else 3)  # PAD UNK BOS (+ <cls> [MASK] <sep>)
    sources = ["red cat", "the big dog sun", "small tree", "blue"] * 3
    hyps = model.hypotheses(sources, beam_size=beam, nbest=beam, max_len_b=20)
    tokens = [t for nbest in hyps for h in nbest for t in h.tokens]
    assert len(tokens) > 40  # outputs, not just EOS: EOS is not favoured
    assert not set(tokens) & set(specials)
    for text, _ in (pair for nbest in model.translate_scored(sources, beam_size=beam, nbest=beam) for pair in nbest):
        assert not any(s in text for s in SPECIAL_TEXT), text


@pytest.mark.parametrize("name", ["lm-transformer", "lm-lstm"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_language_models_never_sample_special_tokens(name, temperature):
    """Sampled (and greedy, temperature 0) text from a random-weight LM has no special piece in it;
    the boost makes them the likeliest tokens, so unmasked, most of the 300 would be special."""
    from qkv.decoding import banned_ids
    from qkv.decoding.sampling import sample

    model, specials = random_weights_favouring_specials(name, boost=3.0)
    assert len(specials) == 6
    text = "".join(model.generate("red cat", 300, temperature=temperature, seed=1))
    assert not any(s in text for s in SPECIAL_TEXT), text
    banned = banned_ids(model.tokenizer)
    ids = list(sample(model.model, model.prompt_ids("red cat"), 300, temperature, seed=2, banned=banned))
    assert len(ids) == 300 and not set(ids) & set(specials)
