"""ALBERT encoders -> qkv's encoder-only model.

    AlbertModel                       task mlm without its head: embed, search
    AlbertForMaskedLM                 task mlm with its tied head: fill, embed, search
    AlbertForSequenceClassification   task classify with its pooler and labels

ALBERT is BERT (:mod:`qkv.importers.bert`) with its two switches (:class:`~qkv.config.ModelConfig`):

    embedding_size E < hidden_size    embedding_dim = E: the token, position and token-type embeddings and
                                      their LayerNorm are E wide, projected to d_model before the first layer
                                      (``encoder.embedding_hidden_mapping_in``); the masked-LM head maps
                                      d_model back to E before the tied decoder
    num_hidden_groups G               layer_groups = G: the N layers run from G sets of weights
                                      (layer i: set floor(i·G/N)), qkv.nn.stack.SharedLayers

``hidden_act`` is GELU's tanh approximation (``gelu_new``) in the FFN and the masked-LM head alike. A
group of more than one layer (``inner_group_num`` > 1) is refused by name.

Weights (``albert.`` prefix in the task models; layer set g = ``encoder.albert_layer_groups.g.albert_layers.0``)::

    embeddings.{word,position,token_type}_embeddings, .LayerNorm   src_embed, src_pos, src_types, embed_norm
    encoder.embedding_hidden_mapping_in                            embed_proj
    g.attention.{query,key,value}, .dense, .LayerNorm              encoder_layers.g.self_attn, res_attn.norm
    g.ffn, g.ffn_output, g.full_layer_layer_norm                   encoder_layers.g.ffn.w_1, .w_2, res_ffn.norm
    pooler, classifier                                             pooler, classifier
    predictions.{dense,LayerNorm,bias} (decoder tied)              mlm_head.{dense,norm,bias}
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from qkv.config import ModelConfig
from qkv.importers.bert import Family, convert_encoder, mlm_head_state, model_config as bert_config, refuse

ARCHITECTURES = ("AlbertModel", "AlbertForMaskedLM", "AlbertForSequenceClassification")
MODEL_TYPES = ("albert",)
DEFAULT_ARCHITECTURE = "AlbertModel"
TOKEN_NAMES = {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def model_config(cfg: dict, where: Path, task: str, vocab_size: int) -> ModelConfig:
    if int(cfg.get("inner_group_num", 1)) != 1:
        refuse(where, f"inner_group_num {cfg['inner_group_num']} is not supported (qkv's layer groups are one layer "
                      "each, as every released ALBERT)")
    mcfg = bert_config({"hidden_act": "gelu_new", "layer_norm_eps": 1e-12, **cfg}, where, task, vocab_size)
    width = int(cfg.get("embedding_size", 128))
    groups = int(cfg.get("num_hidden_groups", 1))
    if not 1 <= groups <= mcfg.n_encoder_layers:
        refuse(where, f"num_hidden_groups {groups} is not between 1 and num_hidden_layers {mcfg.n_encoder_layers}")
    return replace(mcfg, embedding_dim=width if width != mcfg.d_model else 0, layer_groups=groups)


def state(w: dict[str, torch.Tensor], cfg: ModelConfig, ids, where: Path) -> dict[str, torch.Tensor]:
    def get(name):
        if name not in w:
            refuse(where.parent, f"the weights have no {name!r} (not an ALBERT checkpoint of this configuration?)")
        return w[name].float()

    def pair(dst, src):
        s[dst + ".weight"], s[dst + ".bias"] = get(src + ".weight"), get(src + ".bias")

    s: dict[str, torch.Tensor] = {}
    e = "embeddings."
    word = get(e + "word_embeddings.weight")
    if word.shape[0] != sum(m is not None for m in ids.model_ids):
        refuse(where.parent, f"the word embeddings have {word.shape[0]} rows, not the tokenizer's tokens")
    s["src_embed.weight"] = ids.rows(word)
    s["src_pos.weight"] = get(e + "position_embeddings.weight")
    s["src_types.weight"] = get(e + "token_type_embeddings.weight")
    pair("embed_norm", e + "LayerNorm")
    if cfg.embedding_dim:
        pair("embed_proj", "encoder.embedding_hidden_mapping_in")
    for g in range(cfg.layer_groups):
        h, q = f"encoder.albert_layer_groups.{g}.albert_layers.0.", f"encoder_layers.{g}."
        for part in ("weight", "bias"):
            s[q + "self_attn.in_proj." + part] = torch.cat([get(f"{h}attention.{n}.{part}")
                                                           for n in ("query", "key", "value")])
        for src, dst in (("attention.dense", "self_attn.out_proj"), ("attention.LayerNorm", "res_attn.norm"),
                         ("ffn", "ffn.w_1"), ("ffn_output", "ffn.w_2"), ("full_layer_layer_norm", "res_ffn.norm")):
            pair(q + dst, h + src)
    if cfg.task == "classify":
        pair("pooler", "pooler")
        pair("classifier", "classifier")
    elif cfg.mlm_head:
        s.update(mlm_head_state(w, get, word, ids, where, "predictions.dense", "predictions.LayerNorm",
                                "predictions.bias", "predictions.decoder"))
    return s


FAMILY = Family("ALBERT", "albert.", {"AlbertForSequenceClassification": "classify"}, ("AlbertForMaskedLM",),
                TOKEN_NAMES, model_config, state, "predictions.bias")


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)
