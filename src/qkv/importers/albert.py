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
from qkv.importers.bert import (Family, classifier_state, convert_encoder, mlm_head_state, model_config as bert_config,
                                refuse, word_embeddings)

ARCHITECTURES = ("AlbertModel", "AlbertForMaskedLM", "AlbertForSequenceClassification")
MODEL_TYPES = ("albert",)
DEFAULT_ARCHITECTURE = "AlbertModel"
TOKEN_NAMES = {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def model_config(c, where: Path, task: str, vocab_size: int) -> ModelConfig:
    """ALBERT's config.json ``c`` (a :class:`~qkv.importers.folder.Config`) as qkv's encoder."""
    inner = c.int("inner_group_num", 1)
    if inner != 1:
        refuse(where, f"inner_group_num {inner} is not supported (qkv's layer groups are one layer "
                      "each, as every released ALBERT)")
    mcfg = bert_config({"hidden_act": "gelu_new", "layer_norm_eps": 1e-12, **c.data}, where, task, vocab_size)
    width = c.int("embedding_size", 128, at_most=1 << 16)
    groups = c.int("num_hidden_groups", 1)
    if not 1 <= groups <= mcfg.n_encoder_layers:
        refuse(where, f"num_hidden_groups {groups} is not between 1 and num_hidden_layers {mcfg.n_encoder_layers}")
    return replace(mcfg, embedding_dim=width if width != mcfg.d_model else 0, layer_groups=groups)


def state(w, cfg: ModelConfig, ids, c) -> dict[str, torch.Tensor]:
    """qkv's state dict of ALBERT's weights ``w`` (:class:`~qkv.importers.folder.Weights`), each tensor
    taken with the shape config.json ``c`` gives it."""
    d, ff, e_dim = cfg.d_model, cfg.d_ff, cfg.embedding_dim or cfg.d_model
    D, FF, E = ("hidden_size",), ("hidden_size", "intermediate_size"), ("embedding_size",)
    w.check_layers(r"encoder\.albert_layer_groups\.(\d+)\.", cfg.layer_groups, "num_hidden_groups")

    def pair(dst, src, shape, fields=D):
        s[dst + ".weight"], s[dst + ".bias"] = w.take(src + ".weight", shape, fields), \
            w.take(src + ".bias", shape[:1], fields)

    s: dict[str, torch.Tensor] = {}
    e = "embeddings."
    word = word_embeddings(w, e + "word_embeddings.weight", ids, c, e_dim, "embedding_size")
    s["src_embed.weight"] = ids.rows(word)
    s["src_pos.weight"] = w.take(e + "position_embeddings.weight", (cfg.max_positions, e_dim),
                                 ("max_position_embeddings", *E))
    s["src_types.weight"] = w.take(e + "token_type_embeddings.weight", (cfg.type_vocab_size, e_dim),
                                   ("type_vocab_size", *E))
    pair("embed_norm", e + "LayerNorm", (e_dim,), E)
    if cfg.embedding_dim:
        pair("embed_proj", "encoder.embedding_hidden_mapping_in", (d, e_dim), ("hidden_size", "embedding_size"))
    for g in range(cfg.layer_groups):
        h, q = f"encoder.albert_layer_groups.{g}.albert_layers.0.", f"encoder_layers.{g}."
        s[q + "self_attn.in_proj.weight"] = torch.cat([w.take(f"{h}attention.{m}.weight", (d, d), D)
                                                      for m in ("query", "key", "value")])
        s[q + "self_attn.in_proj.bias"] = torch.cat([w.take(f"{h}attention.{m}.bias", (d,), D)
                                                    for m in ("query", "key", "value")])
        for src, dst, shape in (("attention.dense", "self_attn.out_proj", (d, d)), ("attention.LayerNorm", "res_attn.norm", (d,)),
                                ("ffn", "ffn.w_1", (ff, d)), ("ffn_output", "ffn.w_2", (d, ff)),
                                ("full_layer_layer_norm", "res_ffn.norm", (d,))):
            pair(q + dst, h + src, shape, FF)
    if cfg.task == "classify":
        s.update(classifier_state(w, cfg, c, "pooler", "classifier"))
    elif cfg.mlm_head:
        s.update(mlm_head_state(w, word, ids, c, d, "predictions.dense", "predictions.LayerNorm", "predictions.bias",
                                "predictions.decoder"))
    return s


FAMILY = Family("ALBERT", "albert.", {"AlbertForSequenceClassification": "classify"}, ("AlbertForMaskedLM",),
                TOKEN_NAMES, model_config, state, "predictions.bias")


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)
