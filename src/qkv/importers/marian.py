"""Hugging Face ``MarianMTModel`` (OPUS-MT) folder -> a qkv translation checkpoint.

The inverse of :mod:`qkv.export.hf`. A Marian model is the paper's encoder-decoder with a few
options, each of which is a named :class:`~qkv.config.ModelConfig` field here:

    MarianConfig / the folder              qkv ModelConfig
    post-norm layers, no final LayerNorm   norm_first = false, final_norm = "auto" (none)
    activation_function swish | relu | ..  activation silu | relu | gelu | gelu_tanh
    scale_embedding = true                 embeddings x sqrt(d_model) (qkv's; false is refused)
    static sinusoidal positions            positional = "sinusoidal", sinusoid_layout = "halves"
    share_encoder_decoder_embeddings       share_embeddings = true (separate vocabularies are refused)
    tie_word_embeddings                    tie_output
    final_logits_bias                      output_bias = true
    source.spm, target.spm, vocab.json     :class:`qkv.data.marian_tokenizer.MarianTokenizerPair`
    num_beams, length_penalty, max_length  beam_size, length_penalty (length_norm "length"), max_len_b

The vocabulary's rows are reordered so that qkv's fixed special ids hold Marian's pieces (see
:mod:`qkv.data.marian_tokenizer`): qkv id ``i`` is Marian id ``rows[i]``.

Nothing is converted approximately: an option qkv cannot compute is refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from qkv.config import DecodeConfig, ModelConfig, TrainConfig, to_dict
from qkv.data.marian_tokenizer import MarianTokenizerPair
from qkv.errors import QkvError

ARCHITECTURE = "MarianMTModel"
ARCHITECTURES = (ARCHITECTURE,)
MODEL_TYPES = ("marian",)
DEFAULT_ARCHITECTURE = ARCHITECTURE
# Hugging Face's activation_function -> qkv's activation
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}


def read_json(path: Path) -> dict[str, Any]:
    from qkv.importers import read_json as read

    return read(path)


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from qkv.importers import read_weights as read

    return read(hf_dir)


def refused(message: str) -> QkvError:
    from qkv.importers import ImportRefused

    return ImportRefused(message)


def _get(cfg: dict, key: str, default: Any = None) -> Any:
    return cfg.get(key, default)


def model_config(hf: dict[str, Any], where: Path) -> ModelConfig:
    """The :class:`ModelConfig` of a MarianConfig dict; what qkv cannot compute is refused by name."""
    def refuse(option: str, why: str) -> None:
        raise refused(f"{where}: {option} is not supported: {why}")

    if hf.get("model_type") != "marian" and ARCHITECTURE not in (hf.get("architectures") or []):
        refuse(f"model_type {hf.get('model_type')!r}", "this importer reads MarianMTModel (model_type 'marian')")
    archs = [a for a in (hf.get("architectures") or []) if a != ARCHITECTURE]
    if archs:
        refuse(f"architectures {archs}", "qkv imports MarianMTModel (the encoder-decoder with its LM head)")
    d = int(_get(hf, "d_model", 1024))
    vocab = int(_get(hf, "vocab_size", 0))
    dec_vocab = _get(hf, "decoder_vocab_size") or vocab
    if not _get(hf, "share_encoder_decoder_embeddings", True) or int(dec_vocab) != vocab:
        refuse("share_encoder_decoder_embeddings = false (separate source and target vocabularies)",
               "qkv imports Marian models with one shared vocabulary")
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if _get(hf, enc, 16) != _get(hf, dec, 16):
            refuse(f"{enc} = {_get(hf, enc, 16)} with {dec} = {_get(hf, dec, 16)}",
                   "qkv's encoder and decoder have one width of heads and FFN")
    act = _get(hf, "activation_function", "gelu")
    if act not in ACTIVATIONS:
        refuse(f"activation_function {act!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}")
    if not _get(hf, "scale_embedding", False):
        refuse("scale_embedding = false", "qkv's translation Transformer scales its embeddings by sqrt(d_model)")
    if _get(hf, "normalize_before", False) or _get(hf, "add_final_layer_norm", False) or \
            _get(hf, "normalize_embedding", False):
        refuse("normalize_before / add_final_layer_norm / normalize_embedding", "Marian's layers are post-norm")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    extra: dict[str, Any] = {}
    if "activation" in fields:
        extra["activation"] = ACTIVATIONS[act]
    elif ACTIVATIONS[act] != "relu":
        refuse(f"activation_function {act!r}", "this qkv computes ReLU feed-forward layers only")
    return ModelConfig(
        task="translate", arch="transformer", d_model=d, n_heads=int(_get(hf, "encoder_attention_heads", 16)),
        d_ff=int(_get(hf, "encoder_ffn_dim", 4096)), n_encoder_layers=int(_get(hf, "encoder_layers", 12)),
        n_decoder_layers=int(_get(hf, "decoder_layers", 12)), dropout=float(_get(hf, "dropout", 0.1)),
        attention_dropout=float(_get(hf, "attention_dropout", 0.0)), positional="sinusoidal",
        sinusoid_layout="halves", max_positions=int(_get(hf, "max_position_embeddings", 1024)),
        norm_first=False, final_norm="auto", share_embeddings=True,
        tie_output=bool(_get(hf, "tie_word_embeddings", True)), output_bias=True,
        src_vocab_size=vocab + 1, tgt_vocab_size=vocab + 1, **extra,
    ).validate()


def decode_config(hf: dict[str, Any], gen: dict[str, Any]) -> DecodeConfig:
    """The folder's generation settings as qkv's search: ``num_beams``, ``length_penalty`` (Hugging
    Face's ``log P / |Y|^alpha``: length_norm "length"), ``max_length`` (counting the decoder's start
    token: ``max_length - 2`` tokens, then EOS), ``early_stopping``."""
    def pick(key: str, default: Any) -> Any:
        return gen.get(key, hf.get(key, default))

    beams = int(pick("num_beams", 1) or 1)
    max_length = int(pick("max_length", 512) or 512)
    return DecodeConfig(beam_size=beams, length_penalty=float(pick("length_penalty", 1.0)), length_norm="length",
                        early_stopping=pick("early_stopping", False) is True, max_len_a=0.0,
                        max_len_b=max(1, min(max_length - 2, 1024))).validate()


def specials(hf_dir: Path, hf: dict[str, Any], vocab: dict[str, int]) -> dict[str, str]:
    """The pieces of pad, unk and eos: tokenizer_config.json's, else the config's ids, else Marian's names."""
    tc = read_json(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").is_file() else {}
    by_id = {i: p for p, i in vocab.items()}
    out = {}
    for role, key, default in (("pad", "pad_token_id", "<pad>"), ("unk", None, "<unk>"), ("eos", "eos_token_id", "</s>")):
        piece = tc.get(f"{role}_token")
        if isinstance(piece, dict):  # an AddedToken written out
            piece = piece.get("content")
        if piece is None and key is not None and hf.get(key) in by_id:
            piece = by_id[hf[key]]
        out[role] = piece if isinstance(piece, str) else default
    start = hf.get("decoder_start_token_id", vocab.get(out["pad"]))
    if start != vocab.get(out["pad"]):
        raise QkvError(f"{hf_dir / 'config.json'}: decoder_start_token_id = {start} is not the pad token "
                       f"{out['pad']!r} ({vocab.get(out['pad'])}): qkv's Marian import starts the decoder from <pad>")
    return out


def layers_state(w, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The encoder and decoder layers of a BART-named encoder-decoder (Marian, BART) under qkv's names;
    ``w(name)`` reads one weight (``model.`` prefix)."""
    out: dict[str, torch.Tensor] = {}

    def attention(dst: str, name: str) -> None:
        out[dst + ".in_proj.weight"] = torch.cat([w(f"{name}.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")])
        out[dst + ".in_proj.bias"] = torch.cat([w(f"{name}.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")])
        out[dst + ".out_proj.weight"] = w(name + ".out_proj.weight")
        out[dst + ".out_proj.bias"] = w(name + ".out_proj.bias")

    def norm(dst: str, name: str) -> None:
        out[dst + ".weight"], out[dst + ".bias"] = w(name + ".weight"), w(name + ".bias")

    def ffn(dst: str, name: str) -> None:
        for qkv_name, hf_name in (("w_1", "fc1"), ("w_2", "fc2")):
            out[f"{dst}.ffn.{qkv_name}.weight"] = w(f"{name}.{hf_name}.weight")
            out[f"{dst}.ffn.{qkv_name}.bias"] = w(f"{name}.{hf_name}.bias")
        norm(dst + ".res_ffn.norm", name + ".final_layer_norm")

    for i in range(cfg.n_encoder_layers):
        dst, name = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        attention(dst + ".self_attn", name + ".self_attn")
        norm(dst + ".res_attn.norm", name + ".self_attn_layer_norm")
        ffn(dst, name)
    for i in range(cfg.n_decoder_layers):
        dst, name = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        attention(dst + ".self_attn", name + ".self_attn")
        norm(dst + ".res_self.norm", name + ".self_attn_layer_norm")
        attention(dst + ".cross_attn", name + ".encoder_attn")
        norm(dst + ".res_cross.norm", name + ".encoder_attn_layer_norm")
        ffn(dst, name)
    return out


def state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig, rows: list[int], where: Path) -> dict[str, torch.Tensor]:
    """Marian's weights under qkv's names (:func:`qkv.export.hf.marian_state_dict` reversed, with no
    permutation: ``sinusoid_layout = "halves"`` keeps Marian's dimension order), vocabulary rows
    reordered by ``rows``."""
    def w(name: str) -> torch.Tensor:
        for candidate in (name, name.removeprefix("model.")):
            if candidate in weights:
                return weights[candidate].float()
        raise QkvError(f"{where}: the weights have no {name!r} (not a MarianMTModel state dict?)")

    index = torch.tensor(rows)
    out = layers_state(w, cfg)
    shared = None
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        if name in weights or name.removeprefix("model.") in weights:
            shared = w(name)
            break
    if shared is None:
        raise QkvError(f"{where}: the weights have no shared embedding (model.shared.weight)")
    if shared.size(0) != len(rows) - 1:
        raise QkvError(f"{where}: the embedding has {shared.size(0)} rows, vocab.json {len(rows) - 1} pieces")
    out["src_embed.weight"] = shared[index].contiguous()
    out["tgt_embed.weight"] = out["src_embed.weight"]
    bias = weights.get("final_logits_bias")
    out["output_bias"] = (bias.float().reshape(-1)[index] if bias is not None else torch.zeros(len(rows))).contiguous()
    if not cfg.tie_output:
        out["output_proj.weight"] = w("lm_head.weight")[index].contiguous()
    return out


def convert_folder(hf_dir: str | Path) -> tuple[torch.nn.Module, ModelConfig, MarianTokenizerPair, TrainConfig,
                                                 DecodeConfig]:
    """Read a MarianMTModel folder: the qkv model with its weights, its config, the tokenizer, the
    training settings (max_len within the positions) and the folder's search settings."""
    from qkv.data.marian_tokenizer import read_vocab
    from qkv.models import build_model

    d = Path(hf_dir)
    hf = read_json(d / "config.json")
    cfg = model_config(hf, d / "config.json")
    gen = read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    if (d / "target_vocab.json").is_file():
        raise refused(f"{d / 'target_vocab.json'}: separate source and target vocabularies are not supported")
    vocab = read_vocab(d / "vocab.json")
    tokenizers = MarianTokenizerPair.from_files(d, specials(d, hf, vocab))
    if len(vocab) + 1 != cfg.src_vocab_size:
        raise QkvError(f"{d / 'vocab.json'}: {len(vocab)} pieces, but config.json says vocab_size = {cfg.src_vocab_size - 1}")
    sd = state_dict(read_weights(d), cfg, tokenizers.rows, d)
    model = build_model(cfg)
    missing = sorted(set(model.state_dict()) - set(sd))
    if missing:
        raise QkvError(f"internal: the Marian import left qkv parameters unset: {missing}")
    model.load_state_dict(sd, strict=True)
    max_len = max(1, min(cfg.max_positions - 1, TrainConfig().max_len))
    train = dataclasses.replace(TrainConfig(), vocab_size=cfg.src_vocab_size, max_len=max_len)
    return model, cfg, tokenizers, train, decode_config(hf, gen)


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point: the folder as an :class:`~qkv.importers.Imported`."""
    from qkv.importers import Imported

    model, cfg, tokenizers, train, decode = convert_folder(folder)
    extra = {"decode": to_dict(decode), "data": {"train": f"imported from {Path(folder).name} ({ARCHITECTURE})"},
             "vocabulary": "qkv id i = Marian id rows[i], rows = [pad, unk, pad (as BOS), eos] + the other ids "
                           "ascending (qkv.data.marian_tokenizer)"}
    return Imported(model, cfg, tokenizers, train, extra, ARCHITECTURE)


def write(hf_dir: str | Path, out: str | Path) -> Path:
    """Import the MarianMTModel folder ``hf_dir`` as the qkv checkpoint directory ``out`` (``qkv import``)."""
    from qkv.importers import import_model

    return import_model(hf_dir, out, log=lambda *a: None)


__all__ = ["convert", "convert_folder", "write", "model_config", "decode_config", "state_dict", "ACTIVATIONS"]
