"""DistilBERT encoders -> qkv's encoder-only model.

    DistilBertModel                       task mlm without its head: embed, search
    DistilBertForMaskedLM                 task mlm with its tied head: fill, embed, search
    DistilBertForSequenceClassification   task classify with its head and labels

DistilBERT is BERT (:mod:`qkv.importers.bert`) without token types (``type_vocab_size = 0``) and with its
own names; its classification head is a pooler with ReLU (``pooler_activation = "relu"``: ``pre_classifier``,
ReLU, dropout, ``classifier``). Its LayerNorms' ε is 1e-12. Sinusoidal positions
(``sinusoid_pos_embds = true``: a fixed table whose layout qkv's sinusoids do not match) are refused.

Weights (``distilbert.`` prefix in the task models)::

    embeddings.{word_embeddings,position_embeddings,LayerNorm}   src_embed, src_pos, embed_norm
    transformer.layer.i.attention.{q_lin,k_lin,v_lin}           encoder_layers.i.self_attn.in_proj ([Q; K; V])
    transformer.layer.i.attention.out_lin, sa_layer_norm         self_attn.out_proj, res_attn.norm
    transformer.layer.i.ffn.{lin1,lin2}, output_layer_norm       ffn.w_1, ffn.w_2, res_ffn.norm
    vocab_transform, vocab_layer_norm, vocab_projector.bias      mlm_head.{dense,norm,bias} (tied decoder)
    pre_classifier, classifier                                   pooler, classifier
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.config import ModelConfig
from qkv.importers.bert import ACTIVATIONS, TOKEN_NAMES, Family, convert_encoder, mlm_head_state, refuse

ARCHITECTURES = ("DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification")
MODEL_TYPES = ("distilbert",)
DEFAULT_ARCHITECTURE = "DistilBertModel"


def model_config(cfg: dict, where: Path, task: str, vocab_size: int) -> ModelConfig:
    if cfg.get("sinusoidal_pos_embds"):
        refuse(where, "sinusoidal_pos_embds = true is not supported (qkv imports DistilBERT's learned positions)")
    act = cfg.get("activation", "gelu")
    if act not in ACTIVATIONS:
        refuse(where, f"activation {act!r} is not supported (qkv has {', '.join(ACTIVATIONS)})")
    d, heads = int(cfg.get("dim", 768)), int(cfg.get("n_heads", 12))
    if d % heads:
        refuse(where, f"dim {d} is not a multiple of n_heads {heads}")
    return ModelConfig(
        task=task, arch="transformer", d_model=d, n_heads=heads, d_ff=int(cfg.get("hidden_dim", 4 * d)),
        n_encoder_layers=int(cfg.get("n_layers", 6)), n_decoder_layers=1, dropout=float(cfg.get("dropout", 0.1)),
        attention_dropout=float(cfg.get("attention_dropout", 0.1)), positional="learned",
        max_positions=int(cfg.get("max_position_embeddings", 512)), norm_first=False, activation=ACTIVATIONS[act],
        mlm_head_activation=ACTIVATIONS[act], layer_norm_eps=1e-12, scale_embeddings=False, type_vocab_size=0,
        embedding_norm=True, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True,
        tie_output=True)


def state(w: dict[str, torch.Tensor], cfg: ModelConfig, ids, where: Path) -> dict[str, torch.Tensor]:
    def get(name):
        if name not in w:
            refuse(where.parent, f"the weights have no {name!r} (not a DistilBERT checkpoint of this configuration?)")
        return w[name].float()

    def pair(dst, src):
        s[dst + ".weight"], s[dst + ".bias"] = get(src + ".weight"), get(src + ".bias")

    s: dict[str, torch.Tensor] = {}
    word = get("embeddings.word_embeddings.weight")
    if word.shape[0] != sum(m is not None for m in ids.model_ids):
        refuse(where.parent, f"the word embeddings have {word.shape[0]} rows, not the tokenizer's tokens")
    s["src_embed.weight"] = ids.rows(word)
    s["src_pos.weight"] = get("embeddings.position_embeddings.weight")
    pair("embed_norm", "embeddings.LayerNorm")
    for i in range(cfg.n_encoder_layers):
        h, q = f"transformer.layer.{i}.", f"encoder_layers.{i}."
        for part in ("weight", "bias"):
            s[q + "self_attn.in_proj." + part] = torch.cat([get(f"{h}attention.{n}.{part}")
                                                           for n in ("q_lin", "k_lin", "v_lin")])
        for src, dst in (("attention.out_lin", "self_attn.out_proj"), ("sa_layer_norm", "res_attn.norm"),
                         ("ffn.lin1", "ffn.w_1"), ("ffn.lin2", "ffn.w_2"), ("output_layer_norm", "res_ffn.norm")):
            pair(q + dst, h + src)
    if cfg.task == "classify":
        pair("pooler", "pre_classifier")
        pair("classifier", "classifier")
    elif cfg.mlm_head:
        s.update(mlm_head_state(w, get, word, ids, where, "vocab_transform", "vocab_layer_norm",
                                "vocab_projector.bias", "vocab_projector"))
    return s


FAMILY = Family("DistilBERT", "distilbert.", {"DistilBertForSequenceClassification": "classify"},
                ("DistilBertForMaskedLM",), TOKEN_NAMES, model_config, state, "vocab_projector.bias",
                {"pooler_activation": "relu"})


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)
