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
from qkv.errors import QkvError
from qkv.importers.marian import ACTIVATIONS, decode_config, layers_state

ARCHITECTURE = "BartForConditionalGeneration"
ARCHITECTURES = (ARCHITECTURE, "MBartForConditionalGeneration")
MODEL_TYPES = ("bart", "mbart")
DEFAULT_ARCHITECTURE = ARCHITECTURE
ADDED_ROW_LOGIT = -1e4


def refuse(where: Path, what: str):
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {what}")


def model_config(hf: dict, where: Path, vocab_size: int) -> ModelConfig:
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(enc, 16) != hf.get(dec, 16):
            refuse(where, f"{enc} = {hf.get(enc, 16)} with {dec} = {hf.get(dec, 16)} is not supported (qkv's "
                          "encoder and decoder have one width of heads and FFN)")
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        refuse(where, f"activation_function {act!r} is not supported (qkv computes {', '.join(sorted(ACTIVATIONS))})")
    for key in ("normalize_before", "add_final_layer_norm"):
        if hf.get(key):
            refuse(where, f"{key} = true is not supported in a BART folder (BART's layers are post-norm)")
    if hf.get("normalize_embedding") is False:
        refuse(where, "normalize_embedding = false is not supported (BART normalises its embeddings)")
    d, heads = int(hf.get("d_model", 1024)), int(hf.get("encoder_attention_heads", 16))
    if d % heads:
        refuse(where, f"d_model {d} is not a multiple of encoder_attention_heads {heads}")
    return ModelConfig(
        task="translate", arch="transformer", d_model=d, n_heads=heads, d_ff=int(hf.get("encoder_ffn_dim", 4096)),
        n_encoder_layers=int(hf.get("encoder_layers", 12)), n_decoder_layers=int(hf.get("decoder_layers", 12)),
        dropout=float(hf.get("dropout", 0.1)), attention_dropout=float(hf.get("attention_dropout", 0.0)),
        positional="learned", position_offset=2, max_positions=int(hf.get("max_position_embeddings", 1024)),
        norm_first=False, final_norm="auto", activation=ACTIVATIONS[act], embedding_norm=True,
        scale_embeddings=bool(hf.get("scale_embedding", False)), share_embeddings=True,
        tie_output=bool(hf.get("tie_word_embeddings", True)), output_bias=True,
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
    ).validate()


def tokenizer(folder: Path, hf: dict):
    """The folder's tokenizer.json with qkv's roles: <pad>, <unk>, </s> (EOS), <mask>; BOS a row of its own;
    ``<s>`` put before every text (the post-processor's <s> X </s>, </s> being qkv's EOS)."""
    from qkv.data.pretrained import HFTokenizer, roles, single_template, special_token_names
    from qkv.data.tokenizer import TokenizerPair

    path = folder / "tokenizer.json"
    if not path.is_file():
        refuse(folder, "has no tokenizer.json (qkv reads BART's tokenizer from the tokenizers library's file; a folder "
                       "with vocab.json and merges.txt only can be converted by loading it with transformers' "
                       "BartTokenizerFast and save_pretrained)")
    raw = path.read_bytes()
    names = {"pad": "<pad>", "unk": "<unk>", "eos": "</s>", "mask": "<mask>", **special_token_names(folder)}
    names = {k: v for k, v in names.items() if k in ("pad", "unk", "eos", "mask")}
    r = roles(raw, names, str(path))
    if r[EOS] is None or r[PAD] is None:
        refuse(path, "names no eos or pad token")
    before, after = single_template(raw, str(path))
    if after != [r[EOS]]:
        refuse(path, f"a text ends with ids {after}, not with its eos token {r[EOS]} alone")
    start = hf.get("decoder_start_token_id", r[EOS])
    if start not in (r[EOS], *before):
        refuse(folder / "config.json", f"decoder_start_token_id {start} is neither the eos token nor the one a text "
                                       "starts with (qkv's BOS copies it)")
    tok = HFTokenizer.create(raw, {**r, BOS: None}, (), str(path), prefix=before)
    return TokenizerPair(tok, tok), int(start)


def state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig, ids, start: int, where: Path) -> dict:
    def w(name: str) -> torch.Tensor:
        for candidate in (name, name.removeprefix("model.")):
            if candidate in weights:
                return weights[candidate].float()
        refuse(where, f"the weights have no {name!r} (not a BartForConditionalGeneration state dict?)")

    out = layers_state(w, cfg)
    shared = next((w(n) for n in ("model.shared.weight", "model.encoder.embed_tokens.weight")
                   if n in weights or n.removeprefix("model.") in weights), None)
    if shared is None:
        refuse(where, "the weights have no shared embedding (model.shared.weight)")
    tokens = sum(m is not None for m in ids.model_ids)
    if shared.size(0) != tokens:
        refuse(where, f"the embedding has {shared.size(0)} rows but tokenizer.json has {tokens} tokens: qkv imports a "
                      "model whose vocabulary is its tokenizer's")
    embed = ids.rows(shared)
    embed[BOS] = shared[start]  # the decoder's start token, at qkv's BOS
    out["src_embed.weight"] = out["tgt_embed.weight"] = embed
    for side, stack in (("src", "encoder"), ("tgt", "decoder")):
        out[f"{side}_pos.weight"] = w(f"model.{stack}.embed_positions.weight")
        out[f"{side}_embed_norm.weight"] = w(f"model.{stack}.layernorm_embedding.weight")
        out[f"{side}_embed_norm.bias"] = w(f"model.{stack}.layernorm_embedding.bias")
    if out["src_pos.weight"].size(0) != cfg.max_positions + cfg.position_offset:
        refuse(where, f"embed_positions has {out['src_pos.weight'].size(0)} rows, not max_position_embeddings + 2")
    bias = weights.get("final_logits_bias")
    bias = bias.float().reshape(-1) if bias is not None else torch.zeros(tokens)
    out["output_bias"] = ids.rows(bias, fill=ADDED_ROW_LOGIT)
    if not cfg.tie_output:
        out["output_proj.weight"] = ids.rows(w("lm_head.weight"))
    return out


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point: the folder as an :class:`~qkv.importers.Imported`."""
    from qkv.importers import Imported, read_json, read_weights
    from qkv.models import build_model

    where = base / "config.json"
    if arch != ARCHITECTURE:
        refuse(where, f"{arch} is not supported: mBART's layers are BART's with pre-norm and final LayerNorms (switches "
                      "qkv has), but its tokenizer ends a source with a language code and starts the decoder from the "
                      "target language's, which qkv's tokenizers do not express")
    tokenizers, start = tokenizer(base, config)
    ids = tokenizers.src.ids
    cfg = model_config(config, where, ids.size)
    gen = read_json(base / "generation_config.json") if (base / "generation_config.json").is_file() else {}
    decode = decode_config(config, gen)
    model = build_model(cfg)
    sd = state_dict(read_weights(base), cfg, ids, start, base)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise QkvError(f"internal: BART weights do not fit qkv's Transformer (missing {missing}, unexpected "
                       f"{unexpected})")
    model.eval()
    train = dataclasses.replace(TrainConfig(), vocab_size=cfg.src_vocab_size, max_len=cfg.max_positions - 1,
                                tokenizer_from="")
    extra = {"decode": to_dict(decode), "data": {"train": f"imported from {Path(folder).name} ({ARCHITECTURE})"}}
    return Imported(model, cfg, tokenizers, train, extra, ARCHITECTURE)


__all__ = ["convert", "model_config", "state_dict", "tokenizer"]

