"""What an export reads: one checkpoint's settings, weights (by their state_dict names) and tokenizers.

The converters map parameters by name, never through the model's Python attributes, so they
depend only on the checkpoint format: the names below are those of ``model.safetensors``.

    translate, transformer (qkv.models.transformer.Transformer)
        src_embed.weight, tgt_embed.weight (the same tensor when shared), output_proj.weight
        (untied only), src_pos.weight, tgt_pos.weight (learned positions only),
        encoder_layers.{i}.self_attn.{in_proj,out_proj}.{weight,bias}, .ffn.{w_1,w_2}.{weight,bias},
        .res_attn.norm, .res_ffn.norm; decoder_layers.{i}.self_attn, .cross_attn, .ffn, .res_self.norm,
        .res_cross.norm, .res_ffn.norm; encoder_norm, decoder_norm (pre-norm only)
    lm / prefix_lm, transformer (qkv.models.decoder_only.DecoderOnlyTransformer)
        embed.weight, output_proj.weight (untied only), pos.weight (learned only),
        layers.{i}.self_attn, .ffn, .res_attn.norm, .res_ffn.norm; final_norm (pre-norm only)

``in_proj`` is ``[W^Q; W^K; W^V]`` stacked along the output dimension, ``(3 d_model, d_model)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.checkpoint import read_checkpoint, read_config
from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data.tokenizer import Tokenizer, TokenizerPair
from qkv.errors import CheckpointError, QkvError


@dataclass
class Source:
    """A checkpoint opened for export."""

    path: Path
    model: ModelConfig
    train: TrainConfig
    decode: DecodeConfig
    config: dict[str, Any]  # the whole config.json (with what the task and the trainer recorded)
    weights: dict[str, torch.Tensor]  # float32, CPU, by state_dict name
    tokenizers: TokenizerPair
    qkv_version: str

    @property
    def task(self) -> str:
        return self.model.task

    @property
    def key(self) -> tuple[str, str]:
        """``(task, arch)``, the key of :data:`qkv.models.MODELS` and of the converters."""
        return self.model.task, self.model.arch

    def w(self, name: str) -> torch.Tensor:
        """The parameter ``name``; a missing one names the checkpoint (a model this converter does not know)."""
        try:
            return self.weights[name]
        except KeyError:
            raise CheckpointError(f"{self.path}/model.safetensors has no parameter {name!r} "
                                  f"(a {self.task}/{self.model.arch} model of another layout?)") from None

    def has(self, name: str) -> bool:
        return name in self.weights

    def vocabulary(self, side: str) -> list[str]:
        """The pieces of the ``src`` or ``tgt`` SentencePiece model in the order of their ids."""
        tok = self.tokenizer(side)  # (an imported model's tokenizer numbers pieces its own way: ask it)
        return [tok.id_to_piece(i) for i in range(tok.vocab_size)]

    def tokenizer(self, side: str) -> Tokenizer:
        return getattr(self.tokenizers, side)


def read_source(path: str | Path) -> Source:
    """Open the checkpoint directory ``path`` (e.g. ``runs/ende/best``): a clear QkvError when it is
    not one (a missing path, a file, a run directory, a directory of something else)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a checkpoint directory (e.g. runs/NAME/best)")
    if not (p / "manifest.json").exists() and not (p / "config.json").exists() and not (p / "last").is_dir():
        raise CheckpointError(f"{p} is not a qkv checkpoint (it has no config.json and no manifest.json); "
                              "give a checkpoint directory such as runs/NAME/best")
    ckpt = read_checkpoint(p)
    model_cfg, train_cfg, decode_cfg = (read_config(ckpt, s) for s in ("model", "train", "decode"))
    try:
        model_cfg.validate()
        decode_cfg.validate()
    except QkvError as e:
        raise CheckpointError(f"{p}/config.json: {e}") from None
    tokenizers = TokenizerPair.load(p, ckpt.files)
    weights = {k: v.detach().to(torch.float32).cpu() for k, v in ckpt.state_dict.items()}
    return Source(p, model_cfg, train_cfg, decode_cfg, ckpt.config, weights, tokenizers, ckpt.qkv_version)


def checkpoint_name(path: Path) -> str:
    """The checkpoint as the card names it: its run's folder and its own name ("wmt14-base/best"), not
    where it was on the exporting machine."""
    path = Path(path).resolve()
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


__all__ = ["Source", "read_source", "checkpoint_name"]
