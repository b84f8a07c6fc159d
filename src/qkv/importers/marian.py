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
from qkv.importers.folder import REQUIRED

ARCHITECTURE = "MarianMTModel"
ARCHITECTURES = (ARCHITECTURE,)
MODEL_TYPES = ("marian",)
DEFAULT_ARCHITECTURE = ARCHITECTURE
# Hugging Face's activation_function -> qkv's activation
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}


def read_json(path: Path) -> dict[str, Any]:
    from qkv.importers.folder import read_json as read

    return read(path)


def read_weights(hf_dir: Path, config=None):
    from qkv.importers.folder import read_weights as read

    return read(hf_dir, config)


def refused(message: str) -> QkvError:
    from qkv.importers import ImportRefused

    return ImportRefused(message)


def model_config(hf, where: Path) -> ModelConfig:
    """The :class:`ModelConfig` of a MarianConfig (a dict or a :class:`~qkv.importers.folder.Config`); a
    malformed field is refused naming it, and what qkv cannot compute is refused by name."""
    from qkv.importers.folder import Config

    c = hf if isinstance(hf, Config) else Config(hf, where)

    def refuse(option: str, why: str) -> None:
        raise refused(f"{where}: {option} is not supported: {why}")

    model_type, architectures = c.str("model_type", ""), c.list("architectures", [])
    if model_type != "marian" and ARCHITECTURE not in architectures:
        refuse(f"model_type {c.get('model_type')!r}", "this importer reads MarianMTModel (model_type 'marian')")
    archs = [a for a in architectures if a != ARCHITECTURE]
    if archs:
        refuse(f"architectures {archs}", "qkv imports MarianMTModel (the encoder-decoder with its LM head)")
    d = c.int("d_model", 1024)
    vocab = c.int("vocab_size")
    dec_vocab = c.int("decoder_vocab_size", vocab)
    if not c.bool("share_encoder_decoder_embeddings", True) or dec_vocab != vocab:
        refuse("share_encoder_decoder_embeddings = false (separate source and target vocabularies)",
               "qkv imports Marian models with one shared vocabulary")
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c.int(enc, 16) != c.int(dec, 16):
            refuse(f"{enc} = {c.int(enc, 16)} with {dec} = {c.int(dec, 16)}",
                   "qkv's encoder and decoder have one width of heads and FFN")
    heads = c.int("encoder_attention_heads", 16)
    if d % heads:
        c.error(f"d_model {d} is not a multiple of encoder_attention_heads {heads}")
    act = c.str("activation_function", "gelu")
    if act not in ACTIVATIONS:
        refuse(f"activation_function {act!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}")
    if not c.bool("scale_embedding", False):
        refuse("scale_embedding = false", "qkv's translation Transformer scales its embeddings by sqrt(d_model)")
    if c.bool("normalize_before", False) or c.bool("add_final_layer_norm", False) or \
            c.bool("normalize_embedding", False):
        refuse("normalize_before / add_final_layer_norm / normalize_embedding", "Marian's layers are post-norm")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    extra: dict[str, Any] = {}
    if "activation" in fields:
        extra["activation"] = ACTIVATIONS[act]
    elif ACTIVATIONS[act] != "relu":
        refuse(f"activation_function {act!r}", "this qkv computes ReLU feed-forward layers only")
    return ModelConfig(
        task="translate", arch="transformer", d_model=d, n_heads=heads,
        d_ff=c.int("encoder_ffn_dim", 4096), n_encoder_layers=c.int("encoder_layers", 12),
        n_decoder_layers=c.int("decoder_layers", 12), dropout=c.float("dropout", 0.1, at_least=0, below=1),
        attention_dropout=c.float("attention_dropout", 0.0, at_least=0, below=1), positional="sinusoidal",
        sinusoid_layout="halves", max_positions=c.int("max_position_embeddings", 1024, at_least=2, at_most=1 << 16),
        norm_first=False, final_norm="auto", share_embeddings=True,
        tie_output=c.bool("tie_word_embeddings", True), output_bias=True,
        src_vocab_size=vocab + 1, tgt_vocab_size=vocab + 1, **extra,
    ).validate()


def decode_config(hf, gen, where: Path = Path("config.json"),
                  gen_where: Path = Path("generation_config.json")) -> DecodeConfig:
    """The folder's generation settings as qkv's search: ``num_beams``, ``length_penalty`` (Hugging
    Face's ``log P / |Y|^alpha``: length_norm "length"), ``max_length`` (counting the decoder's start
    token: ``max_length - 2`` tokens, then EOS), ``early_stopping``; generation_config.json's first."""
    from qkv.importers.folder import Config

    c = hf if isinstance(hf, Config) else Config(hf, where)
    g = gen if isinstance(gen, Config) else Config(gen, gen_where)

    def pick(key: str):
        return g if key in g else c

    beams = pick("num_beams").int("num_beams", 1, at_most=1024)
    max_length = pick("max_length").int("max_length", 512)
    penalty = pick("length_penalty").float("length_penalty", 1.0)
    return DecodeConfig(beam_size=beams, length_penalty=penalty, length_norm="length",
                        early_stopping=pick("early_stopping").get("early_stopping", False) is True, max_len_a=0.0,
                        max_len_b=max(1, min(max_length - 2, 1024))).validate()


def specials(hf_dir: Path, hf, vocab: dict[str, int]) -> dict[str, str]:
    """The pieces of pad, unk and eos: tokenizer_config.json's, else the config's ids, else Marian's names."""
    from qkv.importers.folder import Config, FolderError

    c = hf if isinstance(hf, Config) else Config(hf, hf_dir / "config.json")
    tc = read_json(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").exists() else {}
    by_id = {i: p for p, i in vocab.items()}
    out = {}
    for role, key, default in (("pad", "pad_token_id", "<pad>"), ("unk", None, "<unk>"), ("eos", "eos_token_id", "</s>")):
        piece = tc.get(f"{role}_token")
        if isinstance(piece, dict):  # an AddedToken written out
            piece = piece.get("content")
        if piece is None and key is not None:
            i = c.int(key, None, at_least=0)
            piece = by_id.get(i) if i is not None else None
        out[role] = piece if isinstance(piece, str) else default
    if len(set(out.values())) != 3:
        raise FolderError(f"{hf_dir / 'tokenizer_config.json'}: pad, unk and eos must be three different pieces, "
                          f"got {out}")
    pad = vocab.get(out["pad"])
    start = c.int("decoder_start_token_id", pad, at_least=0) if pad is not None else c.get("decoder_start_token_id")
    if start != pad:
        raise QkvError(f"{hf_dir / 'config.json'}: decoder_start_token_id = {start} is not the pad token "
                       f"{out['pad']!r} ({pad}): qkv's Marian import starts the decoder from <pad>")
    return out


def taker(weights):
    """``w(name, shape, fields=("d_model",), default=REQUIRED)``: :meth:`~qkv.importers.folder.Weights.take`
    of ``name`` as the folder stores it (with or without the ``model.`` prefix); ``w.prefixed`` says which."""
    prefixed = any(k.startswith("model.") for k in weights)

    def w(name: str, shape, fields=("d_model",), default: Any = REQUIRED) -> torch.Tensor:
        return weights.take(name if prefixed else name.removeprefix("model."), shape, fields, default=default)

    w.prefixed = prefixed
    return w


def layers_state(w, cfg: ModelConfig, FF: tuple = ("d_model", "encoder_ffn_dim")) -> dict[str, torch.Tensor]:
    """The encoder and decoder layers of a BART-named encoder-decoder (Marian, BART) under qkv's names;
    ``w(name, shape, fields=("d_model",))`` takes one weight (``model.`` prefix) with its shape, naming
    config.json's ``fields`` when it does not fit (``FF``: the fields of the FFN's shapes)."""
    d, ff = cfg.d_model, cfg.d_ff
    out: dict[str, torch.Tensor] = {}

    def attention(dst: str, name: str) -> None:
        out[dst + ".in_proj.weight"] = torch.cat([w(f"{name}.{p}.weight", (d, d)) for p in ("q_proj", "k_proj", "v_proj")])
        out[dst + ".in_proj.bias"] = torch.cat([w(f"{name}.{p}.bias", (d,)) for p in ("q_proj", "k_proj", "v_proj")])
        out[dst + ".out_proj.weight"] = w(name + ".out_proj.weight", (d, d))
        out[dst + ".out_proj.bias"] = w(name + ".out_proj.bias", (d,))

    def norm(dst: str, name: str) -> None:
        out[dst + ".weight"], out[dst + ".bias"] = w(name + ".weight", (d,)), w(name + ".bias", (d,))

    def ffn(dst: str, name: str) -> None:
        out[f"{dst}.ffn.w_1.weight"] = w(f"{name}.fc1.weight", (ff, d), FF)
        out[f"{dst}.ffn.w_1.bias"] = w(f"{name}.fc1.bias", (ff,), FF)
        out[f"{dst}.ffn.w_2.weight"] = w(f"{name}.fc2.weight", (d, ff), FF)
        out[f"{dst}.ffn.w_2.bias"] = w(f"{name}.fc2.bias", (d,), FF)
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


def state_dict(weights, cfg: ModelConfig, rows: list[int], where: Path) -> dict[str, torch.Tensor]:
    """Marian's weights (:class:`~qkv.importers.folder.Weights`) under qkv's names
    (:func:`qkv.export.hf.marian_state_dict` reversed, with no permutation: ``sinusoid_layout = "halves"``
    keeps Marian's dimension order), vocabulary rows reordered by ``rows``; each tensor taken with the
    shape config.json gives it."""
    d, vocab = cfg.d_model, len(rows) - 1
    w = taker(weights)
    for side, n, field in (("encoder", cfg.n_encoder_layers, "encoder_layers"),
                           ("decoder", cfg.n_decoder_layers, "decoder_layers")):
        weights.check_layers(("model\\." if w.prefixed else "") + side + r"\.layers\.(\d+)\.", n, field)
    index = torch.tensor(rows)
    out = layers_state(w, cfg)
    V = ("vocab_size", "d_model")
    shared = None
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        shared = w(name, (vocab, d), V, default=None)
        if shared is not None:
            break
    if shared is None:
        raise QkvError(f"{where}: the weights have no shared embedding (model.shared.weight)")
    out["src_embed.weight"] = shared[index].contiguous()
    out["tgt_embed.weight"] = out["src_embed.weight"]
    bias = weights.take("final_logits_bias", (1, vocab), ("vocab_size",), default=None)
    out["output_bias"] = (bias.reshape(-1)[index] if bias is not None else torch.zeros(len(rows))).contiguous()
    if not cfg.tie_output:
        out["output_proj.weight"] = weights.take("lm_head.weight", (vocab, d), V)[index].contiguous()
    return out


def convert_folder(hf_dir: str | Path) -> tuple[torch.nn.Module, ModelConfig, MarianTokenizerPair, TrainConfig,
                                                 DecodeConfig]:
    """Read a MarianMTModel folder: the qkv model with its weights, its config, the tokenizer, the
    training settings (max_len within the positions) and the folder's search settings."""
    from qkv.data.marian_tokenizer import read_vocab
    from qkv.importers.folder import Config, load_state, read_config
    from qkv.models import build_model

    d = Path(hf_dir)
    c = read_config(d / "config.json")
    cfg = model_config(c, d / "config.json")
    gen_path = d / "generation_config.json"
    gen = read_config(gen_path) if gen_path.exists() else Config({}, gen_path)
    if (d / "target_vocab.json").exists():
        raise refused(f"{d / 'target_vocab.json'}: separate source and target vocabularies are not supported")
    vocab = read_vocab(d / "vocab.json")
    tokenizers = MarianTokenizerPair.from_files(d, specials(d, c, vocab))
    if len(vocab) + 1 != cfg.src_vocab_size:
        raise QkvError(f"{d / 'vocab.json'}: {len(vocab)} pieces, but config.json says vocab_size = {cfg.src_vocab_size - 1}")
    decode = decode_config(c, gen)
    sd = state_dict(read_weights(d, c), cfg, tokenizers.rows, d)  # every tensor checked before a model is built
    model = build_model(cfg)
    load_state(model, sd, c)
    max_len = max(1, min(cfg.max_positions - 1, TrainConfig().max_len))
    train = dataclasses.replace(TrainConfig(), vocab_size=cfg.src_vocab_size, max_len=max_len)
    return model, cfg, tokenizers, train, decode


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
