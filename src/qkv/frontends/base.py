"""What every front-end shares: a model in eval mode on its device, its tokenizers and settings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from qkv.config import DecodeConfig, TrainConfig
from qkv.data.tokenizer import TokenizerPair

TruncationHandler = Callable[[list[int], int], None]  # (indices of the inputs cut, tokens kept of each)


class Frontend:
    """A trained model with its tokenizers: the base of :class:`~qkv.frontends.Translator`,
    :class:`~qkv.frontends.Encoder` and :class:`~qkv.frontends.LanguageModel`.

    ``tasks``: the tasks (``ModelConfig.task``) whose checkpoints :func:`qkv.load` opens as this
    front-end. ``from_checkpoint`` builds one from what a checkpoint holds.
    """

    tasks: tuple[str, ...] = ()

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
        return cfg.task if cfg is not None else self.tasks[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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
