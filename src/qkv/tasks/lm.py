"""Language modelling (vec2seq): plain text, every next token predicted, perplexity.

    p(x_1 .. x_N) = Π_t p(x_t | x_<t),    loss = −Σ_t log p(x_t | x_<t),    PPL = exp(loss / N)

The text is one token stream, each line followed by EOS (:mod:`qkv.data.text`). How the
stream is cut depends on the model:

* decoder-only Transformer (``arch = transformer``): non-overlapping windows of ``max_len``
  tokens, ``max_tokens // max_len`` windows per batch, shuffled each epoch; a window sees only
  its own tokens (the context at its start is empty);
* RNN / LSTM / GRU (``arch = rnn | lstm | gru``): truncated backpropagation through time
  (:mod:`qkv.bptt`). The stream is cut into ``B = max_tokens // max_len`` contiguous
  rows; batch k is window k (``max_len`` = bptt positions) of all rows, in order, never shuffled,
  and the recurrent state at the end of window k (detached) starts window k + 1. The task keeps
  that state between batches (one for training, one for evaluation; it restarts at window 0,
  and from zeros where a resumed run continues mid-epoch). One process only (no torchrun).

Validation (and ``qkv evaluate``) cut the held-out text the same way, so the perplexity of an RNN
uses its carried state and that of the Transformer a context of at most ``max_len`` tokens.
Bits per character = total nll / ln 2 / characters of the text (newlines counted).

Data: ``--train FILE`` and ``--valid FILE``, or ``--valid-fraction F`` to hold out the last F of
the training text; ``--strip-gutenberg`` keeps only the book between the ``*** START`` and
``*** END`` lines. The front-end :class:`qkv.frontends.LanguageModel` generates (streaming) and scores text.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch

from qkv.config import EOS, DecodeConfig, TrainConfig
from qkv.data.text import batchify, holdout_split, lm_windows, read_text, strip_gutenberg, token_stream
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.tasks.base import DataPaths, Task, TextData, token_loss
from qkv.bptt import carry
from qkv.losses import label_smoothed_nll_loss


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
    offers = frozenset({"generate", "evaluate", "viz"})
    kind = "a language model"
    stack = "decoder"
    frontend = "language_model"
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
        self.recurrent = model_cfg.is_recurrent
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
        return {"valid_samples": [[prompt, greedy_continuation(model, tokenizers.tgt, prompt, 60), first]]}


@torch.inference_mode()
def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of a one-line ``prompt``, its lines joined by " / " (a sample to watch
    during validation; :class:`qkv.frontends.LanguageModel` is what users generate with)."""
    from qkv.decoding.greedy import banned_ids
    from qkv.decoding.sampling import sample

    ids = tokenizer.encode([prompt])[0]
    limit = model.max_source_len()
    if limit is not None:  # learned positions: the prompt's tail, and no step past the table
        ids = ids[-(limit // 2 + 1):]
        max_new_tokens = min(max_new_tokens, int(model.max_steps(torch.tensor(max(len(ids) - 1, 0)))))
    was_training = model.training
    model.eval()
    try:
        out = list(sample(model, ids, max_new_tokens, 0.0, 0, 1.0, None, banned=banned_ids(tokenizer)))
    finally:
        model.train(was_training)
    lines, line = [], []
    for t in out:
        if t == EOS:
            lines.append(line)
            line = []
        else:
            line.append(t)
    return " / ".join(tokenizer.decode([*lines, line]))


__all__ = ["LmTask", "LMBatch", "StreamSplit"]
