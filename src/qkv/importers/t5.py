"""Hugging Face ``T5ForConditionalGeneration`` folders (T5 v1, v1.1, Flan-T5) -> qkv translation checkpoints.

T5 is the paper's encoder-decoder with these switches, each a named :class:`~qkv.config.ModelConfig`
field (the importer maps names and settings and computes nothing):

    the folder's config.json                     qkv ModelConfig
    pre-norm layers, final_layer_norm            norm_first = true, final_norm = "auto"
    T5LayerNorm: RMS, no bias (layer_norm_eps.)  norm = "rmsnorm", norm_bias = false, layer_norm_eps
    relative_attention_bias (buckets, heads),    positional = "relative", relative_buckets,
      in each stack's first layer, shared          relative_max_distance; src_pos / tgt_pos
    no 1/sqrt(d_kv) (folded into W^Q)            attention_scale = false
    no biases anywhere                           qkv_bias = out_bias = ffn_bias = false
    feed_forward_proj relu (v1)                  activation = "relu"
    feed_forward_proj gated-gelu (v1.1, Flan)    ffn_gated = true, activation = "gelu_tanh" (gelu_new)
    shared embedding, not scaled                 share_embeddings = true, scale_embeddings = false
    lm_head (v1: the shared matrix, the          tie_output = false, output_proj = lm_head
      decoder output scaled by d_model^-0.5)       (x d_model^-0.5 where T5 scales)
    tokenizer.json (SentencePiece Unigram)       :class:`qkv.data.pretrained.HFTokenizer`

T5's decoder starts from its pad token (``decoder_start_token_id``); qkv's decoder starts from BOS, so
the id map puts T5's pad at qkv's BOS and gives qkv's PAD (padding only, always masked) a row of its
own: the network reads exactly T5's ids. ``</s>`` is qkv's EOS, which qkv appends to every source as
T5's tokenizer does. Refused by name: a head width ``d_kv`` other than d_model / num_heads (T5 v1.1
small), a decoder start other than the pad token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from qkv.config import BOS, EOS, MAX_POSITIONS, PAD, UNK, ModelConfig, TrainConfig, to_dict
from qkv.errors import QkvError

ARCHITECTURES = ("T5ForConditionalGeneration",)
MODEL_TYPES = ("t5",)
DEFAULT_ARCHITECTURE = "T5ForConditionalGeneration"
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}


def _refuse(where: Path, option: str, why: str) -> None:
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {option} is not supported: {why}")


def _config(hf, where: Path):
    from qkv.importers.folder import Config

    return hf if isinstance(hf, Config) else Config(hf, where)


def feed_forward(hf, where: Path) -> tuple[str, bool]:
    """``feed_forward_proj`` as (qkv's activation, gated): ``relu``, ``gated-gelu`` (GELU's tanh form, as
    transformers reads it), ``gated-ACT``."""
    proj = _config(hf, where).str("feed_forward_proj", "relu")
    parts = proj.split("-")
    gated = len(parts) == 2 and parts[0] == "gated"
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if len(parts) > 2 or (len(parts) == 2 and not gated) or act not in ACTIVATIONS:
        _refuse(where, f"feed_forward_proj {proj!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}, plain or gated")
    return ACTIVATIONS[act], gated


def model_config(hf, where: Path, vocab_size: int) -> ModelConfig:
    """The :class:`ModelConfig` of a T5 config.json (a dict or a :class:`~qkv.importers.folder.Config`); a
    malformed field is refused naming it, what qkv cannot compute is refused by name."""
    c = _config(hf, where)
    d, heads = c.int("d_model", 512), c.int("num_heads", 8, at_most=4096)
    d_kv = c.int("d_kv", 64)
    if d_kv * heads != d:
        _refuse(where, f"d_kv = {d_kv} with num_heads = {heads} and d_model = {d}",
                "qkv's heads are d_model / num_heads wide (d_kv x num_heads = d_model)")
    act, gated = feed_forward(c, where)
    layers = c.int("num_layers", 6)
    dropout = c.float("dropout_rate", 0.1, at_least=0, below=1)
    return ModelConfig(
        task="translate", arch="transformer", d_model=d, n_heads=heads, d_ff=c.int("d_ff", 2048),
        n_encoder_layers=layers, n_decoder_layers=c.int("num_decoder_layers", layers),
        dropout=dropout, attention_dropout=dropout, positional="relative",
        relative_buckets=c.int("relative_attention_num_buckets", 32, at_least=2, at_most=4096),
        relative_max_distance=c.int("relative_attention_max_distance", 128, at_most=MAX_POSITIONS), max_positions=512,
        norm_first=True, final_norm="auto", norm="rmsnorm", norm_bias=False,
        layer_norm_eps=c.float("layer_norm_epsilon", 1e-6, at_least=0, at_most=1), activation=act, ffn_gated=gated,
        ffn_bias=False, qkv_bias=False, out_bias=False, attention_scale=False, scale_embeddings=False,
        share_embeddings=True, tie_output=False, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
        output_bias=True,  # 0 on the model's tokens, -1e4 on the rows qkv adds: folder.added_rows_bias
    ).validate()


def scales_output(hf) -> bool:
    """Whether T5 multiplies the decoder output by d_model^-0.5 before lm_head: transformers'
    ``scale_decoder_outputs`` where the config has it, else a tied head (T5 v1; not v1.1 or Flan)."""
    c = _config(hf, Path("config.json"))
    if "scale_decoder_outputs" in c:
        return c.bool("scale_decoder_outputs")
    return c.bool("tie_word_embeddings", True) is not False


def state_dict(weights, cfg: ModelConfig, hf, idmap, where: Path, vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The folder's weights (:class:`~qkv.importers.folder.Weights`) under qkv's names, vocabulary rows in
    qkv's order; each tensor taken with the shape config.json gives it (``vocab``: its vocab_size)."""
    c = _config(hf, where / "config.json")
    d, ff, h = cfg.d_model, cfg.d_ff, cfg.n_heads
    D, FF, V = ("d_model",), ("d_model", "d_ff"), ("vocab_size", "d_model")

    def w(name: str, shape, fields=D) -> torch.Tensor:
        return weights.take(name, shape, fields)

    weights.check_layers(r"encoder\.block\.(\d+)\.", cfg.n_encoder_layers, "num_layers")
    weights.check_layers(r"decoder\.block\.(\d+)\.", cfg.n_decoder_layers,
                         "num_decoder_layers" if "num_decoder_layers" in c else "num_layers")
    out: dict[str, torch.Tensor] = {}
    shared = w("shared.weight" if "shared.weight" in weights else "encoder.embed_tokens.weight", (vocab, d), V)
    out["src_embed.weight"] = idmap.rows(shared).contiguous()
    out["tgt_embed.weight"] = out["src_embed.weight"]
    head = weights.take("lm_head.weight", (vocab, d), V, default=None)
    head = shared if head is None else head
    out["output_proj.weight"] = (idmap.rows(head) * (cfg.d_model ** -0.5 if scales_output(c) else 1.0)).contiguous()
    for side, prefix in (("src_pos", "encoder"), ("tgt_pos", "decoder")):
        out[f"{side}.weight"] = w(f"{prefix}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                  (cfg.relative_buckets, h), ("relative_attention_num_buckets", "num_heads"))
    out["encoder_norm.weight"] = w("encoder.final_layer_norm.weight", (d,))
    out["decoder_norm.weight"] = w("decoder.final_layer_norm.weight", (d,))

    def attention(dst: str, src: str) -> None:
        out[f"{dst}.in_proj.weight"] = torch.cat([w(f"{src}.{p}.weight", (d, d), ("d_model", "num_heads", "d_kv"))
                                                  for p in "qkv"])
        out[f"{dst}.out_proj.weight"] = w(f"{src}.o.weight", (d, d), ("d_model", "num_heads", "d_kv"))

    def ffn(dst: str, src: str) -> None:
        names = (("w_1", "wi_0"), ("w_3", "wi_1"), ("w_2", "wo")) if cfg.ffn_gated else (("w_1", "wi"), ("w_2", "wo"))
        for q, t in names:
            out[f"{dst}.ffn.{q}.weight"] = w(f"{src}.DenseReluDense.{t}.weight", (d, ff) if q == "w_2" else (ff, d), FF)

    for i in range(cfg.n_encoder_layers):
        dst, src = f"encoder_layers.{i}", f"encoder.block.{i}.layer"
        attention(dst + ".self_attn", src + ".0.SelfAttention")
        out[dst + ".res_attn.norm.weight"] = w(src + ".0.layer_norm.weight", (d,))
        ffn(dst, src + ".1")
        out[dst + ".res_ffn.norm.weight"] = w(src + ".1.layer_norm.weight", (d,))
    for i in range(cfg.n_decoder_layers):
        dst, src = f"decoder_layers.{i}", f"decoder.block.{i}.layer"
        attention(dst + ".self_attn", src + ".0.SelfAttention")
        out[dst + ".res_self.norm.weight"] = w(src + ".0.layer_norm.weight", (d,))
        attention(dst + ".cross_attn", src + ".1.EncDecAttention")
        out[dst + ".res_cross.norm.weight"] = w(src + ".1.layer_norm.weight", (d,))
        ffn(dst, src + ".2")
        out[dst + ".res_ffn.norm.weight"] = w(src + ".2.layer_norm.weight", (d,))
    from qkv.importers.folder import added_rows_bias

    out["output_bias"] = added_rows_bias(idmap)
    return out


def tokenizer(folder: Path, hf: dict):
    """tokenizer.json with T5's pad (its decoder start) as qkv's BOS, ``</s>`` as EOS, ``<unk>`` as UNK; qkv's
    PAD a row of its own. No suffix: qkv appends EOS (T5's ``</s>``) to every source itself."""
    from qkv.data.pretrained import HFTokenizer, _hf, special_token_names
    from qkv.data.tokenizer import TokenizerPair
    from qkv.importers.folder import read_tokenizer_json

    c = _config(hf, folder / "config.json")
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise QkvError(f"{path}: missing (save the tokenizer with T5TokenizerFast.save_pretrained, which writes it)")
    data = read_tokenizer_json(path)
    tok = _hf().Tokenizer.from_str(data.decode("utf-8"))
    names = special_token_names(folder)
    pad = c.int("pad_token_id", 0, at_least=0)
    eos = c.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, bool) or not isinstance(eos, int) or eos < 0:
        c.error(f"eos_token_id must be a token id (or a list of them), got {str(c.get('eos_token_id'))[:40]}")
    start = c.int("decoder_start_token_id", pad, at_least=0)
    if start != pad:
        _refuse(folder / "config.json", f"decoder_start_token_id = {start}",
                f"qkv's T5 import starts the decoder from the pad token ({pad}), as T5 does")
    unk = tok.token_to_id(names.get("unk", "<unk>"))
    roles = {PAD: None, BOS: pad, EOS: eos}
    if unk is not None and unk not in (pad, eos):
        roles[UNK] = unk
    t = HFTokenizer.create(data, roles, (), str(path))
    return TokenizerPair(t, t)


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point."""
    from qkv.importers import Imported
    from qkv.importers.folder import Config, FolderError, load_state, read_config, read_weights
    from qkv.importers.marian import decode_config
    from qkv.models import build_model

    where = base / "config.json"
    config = _config(config, where)
    tokenizers = tokenizer(base, config)
    tok = tokenizers.src
    cfg = model_config(config, where, tok.vocab_size)
    known = sum(m is not None for m in tok.ids.model_ids)
    vocab = config.int("vocab_size", 32128)
    if vocab < known:
        raise FolderError(f"{where}: vocab_size {vocab} is smaller than tokenizer.json's {known} tokens")
    sd = state_dict(read_weights(base, config), cfg, config, tok.ids, base, vocab)  # every tensor checked first
    model = build_model(cfg)
    load_state(model, sd, config)
    gen_path = base / "generation_config.json"
    gen = read_config(gen_path) if gen_path.exists() else Config({}, gen_path)
    # as transformers' generate() cuts an output: max_length counts the decoder start (max_length - 1 tokens);
    # where neither file sets it, 20 new tokens (transformers 5's default); greedy unless num_beams says
    decode = decode_config(Config({"num_beams": 1, **config.data}, config.path), gen)
    max_length = (gen if "max_length" in gen else config).int("max_length", None)
    tokens = max_length - 1 if max_length is not None else 20
    decode = dataclasses.replace(decode, max_len_b=max(1, min(tokens, 1024))).validate()
    train = dataclasses.replace(TrainConfig(), vocab_size=cfg.src_vocab_size)
    extra = {"decode": to_dict(decode), "data": {"train": f"imported from {base.name} ({arch})"}}
    return Imported(model, cfg, tokenizers, train, extra, arch)


__all__ = ["convert", "model_config", "state_dict", "tokenizer", "ARCHITECTURES"]
