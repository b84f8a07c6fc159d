"""Greedy search with its loop in TorchScript (qkv.decoding.scripted) against the eager loop
(qkv.decoding.greedy): the same tokens and the same scores on random models of several
architectures and on the fixture checkpoints, where it applies and where it falls back."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

import qkv
from qkv.config import EOS, MODEL_PRESETS, DecodeConfig
from qkv.decoding import scripted
from qkv.decoding.batch import decode_sentences
from qkv.decoding.compiled import CompiledDecoder
from qkv.decoding.greedy import greedy, greedy_scored
from qkv.models.transformer import Transformer

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(seed: int = 0, **kw) -> Transformer:
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], src_vocab_size=40, tgt_vocab_size=40, dropout=0.0,
                              attention_dropout=0.0, **kw)
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def sources(n: int = 6, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (n, 9), generator=g)
    for i in range(n):  # padded rows of several lengths
        src[i, 3 + i % 6:] = 0
        src[i, 2 + i % 6] = EOS
    return src


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"positional": "learned"}, {"activation": "gelu"},
                                {"share_embeddings": False, "tie_output": False}])
def test_scripted_loop_gives_the_eager_tokens_and_scores(kw):
    """Per-row limits, min_len, banned ids, rows ending at several steps (dropped from the batch as
    in the eager loop; the fixture checkpoints below end on their own EOS): token for token, and
    the float64 sums of log-probabilities bit for bit (the traced
    step runs the eager step's operations on the same tensors)."""
    m = tiny(**kw)
    src = sources()
    limit = torch.tensor([12, 3, 7, 0, 9, 5])
    for min_len, banned in [(0, (0, 1, 2)), (4, (0, 1, 2, 7, 9))]:
        eager, eager_lp = greedy_scored(m, src, limit, min_len, banned=banned)
        tokens, lp = greedy_scored(m, src, limit, min_len, banned=banned, scripted=True)
        assert tokens == eager
        assert lp == eager_lp
        assert greedy(m, src, limit, min_len, banned=banned, scripted=True) == eager
        assert all(len(t) <= n for t, n in zip(tokens, limit.tolist())) and len(tokens[3]) == 0
        assert all(len(t) >= min(min_len, n) for t, n in zip(tokens, limit.tolist()))
        assert not any(set(t) & set(banned) for t in tokens)
    assert len({len(t) for t in eager}) >= 3  # rows ended at several steps, each dropped from the batch then
    assert m in scripted._loops  # the scripted loop ran, not the fallback


def test_one_trace_serves_every_batch_size_and_length():
    """The step is traced once at batch 2; batches of 1 and 9 rows and longer outputs decode the same."""
    m = tiny(3)
    for n, limit in [(1, 20), (9, 6), (2, 30)]:
        src = sources(n, seed=n)
        assert greedy(m, src, limit, scripted=True) == greedy(m, src, limit)
    assert len(scripted._loops) >= 1


def test_weights_changed_in_place_or_replaced_are_followed():
    """The loop shares the model's parameters: an in-place update (an optimizer step) is decoded
    with at once; parameters given new storage are traced anew."""
    m = tiny(4)
    src = sources(3)
    assert greedy(m, src, 8, scripted=True) == greedy(m, src, 8)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(-1.3)
    assert greedy(m, src, 8, scripted=True) == greedy(m, src, 8)
    old = scripted._loops[m][1]
    m.double()
    assert greedy(m, src, 8, scripted=True) == greedy(m, src, 8)
    assert scripted._loops[m][1] is not old


def test_building_and_running_warn_nothing():
    """torch.jit's deprecation warnings are silenced where the loop is built; running it warns nothing."""
    m = tiny(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        greedy(m, sources(2), 5, scripted=True)
        greedy(m, sources(2), 5, scripted=True)
    assert not caught, [str(w.message) for w in caught]


def test_where_it_does_not_apply_the_eager_loop_decodes():
    m = tiny(6)
    assert scripted.scripted_greedy_applies(m)
    assert not scripted.scripted_greedy_applies(tiny(6).train())
    assert not scripted.scripted_greedy_applies(CompiledDecoder(m, compile=False))
    from qkv.frontends.quantize import quantize_int8

    assert not scripted.scripted_greedy_applies(quantize_int8(tiny(6), min_weights=0))
    lstm = dataclasses.replace(MODEL_PRESETS["tiny"], arch="lstm", src_vocab_size=40, tgt_vocab_size=40)
    from qkv.models import build_model

    assert not scripted.scripted_greedy_applies(build_model(lstm).eval())
    # drop_finished=False (the benchmark's naive loop) and the static step run eagerly, same tokens
    src = sources(3)
    ref = greedy(m, src, 6)
    assert greedy(m, src, 6, drop_finished=False, scripted=True) == ref
    assert greedy(CompiledDecoder(m, compile=False), src, 6, scripted=True) == ref


@pytest.mark.parametrize("checkpoint", [FIXTURES / "default-task", FIXTURES / "checkpoints" / "translate-transformer"])
def test_fixture_checkpoints_translate_the_same(checkpoint):
    """Through the translator (decode_sentences, batches of 1 and 5): the texts, scores and
    log-probabilities of the eager loop (``scripted_greedy=False``)."""
    tr = qkv.load(checkpoint)
    if checkpoint.name == "default-task":
        sentences = ["three hundred twenty-one", "seven", "forty-two", "nine thousand nine hundred ninety-nine",
                     "one hundred and five", "eighty", "two thousand", "sixteen", "five hundred", "ninety-one"]
    else:
        sentences = ["hello world", "a b c d", "the cat", "", "zz", "one two three four five six",
                     "x", "the dog runs", "hello", "a"]
    for batch_size in (1, 5):
        on = tr.translate_scored(sentences, beam_size=1, batch_size=batch_size)
        off = tr.translate_scored(sentences, beam_size=1, batch_size=batch_size, scripted_greedy=False)
        assert on == off
        assert tr.translate(sentences, beam_size=1, batch_size=batch_size) == [nb[0][0] for nb in off]
    assert tr.model in scripted._loops


def test_decode_sentences_asks_for_it_unless_turned_off(monkeypatch):
    m = tiny(7)
    calls = []
    real = scripted.scripted_greedy
    monkeypatch.setattr(scripted, "scripted_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = [[5, 6, 7], [8, 9]]
    on = decode_sentences(m, ids, DecodeConfig(beam_size=1))
    assert len(calls) == 1
    off = decode_sentences(m, ids, DecodeConfig(beam_size=1, scripted_greedy=False))
    assert len(calls) == 1
    assert [h[0].tokens for h in on] == [h[0].tokens for h in off]
    assert [h[0].logprob for h in on] == [h[0].logprob for h in off]


def test_benchmark_quick(tmp_path):
    """benchmarks/decode_loop.py --quick end to end: both loops timed at batch 1 and 32, outputs equal."""
    import json
    import subprocess
    import sys

    src = tmp_path / "src.txt"
    src.write_text("seven\nforty-two\nthree hundred twenty-one\nnine thousand\n", encoding="utf-8")
    out = tmp_path / "loop.json"
    script = Path(__file__).parents[1] / "benchmarks" / "decode_loop.py"
    proc = subprocess.run([sys.executable, str(script), str(FIXTURES / "default-task"), "--test", str(src), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["identical"] and res["sentences"] == 4 and res["rounds"] == 1
    for b in ("1", "32"):
        cell = res["cells"][b]
        assert cell["tokens_differ"] == 0 and cell["logprobs_equal"] == 4
        assert len(cell["eager_s"]) == len(cell["scripted_s"]) == 1 and cell["scripted_median_s"] > 0
