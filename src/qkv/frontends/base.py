"""What every front-end shares: a model in eval mode on its device, its tokenizers and settings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from qkv.config import UNK, DecodeConfig, TrainConfig
from qkv.data.tokenizer import TokenizerPair

TruncationHandler = Callable[[list[int], int], None]  # (indices of the inputs cut, tokens kept of each)


class Frontend:
    """A trained model with its tokenizers: the base of :class:`~qkv.frontends.Translator`,
    :class:`~qkv.frontends.Encoder` and :class:`~qkv.frontends.LanguageModel`.

    ``name``: what a task names as its front-end (:attr:`qkv.tasks.base.Task.frontend`);
    :func:`qkv.load` opens a checkpoint as the front-end its task names. ``from_checkpoint`` builds
    one from what a checkpoint holds.
    """

    name = "frontend"
    engine = "qkv"  # what decodes: qkv's own modules (a CTranslate2 translator says "ctranslate2")
    default_task = "translate"  # the task of a model without a config (an ensemble of translators)

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, train_cfg: TrainConfig | None = None):
        self.model = model
        self.tokenizers = tokenizers
        self.train_cfg = train_cfg or TrainConfig()

    @classmethod
    def from_checkpoint(cls, model: torch.nn.Module, tokenizers: TokenizerPair, config: dict,
                        decode_cfg: DecodeConfig, train_cfg: TrainConfig) -> "Frontend":
        return cls(model, tokenizers, train_cfg)

    @property
    def task(self) -> str:
        cfg = getattr(self.model, "cfg", None)
        return cfg.task if cfg is not None else self.default_task

    @property
    def task_declaration(self):
        """The :class:`~qkv.tasks.base.Task` of this model (what it offers, its stack, ...)."""
        from qkv.tasks import get_task

        return get_task(self.task)

    @property
    def offers(self) -> frozenset[str]:
        """What this model serves (its task's :attr:`~qkv.tasks.base.Task.offers`): "classify", "fill", ..."""
        return self.task_declaration.offers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def unknown_words(self, texts: list[str]) -> list[list[str]]:
        """For each text, its words (split at white space) that the model's input vocabulary cannot read:
        the tokenizer gives them the unknown id (UNK), so the model sees ``<unk>`` where they stand and its
        output for the text is a guess (on the embedded number task: "Twelve", its capital T; "million",
        its m). Empty lists for texts that read whole; texts without a tokenizer UNK cost one encode."""
        tokenizer = self.tokenizers.src
        flagged = [i for i, row in enumerate(tokenizer.encode(list(texts))) if UNK in row]
        out: list[list[str]] = [[] for _ in texts]
        for i in flagged:
            words = texts[i].split()
            out[i] = [w for w, row in zip(words, tokenizer.encode(words)) if UNK in row] or [texts[i]]
        return out

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """The model in eval mode (no dropout) for the block, then as it was."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)


__all__ = ["Frontend", "TruncationHandler"]
