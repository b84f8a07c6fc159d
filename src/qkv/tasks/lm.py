"""Language modelling (vec2seq): plain text, every next token predicted, perplexity.

    p(x_1 .. x_N) = Π_t p(x_t | x_<t),    loss = −Σ_t log p(x_t | x_<t),    PPL = exp(loss / N)

The text is one token stream, each line followed by EOS (:mod:`qkv.data.text`). How the
stream is cut depends on the model:

* decoder-only Transformer (``arch = transformer``): non-overlapping windows of ``max_len``
  tokens, ``max_tokens // max_len`` windows per batch, shuffled each epoch; a window sees only
  its own tokens (the context at its start is empty);
* RNN / LSTM / GRU (``arch = rnn | lstm | gru``): truncated backpropagation through time
  (:mod:`qkv.training.bptt`). The stream is cut into ``B = max_tokens // max_len`` contiguous
  rows; batch k is window k (``max_len`` = bptt positions) of all rows, in order, never shuffled,
  and the recurrent state at the end of window k (detached) starts window k + 1. The task keeps
  that state between batches (one for training, one for evaluation; it restarts at window 0,
  and from zeros where a resumed run continues mid-epoch). One process only (no torchrun).

Validation (and ``qkv evaluate``) cut the held-out text the same way, so the perplexity of an RNN
uses its carried state and that of the Transformer a context of at most ``max_len`` tokens.
Bits per character = total nll / ln 2 / characters of the text (newlines counted).

Data: ``--train FILE`` and ``--valid FILE``, or ``--valid-fraction F`` to hold out the last F of
the training text; ``--strip-gutenberg`` keeps only the book between the ``*** START`` and
``*** END`` lines. The front-end :class:`LanguageModel` generates (streaming) and scores text.
"""

from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qkv.config import EOS, DecodeConfig, TrainConfig
from qkv.data.text import batchify, holdout_split, lm_windows, read_text, strip_gutenberg, token_stream
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.tasks.base import DataPaths, Task, TextData, token_loss
from qkv.training.bptt import carry
from qkv.training.loss import label_smoothed_nll_loss


@dataclass
class LMBatch:
    """Inputs and next-token targets ``(B, T)`` (PAD targets carry no loss); ``first``: the first
    window of a BPTT stream (the recurrent state restarts from zeros)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    first: bool = True

    @property
    def n_tgt_tokens(self) -> int:
        return int((self.targets != 0).sum())

    def to(self, device, non_blocking: bool = False) -> "LMBatch":
        return LMBatch(self.inputs.to(device, non_blocking=non_blocking),
                       self.targets.to(device, non_blocking=non_blocking), self.first)

    def __len__(self) -> int:
        return self.inputs.size(0)


class StreamSplit:
    """A token stream, batched for a Transformer (shuffled windows) or an RNN (BPTT windows in
    order). The layout and the window length are the task's (``task.recurrent``, ``task.window``),
    read when batches are drawn: the trainer encodes the data before it builds the model."""

    def __init__(self, stream: list[int], task: "LmTask", texts: list[str]):
        self.stream, self.task, self.texts = stream, task, texts
        self._rows: torch.Tensor | None = None  # (B, N) for BPTT
        self._windows = lm_windows(stream, task.window)  # (W, window + 1) for the Transformer

    @property
    def window(self) -> int:
        return self.task.window

    def __len__(self) -> int:
        return max(len(self.stream) - 1, 0)

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
        b = max(1, max_tokens // self.window)  # rows (windows) per batch
        if self.task.recurrent:  # window k of every row, in order: the state carries from k to k + 1
            b = max(1, min(b, len(self.stream) // (self.window + 1)))
            self._rows = batchify(self.stream, b)  # (B, N)
            return [[k] for k in range(math.ceil((self._rows.size(1) - 1) / self.window))]
        order = list(range(self._windows.size(0)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return [order[i : i + b] for i in range(0, len(order), b)]

    def collate(self, indices: list[int]) -> LMBatch:
        if self.task.recurrent:
            (k,) = indices
            start, n = k * self.window, self._rows.size(1)
            end = min(start + self.window, n - 1)
            return LMBatch(self._rows[:, start:end], self._rows[:, start + 1 : end + 1], first=k == 0)
        w = self._windows[indices]  # (B, window + 1)
        return LMBatch(w[:, :-1], w[:, 1:])


def read_text_data(path: str, strip: bool) -> list[str]:
    lines = read_text(path)
    return strip_gutenberg(lines, path) if strip else lines


class LmTask(Task):
    name = "lm"
    data_kind = "text"
    specials = True  # <sep> etc. at their fixed ids, as every one-sided task

    def __init__(self):
        self.recurrent = False  # set by model_config, before any batch is drawn
        self.window = 0  # max_len of the training run (the eval windows too), set by encode
        self._state = {True: None, False: None}  # carried BPTT state: training / evaluation

    def read_data(self, paths: DataPaths, log):
        if not paths.train:
            raise QkvError("--task lm needs --train FILE (plain text)")
        strip = bool(getattr(paths, "strip_gutenberg", False))
        fraction = float(getattr(paths, "valid_fraction", 0.0) or 0.0)
        train = read_text_data(paths.train, strip)
        valid = None
        if paths.valid:
            if fraction:
                raise QkvError("give --valid FILE or --valid-fraction, not both")
            valid = TextData(read_text_data(paths.valid, strip), name=paths.valid)
        elif fraction:
            train, held = holdout_split(train, fraction)
            valid = TextData(held, name=f"{paths.train} (last {fraction:g})")
            log(f"{paths.train}: holding out the last {fraction:g} of the text: {len(train)} lines train, "
                f"{len(held)} validate")
        return TextData(train, name=paths.train), valid

    def check_data(self, train_data, valid_data, saved):
        if not any(t.strip() for t in train_data.texts):
            raise QkvError(f"{train_data.name}: no text to train on")

    def model_config(self, model_cfg, tokenizers):
        self.recurrent = model_cfg.arch != "transformer"
        if self.recurrent and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise QkvError("a recurrent LM trains with its state carried from window to window, one stream of "
                           "batches: run it in one process (not under torchrun)")
        return super().model_config(model_cfg, tokenizers)

    def positions_needed(self, train_cfg: TrainConfig) -> int:
        """A window of max_len tokens, no specials added."""
        return train_cfg.max_len

    def encode(self, data: TextData, tokenizers: TokenizerPair, train_cfg: TrainConfig, log, train: bool) -> StreamSplit:
        self.window = train_cfg.max_len  # the Transformer's context and the RNN's bptt, in training and validation
        stream = token_stream(data.texts, tokenizers.tgt.encode)
        if len(stream) < 2:
            raise QkvError(f"{data.name}: too little text for a language model ({len(stream)} tokens)")
        return StreamSplit(stream, self, data.texts)

    def loss(self, module, batch: LMBatch, train_cfg: TrainConfig):
        if self.recurrent:
            key = module.training
            state = None if batch.first else carry(self._state[key])
            logits, state = module(batch.inputs, state)
            self._state[key] = carry(state)
            return label_smoothed_nll_loss(logits, batch.targets, train_cfg.label_smoothing)
        return token_loss(module, (batch.inputs,), batch.targets, train_cfg)  # logits (B, T, V)

    def metrics(self, model, split, tokenizers, decode_cfg: DecodeConfig, train_cfg: TrainConfig) -> dict:
        """A greedy continuation of the start of the first validation line, to watch."""
        first = next((t for t in split.texts if len(t.strip()) >= 8), None)
        if first is None:
            return {}
        prompt = first[: max(8, len(first) // 3)]
        text = "".join(LanguageModel(model, tokenizers, train_cfg).generate(prompt, 60, temperature=0))
        return {"valid_samples": [[prompt, text.replace("\n", " / "), first]]}

    def frontend(self, model, tokenizers, config, decode_cfg, train_cfg):
        return LanguageModel(model, tokenizers, train_cfg)


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


class LanguageModel:
    """A trained language model with its tokenizer: :meth:`generate` (streaming) and :meth:`score`."""

    task = "lm"

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, train_cfg: TrainConfig | None = None):
        self.model, self.tokenizers = model, tokenizers
        self.train_cfg = train_cfg or TrainConfig()

    @property
    def tokenizer(self):
        return self.tokenizers.tgt

    @property
    def recurrent(self) -> bool:
        return not hasattr(self.model, "layers")

    def prompt_ids(self, prefix: str) -> list[int]:
        """The token ids of a prompt as the model reads it: each line but the last followed by
        EOS (the training stream's layout); the last line open, to be continued."""
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
        """Continue ``prefix``; yields the text as it is produced (EOS is a line break). The
        prefix's lines end with EOS, except the last, which the model continues. With a subword
        tokenizer end the prefix at a word boundary: a word cut in two is tokenized into pieces the
        model rarely saw in that place."""
        from qkv.decoding.sampling import sample

        ids, max_new_tokens = self.fit_positions(self.prompt_ids(prefix), max_new_tokens)
        lines = prefix.split("\n")
        line = self.tokenizer.encode([lines[-1]])[0]  # the tokens of the line being written
        shown = self.tokenizer.decode([line])[0]
        was_training = self.model.training
        self.model.eval()
        try:
            for t in sample(self.model, ids, max_new_tokens, temperature, top_k, top_p, seed):
                if t == EOS:
                    line, shown = [], ""
                    yield "\n"
                    continue
                line.append(t)
                text = self.tokenizer.decode([line])[0]
                if text.startswith(shown):
                    new = text[len(shown) :]
                else:  # the decoder rewrote the line's end (rare): show the difference from the common start
                    new = text[len(os.path.commonprefix([text, shown])) :]
                shown = text
                if new:
                    yield new
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def score(self, lines: list[str], max_tokens: int | None = None) -> Perplexity:
        """Perplexity and bits per character of ``lines``, cut as validation cuts it (the training
        run's ``max_len`` windows; for an RNN, its carried state over ``max_tokens // max_len`` rows)."""
        task = LmTask()
        task.recurrent = self.recurrent
        split = task.encode(TextData(list(lines), name="text"), self.tokenizers, self.train_cfg, None, train=False)
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        nll, n = 0.0, 0
        try:
            for ix in split.batches(max_tokens or self.train_cfg.max_tokens, shuffle=False, seed=0, epoch=0):
                batch = split.collate(ix).to(device)
                _, nll_sum = task.loss(self.model, batch, TrainConfig(label_smoothing=0.0))
                nll += float(nll_sum)
                n += batch.n_tgt_tokens
        finally:
            self.model.train(was_training)
        return Perplexity(nll, n, sum(len(line) + 1 for line in lines))


__all__ = ["LmTask", "LanguageModel", "LMBatch", "StreamSplit", "Perplexity"]
