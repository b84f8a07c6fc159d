"""Evaluation metrics: BLEU and chrF through sacreBLEU, exact match, perplexity.

BLEU is what the paper reports (Table 2: 28.4 EN-DE, 41.8 EN-FR for the big model). Scores
here come from sacreBLEU on detokenized text, with its signature, so that they can be compared
with other published sacreBLEU scores (the paper's own numbers used tokenized multi-bleu and
are not directly comparable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF, TER

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


def bleu(hyps: list[str], refs: list[str], quiet: bool = False) -> Score:
    """Corpus BLEU (Papineni et al., 2002) with sacreBLEU's defaults: 13a tokenizer, cased, one reference.

        BLEU = BP * exp( (1/4) * sum_{n=1..4} log p_n ),  BP = min(1, exp(1 - ref_len / hyp_len))

    where p_n is the clipped n-gram precision over the whole corpus.

    ``quiet``: no warning from sacreBLEU when the hypotheses look tokenized (its ``force``; the score
    is the same). For training-time validation, which scores whatever form the training text has.
    """
    _check(hyps, refs)
    metric = BLEU(force=quiet)
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def moses_detokenize(lines: list[str], lang: str) -> list[str]:
    """Moses-tokenized lines (with or without ``-a``) back to raw-form text: ``@-@`` merged back into
    the hyphen, then sacremoses' detokenizer."""
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.replace(" @-@ ", "-").split()) for line in lines]


def moses_tokenize(lines: list[str], lang: str, tokenized: bool = False) -> list[str]:
    """The text the published Multi30k BLEU scores are computed on: each line lowercased, its
    punctuation normalized and Moses-tokenized, as the dataset's own ``scripts/task1-tokenize.sh``
    makes its ``*.lc.norm.tok.*`` files (``lowercase.perl | normalize-punctuation.perl -l LANG |
    tokenizer.perl -l LANG``: no ``-a``, so hyphenated words stay whole), through sacremoses, without
    the XML escaping (which moves no token boundary).

    Why no ``-a``: the published En→De score (41.02) reports ``reflen=12103``; this tokenization
    of test_2016_flickr.de gives exactly 12,103 tokens, the aggressive one (``-a``) 12,243.

    ``tokenized``: the lines are already Moses-tokenized (a model trained on tokenized text wrote
    them), with or without ``-a``: ``@-@`` is merged back and the line detokenized first, so they go
    through the same steps as raw text."""
    try:
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
    except ImportError:  # pragma: no cover - sacremoses is a core dependency
        raise QkvError("the Moses-tokenized BLEU needs sacremoses: pip install sacremoses") from None
    tok, norm = MosesTokenizer(lang=lang), MosesPunctNormalizer(lang=lang)
    if tokenized:
        lines = moses_detokenize(lines, lang)
    return [tok.tokenize(norm.normalize(line.lower()), escape=False, return_str=True) for line in lines]


def bleu_tok_lc(hyps: list[str], refs: list[str], lang: str, hyps_tokenized: bool = False) -> Score:
    """BLEU-4 on lowercased, punctuation-normalized, Moses-tokenized text (:func:`moses_tokenize`):
    the convention of the published Multi30k results (fairseq / multi-bleu style on the dataset's
    ``lc.norm.tok`` files). Both sides are brought to that form here, then scored by sacreBLEU with
    ``tokenize="none"``. Higher than the cased, detokenized sacreBLEU of the same output; never
    compare the two.

    ``hyps_tokenized``: the hypotheses are Moses-tokenized already (the output of a model trained on
    such text, as the published systems were); they are detokenized and put through the same steps,
    and the references are always prepared here from the raw files, so every kind of model meets the
    same references."""
    _check(hyps, refs)
    metric = BLEU(tokenize="none", force=True)
    sys_side = moses_tokenize(hyps, lang, tokenized=hyps_tokenized)
    result = metric.corpus_score(sys_side, [moses_tokenize(refs, lang)])
    # What was done, in the signature: lowercased (case:lc), the dataset's lc.norm.tok steps (tok:...).
    signature = (str(metric.get_signature()).replace("case:mixed", "case:lc")
                 .replace("tok:none", f"tok:lc.norm.tok-{lang}"))
    return Score(result.score, signature, str(result))


def compound_split(lines: list[str]) -> list[str]:
    """Hyphenated compounds split as the WMT English-German papers score them: every ``X-Y`` between
    two non-space characters becomes ``X ##AT##-##AT## Y`` (tensor2tensor's ``get_ende_bleu.sh``,
    ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``; left to right, so ``a-b-c`` keeps its second
    hyphen, as Perl does)."""
    import re

    return [re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line) for line in lines]


def bleu_compound_split(hyps: list[str], refs: list[str], lang: str) -> Score:
    """Tokenized BLEU with compound splitting, the convention of the Transformer paper's WMT 2014
    scores (27.3 / 28.4 En→De): both sides cased and Moses-tokenized (``tokenizer.perl -l LANG``, no
    ``-a``, no lowercasing or punctuation normalization; sacremoses, without XML escaping), then
    :func:`compound_split`, then BLEU-4 on the tokens as ``multi-bleu.perl`` computes it (sacreBLEU
    with ``tokenize="none"``, no smoothing). Higher than the detokenized sacreBLEU of the same
    output: report which one a number is."""
    from sacremoses import MosesTokenizer

    _check(hyps, refs)
    tok = MosesTokenizer(lang=lang)

    def prepare(lines: list[str]) -> list[str]:
        return compound_split([tok.tokenize(line, escape=False, return_str=True) for line in lines])

    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(prepare(hyps), [prepare(refs)])
    signature = str(metric.get_signature()).replace("tok:none", f"tok:moses-{lang}+compound-split")
    return Score(result.score, signature, str(result))


def chrf(hyps: list[str], refs: list[str]) -> Score:
    """Corpus chrF (Popović, 2015) with sacreBLEU's defaults: character 6-grams, beta = 2."""
    _check(hyps, refs)
    metric = CHRF()
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def ter(hyps: list[str], refs: list[str]) -> Score:
    """Corpus TER (Snover et al., 2006): the edits (insertions, deletions,
    substitutions and shifts of word sequences) that turn each hypothesis into its reference, over
    the references' words, in percent (lower is better); case-insensitive, tercom's tokenization (sacreBLEU's defaults)."""
    _check(hyps, refs)
    metric = TER()
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


# --- classification ----------------------------------------------------------------------------------

def confusion_matrix(golds: list[int], preds: list[int], n_classes: int) -> list[list[int]]:
    """``C[i][j]`` = number of examples of true class i predicted as class j (rows: truth)."""
    if len(golds) != len(preds):
        raise QkvError(f"cannot compare {len(preds)} predictions with {len(golds)} labels: counts differ")
    matrix = [[0] * n_classes for _ in range(n_classes)]
    for g, p in zip(golds, preds):
        matrix[g][p] += 1
    return matrix


def accuracy(golds: list[int], preds: list[int]) -> float:
    """Fraction (0-1) of predictions equal to the label."""
    if not golds:
        raise QkvError("accuracy of an empty set of examples")
    return sum(g == p for g, p in zip(golds, preds, strict=True)) / len(golds)


def f1_per_class(matrix: list[list[int]]) -> list[float]:
    """F1_c = 2 P_c R_c / (P_c + R_c), P_c = C[c][c] / Σ_i C[i][c], R_c = C[c][c] / Σ_j C[c][j];
    0 for a class never predicted nor present (as scikit-learn's ``zero_division=0``)."""
    n = len(matrix)
    out = []
    for c in range(n):
        tp = matrix[c][c]
        predicted = sum(matrix[i][c] for i in range(n))
        actual = sum(matrix[c])
        out.append(2 * tp / (predicted + actual) if predicted + actual else 0.0)  # = 2PR/(P+R)
    return out


def macro_f1(matrix: list[list[int]]) -> float:
    """The unweighted mean of the per-class F1 scores: every class counts the same."""
    scores = f1_per_class(matrix)
    return sum(scores) / len(scores)


def format_confusion(matrix: list[list[int]], labels: list[str]) -> str:
    """The matrix as a text table: one row per true label, one column per predicted label."""
    width = max([len(s) for s in labels] + [len(str(v)) for row in matrix for v in row] + [len("true\\pred")])
    lines = [" ".join(s.rjust(width) for s in ["true\\pred", *labels])]
    for label, row in zip(labels, matrix):
        lines.append(" ".join([label.rjust(width), *(str(v).rjust(width) for v in row)]))
    return "\n".join(lines)


def language_of(path: str) -> str | None:
    """The language code of a file named like ``test.de`` or ``test_2016_flickr.de.gz`` (ISO 639-1, as Moses uses)."""
    import re
    from pathlib import Path

    m = re.search(r"\.([a-z]{2})(\.gz)?$", Path(path).name)
    return m.group(1) if m else None


def translation_report(hyps: list[str], refs: list[str], lang: str | None) -> str:
    """sacreBLEU, the Multi30k convention's BLEU and the WMT convention's (given the target language),
    chrF and TER, each with its signature: what ``qkv evaluate`` prints."""
    lines = ["sacreBLEU (cased, detokenized): " + bleu(hyps, refs).text()]
    if lang:
        lines.append(f"Multi30k convention (lowercased, punctuation-normalized, Moses-tokenized -l {lang}): "
                     + bleu_tok_lc(hyps, refs, lang).text())
        lines.append(f"WMT convention (cased, Moses-tokenized -l {lang}, compounds split ##AT##-##AT##; the "
                     "Transformer paper's): " + bleu_compound_split(hyps, refs, lang).text())
    else:
        lines.append("(give --lang to also report BLEU on Moses-tokenized text: lowercased, and with compounds split)")
    lines.append(chrf(hyps, refs).text())
    lines.append(ter(hyps, refs).text())
    return "\n".join(lines)
