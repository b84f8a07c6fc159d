"""The Python API: load a checkpoint and translate.

    >>> import qkv
    >>> model = qkv.load("runs/default/best")
    >>> model.translate(["three hundred twenty-one"])
    ['dreihunderteinundzwanzig']

Sentences are tokenized, sorted by length and decoded in batches (greedy or beam search through
the model's incremental ``start``/``step`` interface), then detokenized and returned in input order.

``qkv.load(path, quantize="int8")`` applies dynamic int8 quantisation for faster CPU decoding
(:func:`quantize_int8`; its speed and BLEU cost are in docs/results.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from qkv.config import DecodeConfig, TrainConfig
from qkv.data.batching import collate
from qkv.data.tokenizer import TokenizerPair
from qkv.decoding import Hypothesis, beam_search, greedy, max_output_len
from qkv.errors import CheckpointError, ConfigError, QkvError
from qkv.models import build_model
from qkv.training.checkpoint import load_into, read_checkpoint, read_config


TruncationHandler = Callable[[list[int], int], None]  # (indices of the inputs cut, tokens kept of each)


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
    def translate_scored(self, sentences: list[str], on_truncate: TruncationHandler | None = None,
                         **overrides) -> list[list[tuple[str, float]]]:
        """``(translation, score)`` pairs per sentence; the score is the (length-normalised) log-probability.

        A sentence longer than the model reads (learned positions end at ``max_positions``) is
        translated from its head: ``on_truncate(indices, kept)`` hears which sentences (0-based)
        were cut to how many tokens; without it a warning says so. Outputs never run past what the
        decoder's positions can index either (:func:`qkv.decoding.max_output_len`).
        """
        if isinstance(sentences, str):
            raise TypeError("translate() takes a list of sentences, not a single string")
        cfg = replace(self.decode_cfg, **overrides).validate() if overrides else self.decode_cfg
        self.check_beam(cfg.beam_size)
        was_training = self.model.training
        self.model.eval()
        src_ids = self.fit_sources(self.tokenizers.src.encode(list(sentences)), on_truncate)
        order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))  # similar lengths batch together
        results: list[list[tuple[str, float]]] = [[] for _ in src_ids]
        try:
            for start in range(0, len(order), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                batch = collate([src_ids[i] for i in idx], None).to(self.device)
                src_len = (batch.src != 0).sum(dim=1)
                steps = self.model.max_steps(src_len)  # the last step emits EOS
                max_len = max_output_len(src_len, cfg.max_len_a, cfg.max_len_b,
                                         None if steps is None else torch.as_tensor(steps) - 1)
                if cfg.beam_size == 1 and cfg.nbest == 1:
                    hyps = [[Hypothesis(t, 0.0, 0.0)] for t in greedy(self.model, batch.src, max_len, cfg.min_len)]
                else:
                    hyps = beam_search(self.model, batch.src, cfg.beam_size, cfg.length_penalty, max_len, cfg.nbest,
                                       cfg.min_len, length_norm=cfg.length_norm, early_stopping=cfg.early_stopping)
                for i, nbest in zip(idx, hyps):
                    texts = self.tokenizers.tgt.decode([h.tokens for h in nbest])
                    results[i] = [(t, h.score) for t, h in zip(texts, nbest)]
        finally:
            self.model.train(was_training)
        return results

    def check_beam(self, beam_size: int) -> None:
        """A beam wider than the target vocabulary has nothing to fill it with: refused by name."""
        vocab = self.tokenizers.tgt.vocab_size
        if beam_size > vocab:
            raise ConfigError(f"invalid config field 'beam_size': {beam_size} is larger than the model's target "
                              f"vocabulary ({vocab} tokens); choose at most {vocab}")

    def fit_sources(self, src_ids: list[list[int]], on_truncate: TruncationHandler | None = None) -> list[list[int]]:
        """Token lists cut to what the model reads (its ``max_source_len``, EOS included)."""
        limit = self.model.max_source_len()
        if limit is None:
            return src_ids
        kept = limit - 1  # collate appends EOS
        cut = [i for i, ids in enumerate(src_ids) if len(ids) > kept]
        if cut:
            if on_truncate is None:
                warnings.warn(f"{len(cut)} of {len(src_ids)} sentences are longer than the model reads "
                              f"({kept} tokens, max_positions={limit}): translated from their first {kept} tokens",
                              stacklevel=3)
            else:
                on_truncate(cut, kept)
        return [ids[:kept] for ids in src_ids]


class Int8TiedOutput(nn.Module):
    """A shared (tied) embedding whose pre-softmax projection ``x Eᵀ`` runs as an int8 matrix
    multiply; the embedding lookup itself stays float. Replaces ``model.tgt_embed`` (and
    ``src_embed`` when shared): the tied projection is ``F.linear`` with the embedding matrix,
    not an ``nn.Linear``, so ``quantize_dynamic`` alone would leave it in float32."""

    def __init__(self, embed: nn.Module, qconfig):
        super().__init__()
        self.embed = embed
        vocab, d_model = embed.weight.shape
        linear = nn.Linear(d_model, vocab, bias=False)
        linear.weight = embed.weight  # quantised from the same matrix; the float one is kept for lookups
        self.proj = _quantize_dynamic(nn.Sequential(linear), {nn.Linear: qconfig})[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # (B, T, V)


def _quantize_dynamic(module: nn.Module, spec) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*")
        return quantize_dynamic(module, spec, dtype=torch.qint8, inplace=True)


def quantize_int8(model: nn.Module, output_projection: bool = True) -> nn.Module:
    """Dynamic int8 quantisation for CPU decoding, in place (``torch.ao.quantization.quantize_dynamic``).

    Every ``nn.Linear`` (and the ``nn.LSTM``/``nn.GRU`` of a recurrent model) gets int8 weights
    (one scale per output row); activations are quantised
    on the fly at each call, and everything else (embeddings, LayerNorm, softmax) stays float32.
    Two exceptions: each decoder layer's cross-attention ``in_proj`` stays float (its query and
    key/value parts are read as slices of the fused matrix; the keys/values are computed once
    per sentence anyway), and the tied output projection, which is not an ``nn.Linear``, is
    quantised through :class:`Int8TiedOutput` unless ``output_projection=False``.
    For inference only: the result cannot be trained or saved as a checkpoint.
    """
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    if device.type != "cpu":
        raise QkvError(f"int8 quantisation runs on the CPU only; the model is on {device} (load it with device='cpu')")
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if not engines:
        raise QkvError("int8 quantisation: this torch build has no quantized CPU engine")
    if torch.backends.quantized.engine == "none":
        torch.backends.quantized.engine = engines[0]
    from torch.ao.quantization import per_channel_dynamic_qconfig as qconfig

    sliced = {id(layer.cross_attn.in_proj) for layer in getattr(model, "decoder_layers", [])}
    # nn.LSTM and nn.GRU have dynamic int8 kernels too (nn.RNN has none and stays float32)
    spec = {name: qconfig for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.LSTM, nn.GRU)) and id(m) not in sliced}
    # a tied output projection through a ScaledEmbedding (the Transformer); a recurrent model's stays float32
    tied = (output_projection and getattr(model, "output_proj", "absent") is None
            and hasattr(getattr(model, "tgt_embed", None), "logits"))
    model.eval()
    _quantize_dynamic(model, spec)
    if tied:
        shared = model.src_embed is model.tgt_embed
        model.tgt_embed = Int8TiedOutput(model.tgt_embed, qconfig)
        if shared:
            model.src_embed = model.tgt_embed
    return model


QUANTIZE_CHOICES = (None, "int8")


def load(path: str | Path, device: str | torch.device = "cpu", quantize: str | None = None):
    """Load a checkpoint directory (e.g. ``runs/default/best``) as its task's front-end: a
    :class:`Translator` for translation, a :class:`qkv.encoder.Encoder` for classify and mlm
    (``.classify``, ``.fill``, ``.embed``, ``.search``); see :mod:`qkv.tasks`.

    Only data is read: JSON, safetensors, SentencePiece models; never pickled code.
    ``quantize="int8"``: dynamic int8 quantisation for faster CPU decoding (:func:`quantize_int8`;
    CPU only).
    """
    if quantize not in QUANTIZE_CHOICES:
        raise QkvError(f"quantize must be None or 'int8', got {quantize!r}")
    if quantize and torch.device(device).type != "cpu":
        raise QkvError(f"quantize='int8' runs on the CPU only, not on device {str(device)!r}")
    ckpt = read_checkpoint(Path(path))
    model_cfg, train_cfg, decode_cfg = (read_config(ckpt, s) for s in ("model", "train", "decode"))
    try:
        model_cfg, decode_cfg = model_cfg.validate(), decode_cfg.validate()
    except QkvError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    tokenizers = TokenizerPair.load(Path(path), ckpt.files)
    model = build_model(model_cfg)
    load_into(model, ckpt)
    model.to(device).eval()
    if quantize == "int8":
        quantize_int8(model)
    from qkv.tasks import get_task

    return get_task(model_cfg.task).frontend(model, tokenizers, ckpt.config, decode_cfg, train_cfg)


def load_ensemble(paths: list[str | Path], device: str | torch.device = "cpu", quantize: str | None = None) -> Translator:
    """Load several translation checkpoints as one :class:`Translator` that decodes with the
    mean of their next-token distributions (:class:`qkv.decoding.ensemble.Ensemble`; fairseq's
    ``--path a:b``). The members must share the tokenizers (the same SentencePiece models, so the
    same token ids); the decoding settings are the first checkpoint's.
    """
    from qkv.decoding.ensemble import Ensemble

    paths = [Path(p) for p in paths]
    if not paths:
        raise QkvError("an ensemble needs at least one checkpoint")
    members = [load(p, device, quantize) for p in paths]
    for path, member in zip(paths, members):
        if not isinstance(member, Translator):
            raise QkvError(f"{path}: not a translation model (task {getattr(member, 'task', '?')!r}); "
                           "only translation models decode as an ensemble")
    first = members[0]
    for path, member in zip(paths[1:], members[1:]):
        for side in ("src", "tgt"):
            if getattr(member.tokenizers, side).model_bytes != getattr(first.tokenizers, side).model_bytes:
                raise QkvError(f"{path}: its {side} tokenizer differs from {paths[0]}'s: ensemble members must "
                               "share the vocabulary (train them with the same SentencePiece model: "
                               "qkv train --tokenizer-from FIRST_CHECKPOINT)")
    return Translator(Ensemble([m.model for m in members]).eval(), first.tokenizers, first.decode_cfg, first.train_cfg)


__all__ = ["Translator", "load", "load_ensemble", "quantize_int8", "Int8TiedOutput"]
