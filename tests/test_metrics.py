import math

import pytest

from qkv.errors import QkvError
from qkv.metrics import Score, bleu, chrf, exact_match, perplexity


def test_identical_is_100():
    hyps = ["the cat sat on the mat .", "a dog barked loudly today"]
    assert bleu(hyps, hyps).score == pytest.approx(100.0)
    assert chrf(hyps, hyps).score == pytest.approx(100.0)


def test_bleu_hand_computed():
    # 1-grams 5/6 ("the" clipped), 2-grams 3/5, 3-grams 2/4, 4-grams 1/3, equal lengths: BP = 1.
    s = bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert s.score == pytest.approx(expected, abs=1e-6)  # 53.73
    # Brevity penalty: hyp of 4 tokens all matching a 6-token reference, only orders 1..4 -> p_4 = 1/1.
    s = bleu(["the cat sat on"], ["the cat sat on a mat"])
    assert s.score == pytest.approx(100 * math.exp(1 - 6 / 4), abs=1e-6)


def test_bleu_is_cased_and_13a_tokenized():
    assert bleu(["The Cat"], ["the cat"]).score == pytest.approx(0.0)
    assert bleu(["the cat sat on the mat."], ["the cat sat on the mat ."]).score == pytest.approx(100.0)
    assert bleu(["the cat sat on the mat."], ["the cat sat on the mat"]).score < 100.0


def test_chrf_hand_computed():
    # "abcdefg" vs "abcdefh": for n = 1..6 there are 8-n n-grams on each side and 7-n match,
    # so precision = recall = (7-n)/(8-n); chrF averages over n and F_beta of equal P, R is P.
    expected = 100 * sum((7 - n) / (8 - n) for n in range(1, 7)) / 6
    assert chrf(["abcdefg"], ["abcdefh"]).score == pytest.approx(expected, abs=1e-6)  # 73.45


def test_signature_and_text():
    s = bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert isinstance(s, Score)
    assert "nrefs:1" in s.signature and "tok:13a" in s.signature and "case:mixed" in s.signature
    assert s.text().startswith("BLEU = 53.73 ")
    assert s.text().endswith(f"(sacreBLEU signature: {s.signature})")
    assert str(s) == s.text()
    c = chrf(["abc"], ["abd"])
    assert c.text().startswith("chrF2 = ") and "nrefs:1" in c.signature


def test_exact_match():
    assert exact_match(["a b", "c", "d "], ["a b", "x", "d"]) == pytest.approx(2 / 3)


def test_errors_are_clear():
    for fn in (bleu, chrf, exact_match):
        with pytest.raises(QkvError, match="empty"):
            fn([], [])
        with pytest.raises(QkvError, match="3 hypotheses against 2 references"):
            fn(["a", "b", "c"], ["a", "b"])


def test_perplexity():
    assert perplexity(10 * math.log(4.0), 10) == pytest.approx(4.0)
    assert perplexity(1e6, 1) == math.inf
    with pytest.raises(QkvError):
        perplexity(1.0, 0)


def test_bleu_on_lowercased_moses_tokens_is_the_published_multi30k_convention():
    from qkv.metrics import bleu_tok_lc, moses_tokenize

    # tokenizer.perl -l de -a -no-escape, then lowercase: hyphens split as @-@, punctuation split off
    assert moses_tokenize(["Ein Mann, der ein T-Shirt trägt."], "de") == ["ein mann , der ein t @-@ shirt trägt ."]
    hyp, ref = ["Ein Mann fährt ein Fahrrad."], ["ein mann fährt ein fahrrad ."]
    s = bleu_tok_lc(hyp, ref, "de")
    assert s.score == pytest.approx(100.0)
    assert "case:lc" in s.signature and "tok:moses-de-a" in s.signature
    # the cased, detokenized sacreBLEU of the same pair is far lower (case differs on 4 of 6 tokens)
    from qkv.metrics import bleu

    assert bleu(hyp, ref).score < 30


def test_bleu_in_the_published_convention_of_already_tokenized_hypotheses():
    from qkv.metrics import bleu_tok_lc, moses_tokenize

    raw_hyps = ["Ein Mann, der ein T-Shirt trägt.", "Zwei Hunde rennen."]
    refs = ["Ein Mann, der ein rotes T-Shirt trägt.", "Zwei Hunde laufen im Schnee."]
    tokenized = moses_tokenize(raw_hyps, "de")
    # a lowercased model's output (already tokenized) meets the same references as a cased model's
    assert bleu_tok_lc(tokenized, refs, "de", hyps_tokenized=True).score == bleu_tok_lc(raw_hyps, refs, "de").score
    # and is scored as written: not lowercased or tokenized again
    assert bleu_tok_lc(["ein mann fährt ein fahrrad ."], ["Ein Mann fährt ein Fahrrad."], "de",
                       hyps_tokenized=True).score == pytest.approx(100.0)
    assert bleu_tok_lc(["Ein Mann fährt ein Fahrrad."], ["Ein Mann fährt ein Fahrrad."], "de",
                       hyps_tokenized=True).score < 50
