"""Tasks: what a model is trained to do. One trainer serves them all; a task supplies the rest.

=============  ==========================  =============================================
task           data                        model (``ModelConfig.task``, ``arch``)
=============  ==========================  =============================================
``translate``  parallel text (src, tgt)    encoder-decoder (:mod:`qkv.models.transformer`)
``classify``   labelled text (JSONL, TSV)  encoder + pooling + linear head (seq2vec)
``mlm``        plain text                  encoder + tied MLM head (masked language model)
``lm``         plain text                  decoder-only, causal (vec2seq)   [tasks/lm.py]
``prefix_lm``  parallel text               decoder-only over ``src <sep> tgt``  [tasks/prefix_lm.py]
=============  ==========================  =============================================

The interface (:class:`qkv.tasks.base.Task`; one module per task, one instance per run)::

    name: str                      "classify"; the key in TASKS and the value of ModelConfig.task
    data_kind: str                 "parallel" (--src-train/--tgt-train...) or "text" (--train/--valid)
    specials: bool                 train the tokenizer with <cls>, [MASK], <sep> at ids 4, 5, 6
    best_metric, best_mode         the validation record key that picks best/, and "min" | "max"
    unit                           what a batch's n_tgt_tokens counts, for the progress line ("tok", "ex")

    read_data(paths: DataPaths, log) -> (train_data, valid_data | None)
        read and validate the files named on the command line (errors name file:line)
    check_data(train_data, valid_data, saved: dict | None) -> None
        validate the data before anything slow happens; learn what the data defines (the label
        set of a classifier); ``saved`` is the config dict of the checkpoint being resumed
    train_tokenizers(train_data, train_cfg) -> TokenizerPair
    model_config(model_cfg, tokenizers) -> ModelConfig
        fill in what the data and tokenizer decide (vocabulary sizes, n_classes)
    state() -> dict
        extra entries for the checkpoint's config.json (e.g. {"labels": [...]}); read back by
        ``check_data(..., saved)`` on resume and by ``frontend`` on load
    encode(data, tokenizers, train_cfg, log, train: bool) -> Split
        tokenize a split; ``train_cfg.max_len`` says what is too long (translation skips such
        training pairs; the encoder tasks truncate every text to its head), and say so in the log
    loss(module, batch, train_cfg) -> (loss_sum, nll_sum)
        float32 sums over the batch's ``n_tgt_tokens`` loss terms; ``module`` may be the DDP /
        compiled wrapper, so call it, never its methods
    metrics(model, split, tokenizers, decode_cfg, train_cfg) -> dict
        extra validation numbers ("valid_accuracy", "valid_bleu", ...); may add
        "valid_samples": [[input, output, reference], ...] shown in the log
    summary(record) -> str         the task's part of the validation log line
    frontend(model, tokenizers, config, decode_cfg, train_cfg) -> object
        what ``qkv.load`` returns (a Translator, an Encoder, ...)

A Split has ``__len__``, ``batches(max_tokens, shuffle, seed, epoch) -> list[list[int]]`` (or a
:class:`~qkv.data.buckets.BatchPlan`, which indexes and slices like one)
(length-bucketed token-budget batches from :mod:`qkv.data.buckets`) and
``collate(indices) -> batch``; a batch has ``.to(device, non_blocking)`` and
``.n_tgt_tokens``, the number of loss terms the update is normalised by (target tokens for
translation and language models, examples for a classifier, chosen positions for mlm).
Randomness in ``collate`` of a training split (mlm's masking) must come from torch's global
generator, which the trainer saves and restores: resumed runs then repeat exactly.

The trainer (:mod:`qkv.training.trainer`) owns everything else: the optimizer and schedule,
accumulation, clipping, DDP, AMP, checkpoints, resume, metrics.jsonl and the progress lines.
"""

from __future__ import annotations

from qkv import config
from qkv.errors import ConfigError
from qkv.tasks.base import DataPaths, Task, TextData
from qkv.tasks.classify import ClassifyTask
from qkv.tasks.lm import LmTask
from qkv.tasks.mlm import MlmTask
from qkv.tasks.prefix_lm import PrefixLmTask
from qkv.tasks.translate import ParallelData, TranslateTask

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (TranslateTask, ClassifyTask, MlmTask, LmTask, PrefixLmTask)}
if tuple(TASKS) != config.TASKS:  # the names are declared once, in qkv.config (ModelConfig validates them)
    raise ImportError(f"qkv.tasks implements {tuple(TASKS)}, but qkv.config.TASKS names {config.TASKS}")


def get_task(name: str) -> Task:
    """A fresh task object for ``ModelConfig.task``."""
    if name not in TASKS:
        raise ConfigError(f"invalid config field 'task': {name!r} is not implemented in this qkv "
                          f"(available: {', '.join(TASKS)})")
    return TASKS[name]()


__all__ = ["TASKS", "get_task", "Task", "DataPaths", "TextData", "ParallelData"]
