"""Evaluation metrics: BLEU and chrF through sacreBLEU, exact match, perplexity.

BLEU is what the paper reports (Table 2: 28.4 EN-DE, 41.8 EN-FR for the big model). Scores
here come from sacreBLEU on detokenized text, with its signature, so that they can be compared
with other published sacreBLEU scores (the paper's own numbers used tokenized multi-bleu and
are not directly comparable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF

from qkv.errors import QkvError


@dataclass(frozen=True)
class Score:
    """A corpus-level score (0-100), sacreBLEU's signature and its one-line summary."""

    score: float
    signature: str  # e.g. "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"
    summary: str  # e.g. "BLEU = 35.20 66.1/41.3/28.0/19.6 (BP = 1.000 ratio = 1.010 ...)"

    def text(self) -> str:
        """The line to report: ``summary (sacreBLEU signature: signature)``."""
        return f"{self.summary} (sacreBLEU signature: {self.signature})"

    def __str__(self) -> str:
        return self.text()


def _check(hyps: list[str], refs: list[str]) -> None:
    if len(hyps) != len(refs):
        raise QkvError(f"cannot score {len(hyps)} hypotheses against {len(refs)} references: counts differ")
    if not hyps:
        raise QkvError("cannot score an empty list of hypotheses")


def bleu(hyps: list[str], refs: list[str]) -> Score:
    """Corpus BLEU (Papineni et al., 2002) with sacreBLEU's defaults: 13a tokenizer, cased, one reference.

        BLEU = BP * exp( (1/4) * sum_{n=1..4} log p_n ),  BP = min(1, exp(1 - ref_len / hyp_len))

    where p_n is the clipped n-gram precision over the whole corpus.
    """
    _check(hyps, refs)
    metric = BLEU()
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def moses_tokenize(lines: list[str], lang: str) -> list[str]:
    """Moses tokenization as the published Multi30k numbers use it (``tokenizer.perl -l LANG -a
    -no-escape``, then lowercase), through sacremoses."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError:  # pragma: no cover - sacremoses is a core dependency
        raise QkvError("the Moses-tokenized BLEU needs sacremoses: pip install sacremoses") from None
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, aggressive_dash_splits=True, escape=False, return_str=True).lower() for line in lines]


def bleu_tok_lc(hyps: list[str], refs: list[str], lang: str) -> Score:
    """BLEU-4 on lowercased, Moses-tokenized text: the convention of the published Multi30k
    results (fairseq / multi-bleu style). Both sides are tokenized here from detokenized text,
    then scored by sacreBLEU with ``tokenize="none"``. Higher than the cased, detokenized
    sacreBLEU of the same output; never compare the two."""
    _check(hyps, refs)
    metric = BLEU(tokenize="none", force=True)
    result = metric.corpus_score(moses_tokenize(hyps, lang), [moses_tokenize(refs, lang)])
    # What was done, in the signature: lowercased (case:lc), Moses-tokenized here (tok:moses-...).
    signature = str(metric.get_signature()).replace("case:mixed", "case:lc").replace("tok:none", f"tok:moses-{lang}-a")
    return Score(result.score, signature, str(result))


def chrf(hyps: list[str], refs: list[str]) -> Score:
    """Corpus chrF (Popović, 2015) with sacreBLEU's defaults: character 6-grams, beta = 2."""
    _check(hyps, refs)
    metric = CHRF()
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def exact_match(hyps: list[str], refs: list[str]) -> float:
    """Fraction (0-1) of hypotheses equal to their reference, ignoring surrounding whitespace."""
    _check(hyps, refs)
    return sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(hyps)


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(nll_sum / n_tokens): the exponentiated mean negative log-likelihood per token (inf on overflow)."""
    if n_tokens <= 0:
        raise QkvError(f"perplexity needs at least one token, got {n_tokens}")
    mean = float(nll_sum) / n_tokens
    return math.exp(mean) if mean < 700 else math.inf
