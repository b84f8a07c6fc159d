"""The translation front-end: what ``qkv.load`` returns for a translate or prefix_lm checkpoint.

    >>> import qkv
    >>> model = qkv.load("runs/default/best")
    >>> model.translate(["three hundred twenty-one"])
    ['dreihunderteinundzwanzig']

Sentences are tokenized, sorted by length and decoded in batches (greedy or beam search through
the model's incremental ``start``/``step`` interface, :func:`qkv.decoding.batch.decode_sentences`),
then detokenized and returned in input order.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace

import torch

from qkv.config import DecodeConfig, TrainConfig
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding.batch import decode_sentences
from qkv.decoding.forced import forced_logprobs
from qkv.errors import ConfigError
from qkv.frontends.base import Frontend, TruncationHandler


class Translator(Frontend):
    """A trained model with its tokenizers and decoding settings: translation and prefix-LM checkpoints."""

    name = "translator"

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, decode_cfg: DecodeConfig | None = None,
                 train_cfg: TrainConfig | None = None):
        super().__init__(model, tokenizers, train_cfg)
        self.decode_cfg = (decode_cfg or DecodeConfig()).validate()

    @classmethod
    def from_checkpoint(cls, model, tokenizers, config, decode_cfg, train_cfg) -> "Translator":
        return cls(model, tokenizers, decode_cfg, train_cfg)

    def translate(self, sentences: list[str], **overrides) -> list[str]:
        """Translate each sentence; ``overrides`` are :class:`DecodeConfig` fields (e.g. ``beam_size=1``)."""
        return [nbest[0] for nbest in self.translate_nbest(sentences, **overrides)]

    def translate_nbest(self, sentences: list[str], **overrides) -> list[list[str]]:
        """The ``nbest`` best translations of each sentence, best first."""
        return [[text for text, _ in hyps] for hyps in self.translate_scored(sentences, **overrides)]

    @torch.inference_mode()
    def translate_scored(self, sentences: list[str], on_truncate: TruncationHandler | None = None,
                         **overrides) -> list[list[tuple[str, float]]]:
        """``(translation, score)`` pairs per sentence; the score is the (length-normalised) log-probability.

        A sentence longer than the model reads (learned positions end at ``max_positions``) is
        translated from its head: ``on_truncate(indices, kept)`` hears which sentences (0-based)
        were cut to how many tokens; without it a warning says so. Outputs never run past what the
        decoder's positions can index either (:func:`qkv.decoding.max_output_len`).
        """
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        cfg = replace(self.decode_cfg, **overrides).validate() if overrides else self.decode_cfg
        self.check_beam(cfg.beam_size)
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sentences)), on_truncate)
        hyps = decode_sentences(self.model, src_ids, cfg)
        return [list(zip(self.tokenizers.tgt.decode([h.tokens for h in nbest]), [h.score for h in nbest]))
                for nbest in hyps]

    def translate_lines(self, lines: list[str], on_truncate: TruncationHandler | None = None, chunk: int = 0,
                        **overrides) -> Iterator[list[tuple[str, float]]]:
        """The ``nbest`` ``(translation, score)`` pairs of each line, in order, decoded ``chunk`` lines
        at a time (default: 8 batches), so that output streams on long files. An empty line gets
        ``nbest`` empty translations; ``on_truncate(indices, kept)`` hears indices into ``lines``."""
        nbest = overrides.get("nbest", self.decode_cfg.nbest)
        chunk = chunk or overrides.get("batch_size", self.decode_cfg.batch_size) * 8
        for start in range(0, len(lines), chunk):
            part = lines[start : start + chunk]
            keep = [i for i, line in enumerate(part) if line.strip()]
            warn = None if on_truncate is None else \
                (lambda idx, kept, keep=keep, start=start: on_truncate([start + keep[i] for i in idx], kept))
            scored = dict(zip(keep, self.translate_scored([part[i] for i in keep], on_truncate=warn, **overrides)
                              if keep else []))
            for i in range(len(part)):
                yield scored.get(i, [("", 0.0)] * nbest)

    def score(self, sources: list[str], targets: list[str], on_truncate: TruncationHandler | None = None,
              ) -> list[list[float]]:
        """Forced decoding: the log-probability of each target token given its source and the
        target's previous tokens, EOS last (:func:`qkv.decoding.forced.forced_logprobs`); their sum
        is log p(target | source), the ``logprob`` beam search gives the same output."""
        if isinstance(sources, str) or isinstance(targets, str):
            raise TypeError("score() takes lists of sentences, not single strings")
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sources)), on_truncate)
        return forced_logprobs(self.model, src_ids, self.tokenizers.tgt.encode(list(targets)),
                               self.decode_cfg.batch_size)

    def check_beam(self, beam_size: int) -> None:
        """A beam wider than the target vocabulary has nothing to fill it with: refused by name."""
        vocab = self.tokenizers.tgt.vocab_size
        if beam_size > vocab:
            raise ConfigError(f"invalid config field 'beam_size': {beam_size} is larger than the model's target "
                              f"vocabulary ({vocab} tokens); choose at most {vocab}")

    def fit_sources(self, src_ids: list[list[int]], on_truncate: TruncationHandler | None = None) -> list[list[int]]:
        """Token lists cut to what the model reads (its ``max_source_len``, EOS included)."""
        limit = self.model.max_source_len()
        if limit is None:
            return src_ids
        kept = limit - 1  # collate appends EOS
        cut = [i for i, ids in enumerate(src_ids) if len(ids) > kept]
        if cut:
            if on_truncate is None:
                warnings.warn(f"{len(cut)} of {len(src_ids)} sentences are longer than the model reads "
                              f"({kept} tokens, max_positions={limit}): translated from their first {kept} tokens",
                              stacklevel=3)
            else:
                on_truncate(cut, kept)
        return [ids[:kept] for ids in src_ids]


__all__ = ["Translator"]
