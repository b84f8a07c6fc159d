"""Classification (seq2vec): labelled text -> one label per text.

    input  = <cls> x_1 .. x_n         (truncated to max_len subword tokens: the head, or head + tail)
    logits = model(input)              (B, C)
    loss   = sum over the batch of H(q_ls, softmax(logits)),  q_ls the label-smoothed one-hot label

The label set is the sorted set of training labels; it is saved in the checkpoint
(``config.json: "labels"``). A validation label not among them is an error naming its line.
Validation: accuracy and macro-F1 over the whole split; best/ = highest validation accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qkv.config import CLS, DecodeConfig, ModelConfig, TrainConfig
from qkv.data.batching import _pad, token_budget_batches
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import CorpusError, QkvError
from qkv.metrics import accuracy, confusion_matrix, macro_f1
from qkv.tasks.base import DataPaths, Task, TextData
from qkv.losses import label_smoothed_nll_loss

NO_LABEL = -1  # ignore_index of the loss: no class id is negative


def encoder_input(ids: list[list[int]]) -> torch.Tensor:
    """Token lists -> ``(B, T)``: ``<cls>`` first, PAD on the right (the encoder tasks' layout)."""
    return _pad([[CLS, *row] for row in ids])


def truncate(ids: list[list[int]], max_len: int, suffix: list[int] | tuple = (),
             tail: int = 0) -> tuple[list[list[int]], int]:
    """Keep the first ``max_len`` tokens of each text; also return how many were cut. ``suffix``: the
    tokens the tokenizer puts after every text (an imported BERT's ``[SEP]``), kept at the end of a cut one.
    ``tail`` > 0: a cut text keeps its first ``max_len - tail`` tokens and its last ``tail`` (whose end
    is the suffix already)."""
    cut = sum(len(row) > max_len for row in ids)
    if tail:
        if not 0 < tail < max_len or tail < len(suffix):
            raise ValueError(f"tail={tail} must lie in [{max(len(suffix), 1)}, max_len={max_len})")
        return [row if len(row) <= max_len else row[:max_len - tail] + row[len(row) - tail:] for row in ids], cut
    keep = max_len - len(suffix)
    return [row if len(row) <= max_len else row[:keep] + list(suffix) for row in ids], cut


@dataclass
class ClassifyBatch:
    src: torch.Tensor  # (B, T) <cls> x_1 .. x_n, PAD-padded
    labels: torch.Tensor  # (B,) class ids
    indices: list[int]

    @property
    def n_tgt_tokens(self) -> int:
        """Loss terms: one per example."""
        return int(self.labels.numel())

    def to(self, device, non_blocking: bool = False) -> "ClassifyBatch":
        return ClassifyBatch(self.src.to(device, non_blocking=non_blocking),
                             self.labels.to(device, non_blocking=non_blocking), self.indices)

    def __len__(self) -> int:
        return self.src.size(0)


@dataclass
class TextSplit:
    """Encoded one-sided examples (no <cls>; ``collate`` adds it) with optional class ids."""

    ids: list[list[int]]
    labels: list[int] | None
    texts: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def batches(self, max_tokens: int, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
        return token_budget_batches([len(r) for r in self.ids], None, max_tokens, shuffle, seed, epoch)

    def collate(self, indices: list[int]) -> ClassifyBatch:
        assert self.labels is not None
        return ClassifyBatch(encoder_input([self.ids[i] for i in indices]),
                             torch.tensor([self.labels[i] for i in indices], dtype=torch.long), list(indices))


def read_text_data(paths: DataPaths, labelled: bool, log, task: str):
    """--train (+ --valid): JSONL / TSV (labelled) or plain text, JSONL, TSV (unlabelled)."""
    from qkv.data.labelled import read_labelled, read_texts

    if not paths.train:
        raise QkvError(f"--task {task} needs --train FILE (and usually --valid FILE)"
                       + (f"; --src-train/--tgt-train are for translate and prefix_lm" if paths.src_train else ""))
    if paths.src_train or paths.src_valid:
        raise QkvError(f"--task {task} reads --train/--valid; --src-train/--tgt-train are for translate and prefix_lm")
    read = (lambda p: read_labelled(p, paths.text_field, paths.label_field, paths.clean_html)) if labelled else \
        (lambda p: read_texts(p, paths.text_field, paths.clean_html))
    train = read(paths.train)
    log(f"{paths.train}: {len(train)} {'examples' if labelled else 'texts'}")
    valid = None
    if paths.valid:
        valid = read(paths.valid)
        log(f"{paths.valid}: {len(valid)} {'examples' if labelled else 'texts'}")
    return train, valid


def encode_texts(data: TextData, tokenizers: TokenizerPair, max_len: int | None, log, task: str,
                 keep_tail: int = 0) -> list[list[int]]:
    tokenizers.src.require_specials(task)
    ids = tokenizers.src.encode(data.texts)
    if max_len is not None:
        ids, cut = truncate(ids, max_len, getattr(tokenizers.src, "suffix", ()), keep_tail)
        if cut:
            kept = (f"their first {max_len - keep_tail} and last {keep_tail} of max_len={max_len} tokens"
                    if keep_tail else f"their first max_len={max_len} tokens")
            log(f"{data.name}: truncated {cut} of {len(ids)} texts to {kept}")
    return ids


class ClassifyTask(Task):
    name = "classify"
    offers = frozenset({"classify", "evaluate", "embed", "search", "viz"})
    kind = "a classifier"
    stack = "encoder"
    frontend = "encoder"
    best_metric, best_mode = "valid_accuracy", "max"
    unit = "ex"  # one loss term per example

    def __init__(self, labels: list[str] | None = None):
        self.labels: list[str] = list(labels or [])

    def read_data(self, paths: DataPaths, log):
        return read_text_data(paths, True, log, self.name)

    def check_data(self, train_data: TextData, valid_data: TextData | None, saved: dict | None) -> None:
        super().check_data(train_data, valid_data, saved)
        if train_data.labels is None:
            raise QkvError(f"{train_data.name}: classification needs labelled examples")
        labels = sorted(set(train_data.labels))
        if saved is not None and saved.get("labels"):
            if labels != saved["labels"]:
                raise QkvError(f"{train_data.name}: labels {labels} differ from the resumed run's {saved['labels']}")
        if len(labels) < 2:
            raise QkvError(f"{train_data.name}: a classifier needs at least 2 labels, found {labels}")
        self.labels = labels
        if valid_data is not None:
            if valid_data.labels is None:
                raise QkvError(f"{valid_data.name}: validation data for a classifier needs labels")
            known = set(labels)
            for i, label in enumerate(valid_data.labels):
                if label not in known:
                    raise CorpusError(f"{valid_data.name}:{valid_data.line(i)}: label {label!r} does not occur in the "
                                      f"training data (labels: {', '.join(labels)})")

    def model_config(self, model_cfg: ModelConfig, tokenizers: TokenizerPair) -> ModelConfig:
        return replace(super().model_config(model_cfg, tokenizers), n_classes=len(self.labels))

    def state(self) -> dict:
        return {"labels": self.labels}

    def encode(self, data: TextData, tokenizers, train_cfg: TrainConfig, log, train: bool) -> TextSplit:
        index = {label: i for i, label in enumerate(self.labels)}
        ids = encode_texts(data, tokenizers, train_cfg.max_len, log, self.name, train_cfg.keep_tail)
        labels = [index[label] for label in data.labels] if data.labels is not None else None
        return TextSplit(ids, labels, data.texts)

    def loss(self, module, batch: ClassifyBatch, train_cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        logits = module(batch.src)  # (B, C)
        return label_smoothed_nll_loss(logits, batch.labels, train_cfg.label_smoothing, ignore_index=NO_LABEL)

    @torch.no_grad()
    def predict(self, model, split: TextSplit, max_tokens: int) -> list[int]:
        device = next(model.parameters()).device
        preds = [0] * len(split)
        for ix in split.batches(max_tokens, shuffle=False, seed=0, epoch=0):
            logits = model(encoder_input([split.ids[i] for i in ix]).to(device))  # (B, C)
            for i, p in zip(ix, logits.argmax(-1).tolist()):
                preds[i] = p
        return preds

    def metrics(self, model, split: TextSplit, tokenizers, decode_cfg: DecodeConfig, train_cfg: TrainConfig) -> dict:
        preds = self.predict(model, split, train_cfg.max_tokens)
        matrix = confusion_matrix(split.labels, preds, len(self.labels))
        return {"valid_accuracy": accuracy(split.labels, preds), "valid_macro_f1": macro_f1(matrix),
                "valid_confusion": matrix}

    def summary(self, v: dict) -> str:
        return f"  accuracy {100 * v['valid_accuracy']:.2f}%  macro-F1 {100 * v['valid_macro_f1']:.2f}"
