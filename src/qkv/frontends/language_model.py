"""The language-model front-end: what ``qkv.load`` returns for an lm checkpoint.

    >>> lm = qkv.load("runs/timemachine/best")
    >>> print("".join(lm.generate("the time traveller", 60, temperature=0)))
    >>> lm.score(open("held-out.txt").read().splitlines()).ppl
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from qkv.config import EOS, TrainConfig
from qkv.data.text import token_stream
from qkv.frontends.base import Frontend
from qkv.tasks.base import TextData
from qkv.tasks.lm import LmTask


@dataclass
class Perplexity:
    """Scores of a text: ``ppl = exp(nll / tokens)``; ``bpc`` = nll / ln 2 / characters."""

    nll: float
    tokens: int
    characters: int

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nll / self.tokens, 700.0))

    @property
    def bpc(self) -> float:
        return self.nll / math.log(2) / self.characters


class LanguageModel(Frontend):
    """A trained language model with its tokenizer: :meth:`generate` (streaming) and :meth:`score`."""

    name = "language_model"

    @property
    def tokenizer(self):
        return self.tokenizers.tgt

    @property
    def recurrent(self) -> bool:
        return self.model.cfg.is_recurrent

    @property
    def reads_whole_text(self) -> bool:
        """Whether the model reads a text whole, as its own tokenizer does (an imported model's
        tokenizer.json: a line break is a token, EOS ends the text), rather than as qkv's one-line-a-
        sentence corpora (a line break is EOS)."""
        return hasattr(self.tokenizer, "encode_text")

    def prompt_ids(self, prefix: str) -> list[int]:
        """The token ids of a prompt as the model reads it: each line but the last followed by
        EOS (the training stream's layout); the last line open, to be continued. An imported model
        (:attr:`reads_whole_text`) reads the prompt as its tokenizer does, line breaks and all."""
        if self.reads_whole_text:
            return self.tokenizer.encode_text(prefix)
        lines = prefix.split("\n")
        return token_stream(lines[:-1], self.tokenizer.encode) + self.tokenizer.encode([lines[-1]])[0]

    def fit_positions(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
        """A learned position table ends at ``max_positions``: a prompt longer than the model reads
        keeps its last half-table of tokens, and generation stops where the table ends; a warning
        says which. Unchanged for sinusoidal positions and recurrent models."""
        limit = self.model.max_source_len()
        if limit is None:
            return ids, max_new_tokens
        if len(ids) - 1 > limit:  # sample() starts on all but the last prompt token
            warnings.warn(f"the prompt is {len(ids)} tokens, more than the model reads: continuing its last "
                          f"{limit // 2 + 1} tokens", stacklevel=3)
            ids = ids[-(limit // 2 + 1):]
        room = int(self.model.max_steps(torch.tensor(max(len(ids) - 1, 0))))
        if max_new_tokens > room:
            warnings.warn(f"the model's learned positions end at max_positions={self.model.cfg.max_positions}: "
                          f"generating {room} tokens, not {max_new_tokens}", stacklevel=3)
        return ids, min(max_new_tokens, room)

    def generate(self, prefix: str, max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None) -> Iterator[str]:
        """Continue ``prefix``; yields the text as it is produced, whole characters only (EOS is a
        line break). The prefix's lines end with EOS, except the last, which the model continues.
        With a subword tokenizer end the prefix at a word boundary: a word cut in two is tokenized
        into pieces the model rarely saw in that place. An imported model (:attr:`reads_whole_text`)
        reads the prefix as its tokenizer does and ends at EOS.

        A character whose bytes span several tokens (byte-level BPE, byte fallback: "ü" in
        "Zürich") is yielded once its last byte is there: text that decodes to U+FFFD at its end is
        held back until the next token completes it, and yielded as it is only if generation ends."""
        from qkv.decoding.greedy import banned_ids
        from qkv.decoding.sampling import sample

        ids, max_new_tokens = self.fit_positions(self.prompt_ids(prefix), max_new_tokens)
        with self.evaluating():
            yield from self.text_stream(prefix, ids, sample(
                self.model, ids, max_new_tokens, temperature, top_k, top_p, seed,
                banned=banned_ids(self.tokenizer), stop_at_eos=self.reads_whole_text))

    def text_stream(self, prefix: str, ids: list[int], tokens: Iterable[int]) -> Iterator[str]:
        """The text of ``tokens``, drawn after ``prefix`` (its prompt ``ids``, as :meth:`generate` fits them),
        as :meth:`generate` yields it: whole characters, EOS a line break, or the end of the text for an
        imported model (:attr:`reads_whole_text`). Any engine's tokens (CTranslate2's) stream this way."""
        whole = self.reads_whole_text
        # the tokens of the text being written (the line, for qkv's own models), and what of it is shown
        line = list(ids) if whole else self.tokenizer.encode([prefix.split("\n")[-1]])[0]
        shown = text = self.tokenizer.decode([line])[0]
        for t in tokens:
            if t == EOS:
                if whole:  # the text ends (qkv's sampler stops there itself: stop_at_eos)
                    break
                if text[len(shown):]:
                    yield text[len(shown):]
                line, shown, text = [], "", ""
                yield "\n"
                continue
            line.append(t)
            text = self.tokenizer.decode([line])[0]
            new, shown = _new_text(shown, text.rstrip("\ufffd"))  # a character's bytes still coming: hold them
            if new:
                yield new
        if text[len(shown):]:  # bytes that never made a character, as the tokenizer decodes them
            yield text[len(shown):]

    @torch.inference_mode()
    def score(self, lines: list[str], max_tokens: int | None = None) -> Perplexity:
        """Perplexity and bits per character of ``lines``, cut as validation cuts it (the training
        run's ``max_len`` windows; for an RNN, its carried state over ``max_tokens // max_len`` rows)."""
        task = LmTask()
        task.recurrent = self.recurrent
        split = task.encode(TextData(list(lines), name="text"), self.tokenizers, self.train_cfg, None, train=False)
        nll, n = 0.0, 0
        with self.evaluating():
            for ix in split.batches(max_tokens or self.train_cfg.max_tokens, shuffle=False, seed=0, epoch=0):
                batch = split.collate(ix).to(self.device)
                _, nll_sum = task.loss(self.model, batch, TrainConfig(label_smoothing=0.0))
                nll += float(nll_sum)
                n += batch.n_tgt_tokens
        return Perplexity(nll, n, sum(len(line) + 1 for line in lines))


def _new_text(shown: str, text: str) -> tuple[str, str]:
    """What of ``text`` is new after ``shown`` (the text yielded so far), and what is shown after it. When
    the decoder rewrote the end already shown (rare), the difference from the common start."""
    if text.startswith(shown):
        return text[len(shown):], text
    if shown.startswith(text):  # fewer characters than shown (a held character's bytes): nothing new yet
        return "", shown
    return text[len(os.path.commonprefix([text, shown])):], text


__all__ = ["LanguageModel", "Perplexity"]
