"""Translation (seq2seq): parallel text, teacher forcing, label-smoothed cross-entropy, BLEU.

    src = x_1 .. x_n EOS,  tgt_in = BOS y_1 .. y_m,  tgt_out = y_1 .. y_m EOS
    loss = sum over non-PAD target positions of H(q_ls, softmax(model(src, tgt_in)))

Validation: loss and perplexity over the split (by the trainer), then BLEU / chrF / exact match
of greedy output on the first ``eval_bleu_samples`` sentences (exact match alone where the data says so:
``ParallelData.metric == "exact"``, the embedded number task). best/ = lowest validation loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from qkv.config import DecodeConfig, TrainConfig
from qkv.data.batching import Batch, BatchPlan, LengthIndex, collate
from qkv.data.binarized import BinarizedCorpus, TokenArray, open_corpus
from qkv.data.corpus import CorpusReport, filter_by_length, read_parallel
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.metrics import bleu, chrf, exact_match
from qkv.tasks.base import DataPaths, Task, checkpoint_tokenizers, require_positions, token_loss


@dataclass
class ParallelData:
    """Sentence pairs for one split, as raw text (tokenized by the trainer)."""

    src: list[str]
    tgt: list[str]
    name: str = "data"
    line_numbers: list[int] | None = None
    report: CorpusReport | None = None
    metric: str = "bleu"  # what validation scores: "bleu" (BLEU, chrF, exact match) or "exact" (exact match alone)
    repeats: bool = False  # pairs repeated by design (the embedded task): the tokenizer learns each sentence once

    def __len__(self) -> int:
        return len(self.src)

    def tokenizer_text(self) -> tuple[list[str], list[str]]:
        """The source and target sentences a tokenizer trained on this split learns from: every
        pair, or with ``repeats`` each distinct sentence once (in first-seen order), so that its
        merges follow the language rather than how often a pair was repeated."""
        if not self.repeats:
            return self.src, self.tgt
        return list(dict.fromkeys(self.src)), list(dict.fromkeys(self.tgt))


@dataclass
class BinarizedData:
    """A split of a directory written by ``qkv preprocess`` (:mod:`qkv.data.binarized`): nothing
    but its manifest is read until the split is encoded, which maps its arrays."""

    corpus: BinarizedCorpus
    split: str = "train"

    @property
    def name(self) -> str:
        return f"{self.corpus.path}:{self.split}"

    @property
    def fingerprint(self) -> str:
        """The manifest's digest of its files' checksums (what --resume compares)."""
        return self.corpus.fingerprint

    @property
    def tokenizers(self) -> TokenizerPair:
        return self.corpus.tokenizers()

    def __len__(self) -> int:
        return self.corpus.pairs(self.split)


@dataclass
class EncodedSplit:
    """Token ids of both sides as :class:`~qkv.data.binarized.TokenArray` (in memory for plain files,
    memory-mapped for a preprocessed directory) and the pairs grouped by length
    (:class:`~qkv.data.buckets.LengthIndex`: built here for plain files, read from the directory's
    index file for a preprocessed one): one batching and collation path for both.
    ``raw_src``/``raw_tgt``: the text (for validation BLEU; None for a mapped training split)."""

    src: TokenArray
    tgt: TokenArray
    raw_src: list[str] | None = None
    raw_tgt: list[str] | None = None
    index: LengthIndex | None = None  # None: built from the lengths when first asked for
    metric: str = "bleu"  # the data's own validation metric (ParallelData.metric)

    @property
    def length_index(self) -> LengthIndex:
        if self.index is None:
            self.index = LengthIndex.build(self.src.lengths, self.tgt.lengths)
        return self.index

    def __len__(self) -> int:
        return len(self.src) if self.index is None else len(self.index)

    def _kept(self) -> Sequence[int]:
        """The pairs the index keeps, in corpus order (all of them unless ``max_len`` left some out)."""
        if len(self) == len(self.src):
            return range(len(self.src))
        ix = self.length_index
        if not len(ix):
            return []
        return np.sort(ix.take(np.concatenate([np.arange(a, a + c) for a, c in zip(ix.starts, ix.counts)]))).tolist()

    @property
    def src_ids(self) -> list[list[int]]:
        return self.src.rows(self._kept())

    @property
    def tgt_ids(self) -> list[list[int]]:
        return self.tgt.rows(self._kept())

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> BatchPlan:
        return BatchPlan(self.length_index, max_tokens, shuffle, seed, epoch)

    def collate(self, indices: list[int]) -> Batch:
        """Reads only these sentences (from the files, for a preprocessed directory)."""
        return collate(self.src.rows(indices), self.tgt.rows(indices))


def encode_split(data: ParallelData, tokenizers: TokenizerPair, max_len: int | None, log) -> EncodedSplit:
    """Tokenize a split; with ``max_len``, drop over-long pairs and report how many (with line numbers)."""
    src_ids = tokenizers.src.encode(data.src)
    tgt_ids = tokenizers.tgt.encode(data.tgt)
    keep = list(range(len(src_ids)))
    if max_len is not None:
        report = data.report or CorpusReport(paths=[data.name], n_lines=len(src_ids))
        lines = data.line_numbers or list(range(1, len(src_ids) + 1))
        keep = filter_by_length(src_ids, tgt_ids, max_len, lines, report)
        if len(keep) < len(src_ids):
            log(f"{data.name}: skipped {len(src_ids) - len(keep)} pair(s) longer than max_len={max_len} tokens")
    vocab = max(tokenizers.src.vocab_size, tokenizers.tgt.vocab_size)
    return EncodedSplit(TokenArray.from_lists([src_ids[i] for i in keep], vocab),
                        TokenArray.from_lists([tgt_ids[i] for i in keep], vocab),
                        [data.src[i] for i in keep], [data.tgt[i] for i in keep], metric=data.metric)


def mapped_split(data: BinarizedData, max_len: int | None, log) -> EncodedSplit:
    """A preprocessed split: its arrays opened, its length index read; with ``max_len``, the length
    pairs over it left out of the index (nothing a pair long is read or copied)."""
    src, tgt = data.corpus.side(data.split, "src"), data.corpus.side(data.split, "tgt")
    index = data.corpus.length_index(data.split)
    if max_len is not None:
        kept = index.up_to(max_len)
        if len(kept) < len(index):
            log(f"{data.name}: skipped {len(index) - len(kept)} pair(s) longer than max_len={max_len} tokens")
        index = kept
    raw = data.corpus.texts(data.split) if data.split != "train" else (None, None)
    return EncodedSplit(src, tgt, *raw, index=index)


def read_parallel_data(paths: DataPaths, log) -> tuple[ParallelData | BinarizedData, ParallelData | BinarizedData | None]:
    """--src-train/--tgt-train (+ --src-valid/--tgt-valid): line-aligned files, empty pairs skipped;
    or --data DIR, a directory written by ``qkv preprocess``: its manifest only (checked against its
    files' sizes, and checksums unless ``paths.verify_data`` is off), the arrays mapped later."""
    if paths.data:
        corpus = open_corpus(paths.data, checksums=paths.verify_data)
        log(f"{paths.data}: {corpus.pairs('train')} training pairs"
            + (f", {corpus.pairs('valid')} validation pairs" if corpus.has("valid") else "")
            + (" (checksums verified)" if paths.verify_data else " (file sizes checked)"))
        return BinarizedData(corpus, "train"), BinarizedData(corpus, "valid") if corpus.has("valid") else None
    if not (paths.src_train and paths.tgt_train):
        raise QkvError("give both --src-train and --tgt-train (or neither, for the embedded default task)")
    if bool(paths.src_valid) != bool(paths.tgt_valid):
        raise QkvError("give both --src-valid and --tgt-valid (or neither)")
    t = read_parallel(paths.src_train, paths.tgt_train)
    log(t.report.summary())
    train = ParallelData(t.src, t.tgt, f"{paths.src_train}/{paths.tgt_train}", t.line_numbers, t.report)
    valid = None
    if paths.src_valid:
        v = read_parallel(paths.src_valid, paths.tgt_valid)
        log(v.report.summary())
        valid = ParallelData(v.src, v.tgt, f"{paths.src_valid}/{paths.tgt_valid}", v.line_numbers, v.report)
    return train, valid


# Validation decodes a hypothesis of at most VALID_LEN_A x its reference's tokens + VALID_LEN_B: one that long is
# no exact match and is already penalised by BLEU's precision, and an untrained model that never emits EOS would
# otherwise run to the decoding budget (source + 50 tokens) on every sample, costing a short run more than its
# training (a 3-update run of the embedded task: 7 s of validation for 1.5 s of training).
VALID_LEN_A, VALID_LEN_B = 2, 5


def validation_limits(ref_ids: list[list[int]]) -> list[int]:
    """Each validation sample's output cap, from its reference's length in tokens."""
    return [VALID_LEN_A * len(ids) + VALID_LEN_B for ids in ref_ids]


class TranslateTask(Task):
    name = "translate"
    offers = frozenset({"translate", "score", "evaluate", "viz", "ensemble"})
    kind = "a translation model"
    data_kind = "parallel"
    specials = False  # translation vocabularies are trained exactly as before the other tasks existed

    def read_data(self, paths: DataPaths, log):
        return read_parallel_data(paths, log)

    def check_data(self, train_data, valid_data, saved):
        if not len(train_data):
            raise QkvError(f"{train_data.name}: no training pairs left to train on")

    def train_tokenizers(self, train_data: ParallelData, train_cfg: TrainConfig) -> TokenizerPair:
        if isinstance(train_data, BinarizedData):  # the ids are in its vocabulary
            tokenizers = train_data.tokenizers
            start = checkpoint_tokenizers(train_cfg.init_from) if train_cfg.init_from else tokenizers
            if (start.src.model_bytes, start.tgt.model_bytes) != (tokenizers.src.model_bytes, tokenizers.tgt.model_bytes):
                raise QkvError(f"init_from {train_cfg.init_from}: its tokenizer is not the one of {train_data.name}; "
                               f"preprocess with --tokenizer-from {train_cfg.init_from}")
            return tokenizers
        if train_cfg.init_from:
            return checkpoint_tokenizers(train_cfg.init_from)
        return TokenizerPair.train(*train_data.tokenizer_text(), train_cfg.vocab_size, train_cfg.tokenizer,
                                   train_cfg.joint_vocab)

    def check_positions(self, model_cfg, train_cfg: TrainConfig) -> None:
        """Learned positions, and recurrent location-based attention (a weight row per source position)."""
        super().check_positions(model_cfg, train_cfg)
        if model_cfg.is_recurrent and model_cfg.attention == "location":
            require_positions(model_cfg, train_cfg, self.positions_needed(train_cfg),
                              f"location-based attention covers max_positions={model_cfg.max_positions} source positions")

    def encode(self, data: ParallelData, tokenizers, train_cfg: TrainConfig, log, train: bool) -> EncodedSplit:
        max_len = train_cfg.max_len if train else None
        split = mapped_split(data, max_len, log) if isinstance(data, BinarizedData) else \
            encode_split(data, tokenizers, max_len, log)
        if train and not len(split):
            raise QkvError(f"{data.name}: every pair is longer than max_len={train_cfg.max_len}")
        return split

    def loss(self, module, batch: Batch, train_cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss(module, (batch.src, batch.tgt_in), batch.tgt_out, train_cfg)  # logits (B, T, V)

    def metrics(self, model, split: EncodedSplit, tokenizers, decode_cfg: DecodeConfig, train_cfg: TrainConfig) -> dict:
        n = min(train_cfg.eval_bleu_samples, len(split.raw_src)) if split.raw_src is not None else 0
        if n <= 0:
            return {}
        from qkv.decoding.batch import decode_sentences  # the decoding loop the Translator front-end runs
        from qkv.decoding.greedy import banned_ids

        src_ids = tokenizers.src.encode(split.raw_src[:n])
        refs = split.raw_tgt[:n]  # in the training text's form (perhaps tokenized): a progress signal, quietly
        best = decode_sentences(model, src_ids, replace(decode_cfg, beam_size=1, nbest=1),
                                banned_ids(tokenizers.tgt), limits=validation_limits(tokenizers.tgt.encode(refs)))
        hyps = tokenizers.tgt.decode([nbest[0].tokens for nbest in best])
        scores = {"valid_exact": exact_match(hyps, refs)}
        if split.metric == "bleu":  # one-word outputs (the number task) score exact match alone
            scores = {"valid_bleu": bleu(hyps, refs, quiet=True).score, "valid_chrf": chrf(hyps, refs).score, **scores}
        return {**scores, "valid_samples": [[s, h, r] for s, h, r in zip(split.raw_src[:3], hyps[:3], refs[:3])]}

    def summary(self, v: dict) -> str:
        if "valid_bleu" in v:
            return f"  BLEU {v['valid_bleu']:.2f}  chrF {v['valid_chrf']:.2f}  exact {100 * v['valid_exact']:.1f}%"
        return f"  exact {100 * v['valid_exact']:.1f}%" if "valid_exact" in v else ""
