"""Hugging Face ``BartForConditionalGeneration`` folder -> a qkv translation (sequence-to-sequence) checkpoint.

BART is the paper's encoder-decoder with these switches (:class:`~qkv.config.ModelConfig`), the layers
named as Marian's (:func:`qkv.importers.marian.layers_state`):

    BartConfig / the folder                 qkv ModelConfig
    post-norm layers, no final LayerNorm    norm_first = false, final_norm = "auto" (none)
    learned positions from row 2            positional = "learned", position_offset = 2,
                                            max_positions = max_position_embeddings
    layernorm_embedding                     embedding_norm = true (one per stack)
    scale_embedding (false in BART)         scale_embeddings
    activation_function gelu | relu | ..    activation
    shared, tied lm_head                    share_embeddings = true, tie_output
    final_logits_bias                       output_bias = true
    tokenizer.json (byte-level BPE)         :class:`qkv.data.pretrained.HFTokenizer`, ``<s>`` put before
                                            every text (its prefix), ``</s>`` qkv's EOS

The decoder starts from ``decoder_start_token_id`` (``</s>`` in BART): qkv's BOS is a row of its own
holding that token's embedding, so that qkv's EOS and BOS stay two ids; a target reads ``<s> text </s>``
as BART's labels do. Rows qkv adds (BOS, CLS, SEP) get an output bias of -1e4: no probability.

mBART (MBartForConditionalGeneration) is refused by name: its layers are BART's with pre-norm and final
LayerNorms (switches qkv has), but its tokenizer ends a source with a language code and its decoder
starts from the target language's, which qkv's tokenizers do not express.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from qkv.config import BOS, EOS, PAD, ModelConfig, TrainConfig, to_dict
from qkv.importers.folder import ADDED_ROW_LOGIT  # the logit of a row qkv adds, one value for every family
from qkv.importers.marian import ACTIVATIONS, decode_config, layers_state, taker

ARCHITECTURE = "BartForConditionalGeneration"
ARCHITECTURES = (ARCHITECTURE, "MBartForConditionalGeneration")
MODEL_TYPES = ("bart", "mbart")
DEFAULT_ARCHITECTURE = ARCHITECTURE


def refuse(where: Path, what: str):
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {what}")


def model_config(c, where: Path, vocab_size: int) -> ModelConfig:
    """BART's config.json ``c`` (a :class:`~qkv.importers.folder.Config`) as qkv's encoder-decoder."""
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c.int(enc, 16) != c.int(dec, 16):
            refuse(where, f"{enc} = {c.int(enc, 16)} with {dec} = {c.int(dec, 16)} is not supported (qkv's "
                          "encoder and decoder have one width of heads and FFN)")
    act = c.str("activation_function", "gelu")
    if act not in ACTIVATIONS:
        refuse(where, f"activation_function {act!r} is not supported (qkv computes {', '.join(sorted(ACTIVATIONS))})")
    for key in ("normalize_before", "add_final_layer_norm"):
        if c.bool(key, False):
            refuse(where, f"{key} = true is not supported in a BART folder (BART's layers are post-norm)")
    if c.bool("normalize_embedding", True) is False:
        refuse(where, "normalize_embedding = false is not supported (BART normalises its embeddings)")
    d, heads = c.int("d_model", 1024), c.int("encoder_attention_heads", 16)
    if d % heads:
        c.error(f"d_model {d} is not a multiple of encoder_attention_heads {heads}")
    return ModelConfig(
        task="translate", arch="transformer", d_model=d, n_heads=heads, d_ff=c.int("encoder_ffn_dim", 4096),
        n_encoder_layers=c.int("encoder_layers", 12), n_decoder_layers=c.int("decoder_layers", 12),
        dropout=c.float("dropout", 0.1, at_least=0, below=1),
        attention_dropout=c.float("attention_dropout", 0.0, at_least=0, below=1),
        positional="learned", position_offset=2, max_positions=c.int("max_position_embeddings", 1024, at_least=2),
        norm_first=False, final_norm="auto", activation=ACTIVATIONS[act], embedding_norm=True,
        scale_embeddings=c.bool("scale_embedding", False), share_embeddings=True,
        tie_output=c.bool("tie_word_embeddings", True), output_bias=True,
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
    ).validate()


def tokenizer(folder: Path, hf: dict):
    """The folder's tokenizer.json with qkv's roles: <pad>, <unk>, </s> (EOS), <mask>; BOS a row of its own;
    ``<s>`` put before every text (the post-processor's <s> X </s>, </s> being qkv's EOS)."""
    from qkv.data.pretrained import HFTokenizer, roles, single_template, special_token_names
    from qkv.data.tokenizer import TokenizerPair
    from qkv.importers.folder import Config, read_tokenizer_json

    c = hf if isinstance(hf, Config) else Config(hf, folder / "config.json")
    path = folder / "tokenizer.json"
    if not path.is_file():
        refuse(folder, "has no tokenizer.json (qkv reads BART's tokenizer from the tokenizers library's file; a folder "
                       "with vocab.json and merges.txt only can be converted by loading it with transformers' "
                       "BartTokenizerFast and save_pretrained)")
    raw = read_tokenizer_json(path)
    names = {"pad": "<pad>", "unk": "<unk>", "eos": "</s>", "mask": "<mask>", **special_token_names(folder)}
    names = {k: v for k, v in names.items() if k in ("pad", "unk", "eos", "mask")}
    r = roles(raw, names, str(path))
    if r[EOS] is None or r[PAD] is None:
        refuse(path, "names no eos or pad token")
    before, after = single_template(raw, str(path))
    if after != [r[EOS]]:
        refuse(path, f"a text ends with ids {after}, not with its eos token {r[EOS]} alone")
    start = c.int("decoder_start_token_id", r[EOS], at_least=0)
    if start not in (r[EOS], *before):
        refuse(folder / "config.json", f"decoder_start_token_id {start} is neither the eos token nor the one a text "
                                       "starts with (qkv's BOS copies it)")
    tok = HFTokenizer.create(raw, {**r, BOS: None}, (), str(path), prefix=before)
    return TokenizerPair(tok, tok), int(start)


def state_dict(weights, cfg: ModelConfig, ids, start: int, where: Path) -> dict:
    """BART's weights (:class:`~qkv.importers.folder.Weights`) under qkv's names, each tensor taken with the
    shape config.json gives it."""
    w = taker(weights)
    d = cfg.d_model
    for side, n, field in (("encoder", cfg.n_encoder_layers, "encoder_layers"),
                           ("decoder", cfg.n_decoder_layers, "decoder_layers")):
        weights.check_layers(("model\\." if w.prefixed else "") + side + r"\.layers\.(\d+)\.", n, field)
    out = layers_state(w, cfg)
    tokens = sum(m is not None for m in ids.model_ids)
    V = ("vocab_size", "d_model")
    c = weights.config
    vocab = c.int("vocab_size", None) if c is not None else None
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight"):
        name = name if w.prefixed else name.removeprefix("model.")
        if vocab is not None:
            weights.check_rows(name, vocab, c.says("vocab_size"))
        weights.check_rows(name, tokens,
                           f"tokenizer.json has {tokens} tokens (qkv imports a model whose vocabulary is its tokenizer's)")
    shared = next((t for n in ("model.shared.weight", "model.encoder.embed_tokens.weight")
                   if (t := w(n, (tokens, d), V, default=None)) is not None), None)
    if shared is None:
        refuse(where, "the weights have no shared embedding (model.shared.weight)")
    if start >= tokens:
        refuse(where / "config.json", f"decoder_start_token_id {start} is not a token of the {tokens} embedded")
    embed = ids.rows(shared)
    embed[BOS] = shared[start]  # the decoder's start token, at qkv's BOS
    out["src_embed.weight"] = out["tgt_embed.weight"] = embed
    rows = cfg.max_positions + cfg.position_offset
    for side, stack in (("src", "encoder"), ("tgt", "decoder")):
        out[f"{side}_pos.weight"] = w(f"model.{stack}.embed_positions.weight", (rows, d),
                                      ("max_position_embeddings", "d_model"))
        out[f"{side}_embed_norm.weight"] = w(f"model.{stack}.layernorm_embedding.weight", (d,))
        out[f"{side}_embed_norm.bias"] = w(f"model.{stack}.layernorm_embedding.bias", (d,))
    bias = weights.take("final_logits_bias", (1, tokens), ("vocab_size",), default=None)
    bias = bias.reshape(-1) if bias is not None else torch.zeros(tokens)
    out["output_bias"] = ids.rows(bias, fill=ADDED_ROW_LOGIT)
    if not cfg.tie_output:
        out["output_proj.weight"] = ids.rows(weights.take("lm_head.weight", (tokens, d), V))
    return out


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point: the folder as an :class:`~qkv.importers.Imported`."""
    from qkv.importers import Imported
    from qkv.importers.folder import Config, load_state, read_config, read_weights
    from qkv.models import build_model

    where = base / "config.json"
    config = config if isinstance(config, Config) else Config(config, where)
    if arch != ARCHITECTURE:
        refuse(where, f"{arch} is not supported: mBART's layers are BART's with pre-norm and final LayerNorms (switches "
                      "qkv has), but its tokenizer ends a source with a language code and starts the decoder from the "
                      "target language's, which qkv's tokenizers do not express")
    tokenizers, start = tokenizer(base, config)
    ids = tokenizers.src.ids
    cfg = model_config(config, where, ids.size)
    gen_path = base / "generation_config.json"
    gen = read_config(gen_path) if gen_path.exists() else Config({}, gen_path)
    decode = decode_config(config, gen)
    sd = state_dict(read_weights(base, config), cfg, ids, start, base)  # every tensor checked before a model is built
    model = build_model(cfg)
    load_state(model, sd, config)
    model.eval()
    train = dataclasses.replace(TrainConfig(), vocab_size=cfg.src_vocab_size, max_len=cfg.max_positions - 1,
                                tokenizer_from="")
    extra = {"decode": to_dict(decode), "data": {"train": f"imported from {Path(folder).name} ({ARCHITECTURE})"}}
    return Imported(model, cfg, tokenizers, train, extra, ARCHITECTURE)


__all__ = ["convert", "model_config", "state_dict", "tokenizer"]

