"""The encoder front-end run by CTranslate2: :class:`CT2Encoder`, an :class:`~qkv.frontends.Encoder`
whose encoder stack is ``ctranslate2.Encoder``.

    >>> enc = qkv.load("runs/minilm", engine="ctranslate2")            # an imported all-MiniLM-L6-v2
    >>> enc.embed(["a man rides a bike", ""])                            # (2, 384), as qkv's float model

CTranslate2 computes the last hidden states ``H (B, T, d)`` of each batch; everything after them is
the checkpoint's own, in torch: the pooling (mean over the valid positions or the ``<cls>`` state,
an imported sentence-transformers model's Normalize), a classifier's pooler and classification
layer, a masked language model's head (``LayerNorm(GELU(W H + b)) Eᵀ + b_v``). So ``embed``,
``search``, ``classify`` and ``fill`` all work, from the same front-end code as qkv's engine
(tokenizing, truncation, blank texts, batches of similar lengths: sorted by length, cut into
``batch_size`` texts, returned in the caller's order). What needs every layer's attention
(``qkv viz``) is refused by name.

The network built here lives on the meta device but for its heads (their weights are read from
the checkpoint; the encoder's live only in CTranslate2), so a model costs its conversion's memory
and its heads'. ``quantize="int8"``: CTranslate2's int8 compute type for the encoder, but for the
rows of at most :data:`SHORT_ROWS` tokens, which run in float32 (int8 moved their embeddings most);
the heads stay float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qkv.checkpoint import read_checkpoint
from qkv.config import PAD
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import QkvError
from qkv.frontends.encoder import Encoder
from qkv.masks import padding_mask
from qkv.models.encoder_only import EncoderOnly

HEADS = ("pooler", "classifier", "mlm_head")  # the parts of the network that run in torch


class EngineEncoderOnly(EncoderOnly):
    """qkv's encoder-only network whose :meth:`encode` is CTranslate2's; built on the meta device, its
    heads loaded (:func:`load`). ``engine``: the ``ctranslate2.Encoder``."""

    engine = None
    float_engine = None  # with int8: the float32 encoder that runs the shortest rows (SHORT_ROWS)

    def encode(self, tokens: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor, list]:
        """``tokens (B, T)`` (``<cls>`` first, PAD on the right) -> CTranslate2's states ``(B, T, d)``
        (zero at the padding), the padding mask, no attention weights. With int8, the rows of at most
        :data:`SHORT_ROWS` tokens run in float32."""
        if need_weights:
            raise QkvError("the attention weights of every layer come from --engine qkv (CTranslate2's encoder "
                           "returns its last hidden states)")
        lengths = (tokens != PAD).sum(dim=1).tolist()
        rows = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        h = torch.zeros(tokens.size(0), tokens.size(1), self.cfg.d_model)
        short = [i for i, n in enumerate(lengths) if n <= SHORT_ROWS] if self.float_engine is not None else []
        long = sorted(set(range(len(rows))) - set(short))
        for engine, part in ((self.float_engine, short), (self.engine, long)):
            if part:
                states = _tensor(engine.forward_batch([rows[i] for i in part]).last_hidden_state)
                h[part, : states.size(1)] = states
        h = h * (tokens != PAD)[:, :, None]
        return h, padding_mask(tokens), []


# With int8, rows of at most this many tokens (<cls> and the tokenizer's markers included) run in float32:
# CTranslate2's int8 moved all-MiniLM-L6-v2's embeddings of such short texts to cosines 0.969-0.986 against
# the float model (a blank text, "yes no", "..."), where every row of 8 tokens or more stayed above 0.992
# (docs/pretrained.md); short rows cost little, so they keep the float model's answers.
SHORT_ROWS = 8


def _tensor(out) -> torch.Tensor:
    """A CTranslate2 StorageView as a float32 CPU tensor."""
    if out.device == "cpu":
        return torch.from_numpy(np.array(out)).float()
    return torch.as_tensor(out, device="cuda").float().cpu()


class CT2Encoder(Encoder):
    """An :class:`~qkv.frontends.Encoder` whose encoder runs in ``ctranslate2.Encoder`` (see the module)."""

    engine = "ctranslate2"

    directory: Path | None = None  # the conversion it runs

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the heads' (CTranslate2's states are brought there)

    def attention_maps(self, *args, **kwargs):
        raise QkvError("attention maps come from --engine qkv")


def load_encoder(path: Path, directory: Path, model_cfg, train_cfg, decode_cfg, device: tuple[str, int],
                 quantize: str | None, threads: int) -> CT2Encoder:
    """The classify or mlm Transformer at ``path`` with its conversion ``directory`` as a :class:`CT2Encoder`."""
    import ctranslate2

    ckpt = read_checkpoint(path)
    tokenizers = TokenizerPair.load(path, ckpt.files)
    with torch.device("meta"):
        model = EngineEncoderOnly(model_cfg)
    heads = {k: v for k, v in ckpt.state_dict.items() if k.split(".")[0] in HEADS}
    if model_cfg.task == "mlm" and model_cfg.mlm_head:
        heads["src_embed.weight"] = ckpt.state_dict["src_embed.weight"]  # the masked-LM head's tied output matrix
    missing = [k for k in model.state_dict() if k.split(".")[0] in HEADS and k not in heads
               and not k.startswith("mlm_head.embed.")]
    if missing:
        raise QkvError(f"{path}/model.safetensors has no parameter {missing[0]!r} (a head of this model)")
    model.load_state_dict(heads, strict=False, assign=True)
    name, index = device
    model.engine = ctranslate2.Encoder(str(directory), device=name, device_index=index,
                                       compute_type="int8" if quantize else "default", intra_threads=threads)
    if quantize:
        model.float_engine = ctranslate2.Encoder(str(directory), device=name, device_index=index,
                                                 compute_type="default", intra_threads=threads)
    model.eval()
    frontend = CT2Encoder.from_checkpoint(model, tokenizers, ckpt.config, decode_cfg, train_cfg)
    frontend.directory = directory
    return frontend

__all__ = ["CT2Encoder", "EngineEncoderOnly", "load_encoder"]
