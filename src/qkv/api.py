"""The Python API: load a checkpoint and translate.

    >>> import qkv
    >>> model = qkv.load("runs/default/best")
    >>> model.translate(["three hundred twenty-one"])
    ['dreihunderteinundzwanzig']

Sentences are tokenized, sorted by length and decoded in batches (greedy or beam search through
the model's incremental ``start``/``step`` interface), then detokenized and returned in input order.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from qkv.config import DecodeConfig, ModelConfig, TrainConfig, from_dict
from qkv.data.batching import collate
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding import Hypothesis, beam_search, greedy, max_output_len
from qkv.errors import CheckpointError, QkvError
from qkv.models import build_model
from qkv.training.checkpoint import load_into, read_checkpoint


class Translator:
    """A trained model with its tokenizers and decoding settings."""

    def __init__(self, model: torch.nn.Module, tokenizers: TokenizerPair, decode_cfg: DecodeConfig | None = None,
                 train_cfg: TrainConfig | None = None):
        self.model = model
        self.tokenizers = tokenizers
        self.decode_cfg = (decode_cfg or DecodeConfig()).validate()
        self.train_cfg = train_cfg

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def translate(self, sentences: list[str], **overrides) -> list[str]:
        """Translate each sentence; ``overrides`` are :class:`DecodeConfig` fields (e.g. ``beam_size=1``)."""
        return [nbest[0] for nbest in self.translate_nbest(sentences, **overrides)]

    def translate_nbest(self, sentences: list[str], **overrides) -> list[list[str]]:
        """The ``nbest`` best translations of each sentence, best first."""
        return [[text for text, _ in hyps] for hyps in self.translate_scored(sentences, **overrides)]

    @torch.inference_mode()
    def translate_scored(self, sentences: list[str], **overrides) -> list[list[tuple[str, float]]]:
        """``(translation, score)`` pairs per sentence; the score is the (length-normalised) log-probability."""
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        cfg = replace(self.decode_cfg, **overrides).validate() if overrides else self.decode_cfg
        was_training = self.model.training
        self.model.eval()
        src_ids = self.tokenizers.src.encode(list(sentences))
        order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))  # similar lengths batch together
        results: list[list[tuple[str, float]]] = [[] for _ in src_ids]
        try:
            for start in range(0, len(order), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                batch = collate([src_ids[i] for i in idx], None).to(self.device)
                src_len = (batch.src != 0).sum(dim=1)
                max_len = max_output_len(src_len, cfg.max_len_a, cfg.max_len_b)
                if cfg.beam_size == 1 and cfg.nbest == 1:
                    hyps = [[Hypothesis(t, 0.0, 0.0)] for t in greedy(self.model, batch.src, max_len, cfg.min_len)]
                else:
                    hyps = beam_search(self.model, batch.src, cfg.beam_size, cfg.length_penalty, max_len, cfg.nbest,
                                       cfg.min_len)
                for i, nbest in zip(idx, hyps):
                    texts = self.tokenizers.tgt.decode([h.tokens for h in nbest])
                    results[i] = [(t, h.score) for t, h in zip(texts, nbest)]
        finally:
            self.model.train(was_training)
        return results


def load(path: str | Path, device: str | torch.device = "cpu") -> Translator:
    """Load a checkpoint directory (e.g. ``runs/default/best``) as a :class:`Translator`.

    Only data is read: JSON, safetensors, SentencePiece models; never pickled code.
    """
    ckpt = read_checkpoint(Path(path))
    try:
        model_cfg = from_dict(ModelConfig, ckpt.config["model"], f"{path}/config.json").validate()
        decode_cfg = from_dict(DecodeConfig, ckpt.config.get("decode", {}), f"{path}/config.json").validate()
        train_cfg = from_dict(TrainConfig, ckpt.config.get("train", {}), f"{path}/config.json")
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json: missing section {e}") from None
    except QkvError as e:
        raise CheckpointError(str(e)) from None
    tokenizers = TokenizerPair.load(Path(path))
    model = build_model(model_cfg)
    load_into(model, ckpt)
    model.to(device).eval()
    return Translator(model, tokenizers, decode_cfg, train_cfg)


__all__ = ["Translator", "load"]
