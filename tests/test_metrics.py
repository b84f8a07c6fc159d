import math
from pathlib import Path

import pytest

from qkv.errors import QkvError
from qkv.metrics import Score, bleu, chrf, exact_match, perplexity

MULTI30K = next((p for p in (Path(__file__).resolve().parents[1] / "data" / "multi30k",  # where fetch.py writes
                              Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k") if p.is_dir()),
                Path(__file__).resolve().parents[1] / "data" / "multi30k")


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


def test_quiet_bleu_drops_sacrebleus_tokenized_text_warning_and_keeps_the_score(caplog):
    # sacreBLEU warns once a corpus has 100 lines ending in " ." (tokenized text); training-time
    # validation on tokenized data would print that at every validation.
    hyps = [f"a dog number {i} runs ." for i in range(120)]
    refs = [f"a dog number {i} walks ." for i in range(120)]
    with caplog.at_level("WARNING", logger="sacrebleu"):
        loud = bleu(hyps, refs)
    assert any("forgot to detokenize" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sacrebleu"):
        quiet = bleu(hyps, refs, quiet=True)
    assert not [r for r in caplog.records if "detokenize" in r.getMessage()]
    assert quiet.score == pytest.approx(loud.score) and 0 < quiet.score < 100


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

    # the dataset's lc.norm.tok steps: lowercase, normalize punctuation, tokenizer.perl -l de (no -a:
    # the hyphenated word stays whole), without XML escaping
    assert moses_tokenize(["Ein Mann, der ein T-Shirt trägt."], "de") == ["ein mann , der ein t-shirt trägt ."]
    assert moses_tokenize(["Eine Frau in „Straßenkleidung“ tanzt."], "de") == \
        ['eine frau in " straßenkleidung " tanzt .']  # German quotes normalized to "
    hyp, ref = ["Ein Mann fährt ein Fahrrad."], ["ein mann fährt ein fahrrad ."]
    s = bleu_tok_lc(hyp, ref, "de")
    assert s.score == pytest.approx(100.0)
    assert "case:lc" in s.signature and "tok:lc.norm.tok-de" in s.signature
    # the cased, detokenized sacreBLEU of the same pair is far lower (case differs on 4 of 6 tokens)
    from qkv.metrics import bleu

    assert bleu(hyp, ref).score < 30


def test_the_published_convention_reproduces_the_published_reference_length():
    """The published En→De score (Revisit-MMT's Transformer-tiny, 41.02) reports reflen=12103 for
    test_2016_flickr.de: the tokenization without -a gives exactly that; with -a it gives 12,243."""
    from qkv.data.corpus import read_lines
    from qkv.metrics import moses_tokenize

    path = MULTI30K / "test_2016_flickr.de.gz"
    if not path.exists():
        pytest.skip(f"{path} is missing: the Multi30k data set is needed for this check (recipes/multi30k/fetch.py)")
    assert sum(len(line.split()) for line in moses_tokenize(read_lines(path), "de")) == 12103


def test_bleu_in_the_published_convention_of_already_tokenized_hypotheses():
    from sacremoses import MosesTokenizer

    from qkv.metrics import bleu_tok_lc

    raw_hyps = ["Ein Mann, der ein T-Shirt trägt.", "Zwei Hunde rennen."]
    refs = ["Ein Mann, der ein rotes T-Shirt trägt.", "Zwei Hunde laufen im Schnee."]
    # a lowercased model trained on text tokenized with -a writes "t @-@ shirt"
    tok = MosesTokenizer(lang="de")
    tokenized = [tok.tokenize(h, aggressive_dash_splits=True, escape=False, return_str=True).lower()
                 for h in raw_hyps]
    assert "t @-@ shirt" in tokenized[0]
    # it meets the same references, in the same form, as a cased model's raw output
    assert bleu_tok_lc(tokenized, refs, "de", hyps_tokenized=True).score == bleu_tok_lc(raw_hyps, refs, "de").score
    one = (["ein mann , der ein t @-@ shirt trägt ."], ["Ein Mann, der ein T-Shirt trägt."])
    assert bleu_tok_lc(*one, "de", hyps_tokenized=True).score == pytest.approx(100.0)
    # scored as raw text, the @-@ would not be merged back and the 4-grams around it would miss
    assert bleu_tok_lc(*one, "de").score < 60


def test_tokenized_bleu_with_compound_splitting_is_the_papers_wmt_convention():
    """The Transformer paper's WMT 2014 convention (tensor2tensor's get_ende_bleu.sh): tokenizer.perl -l de
    on cased text, then s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g, then multi-bleu.perl."""
    from sacrebleu.metrics import BLEU

    from qkv.metrics import bleu_compound_split, compound_split

    # Perl's left-to-right substitution: a-b-c keeps its second hyphen (b was consumed by the first match)
    assert compound_split(["Rich-Text-Format , a-b-c - x"]) == \
        ["Rich ##AT##-##AT## Text ##AT##-##AT## Format , a ##AT##-##AT## b-c - x"]
    hyp = ["Das Rich-Text-Format ist gut, sagte er heute früh."]
    ref = ["Das Rich-Text-Dokument ist gut, sagte er heute früh."]
    # the same pair prepared by hand: Moses tokens (no -a, cased), then the compounds split
    by_hand = BLEU(tokenize="none", smooth_method="none").corpus_score(
        ["Das Rich ##AT##-##AT## Text ##AT##-##AT## Format ist gut , sagte er heute früh ."],
        [["Das Rich ##AT##-##AT## Text ##AT##-##AT## Dokument ist gut , sagte er heute früh ."]])
    s = bleu_compound_split(hyp, ref, "de")
    assert s.score == pytest.approx(by_hand.score) and 50 < s.score < 100
    assert "tok:moses-de+compound-split" in s.signature and "case:mixed" in s.signature
    assert "hyp_len = 14" in s.summary  # 10 Moses tokens, 2 compounds split into 3 tokens each
