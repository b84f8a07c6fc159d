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
from qkv.importers.bert import (ACTIVATIONS, TOKEN_NAMES, Family, classifier_state, convert_encoder, mlm_head_state,
                                refuse, word_embeddings)

ARCHITECTURES = ("DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification")
MODEL_TYPES = ("distilbert",)
DEFAULT_ARCHITECTURE = "DistilBertModel"


def model_config(c, where: Path, task: str, vocab_size: int) -> ModelConfig:
    """DistilBERT's config.json ``c`` (a :class:`~qkv.importers.folder.Config`) as qkv's encoder."""
    if c.bool("sinusoidal_pos_embds", False):
        refuse(where, "sinusoidal_pos_embds = true is not supported (qkv imports DistilBERT's learned positions)")
    act = c.str("activation", "gelu")
    if act not in ACTIVATIONS:
        refuse(where, f"activation {act!r} is not supported (qkv has {', '.join(ACTIVATIONS)})")
    d, heads = c.int("dim", 768), c.int("n_heads", 12)
    if d % heads:
        c.error(f"dim {d} is not a multiple of n_heads {heads}")
    return ModelConfig(
        task=task, arch="transformer", d_model=d, n_heads=heads, d_ff=c.int("hidden_dim", 4 * d),
        n_encoder_layers=c.int("n_layers", 6), n_decoder_layers=1,
        dropout=c.float("dropout", 0.1, at_least=0, below=1),
        attention_dropout=c.float("attention_dropout", 0.1, at_least=0, below=1), positional="learned",
        max_positions=c.int("max_position_embeddings", 512, at_least=2), norm_first=False, activation=ACTIVATIONS[act],
        mlm_head_activation=ACTIVATIONS[act], layer_norm_eps=1e-12, scale_embeddings=False, type_vocab_size=0,
        embedding_norm=True, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True,
        tie_output=True)


def state(w, cfg: ModelConfig, ids, c) -> dict[str, torch.Tensor]:
    """qkv's state dict of DistilBERT's weights ``w`` (:class:`~qkv.importers.folder.Weights`), each tensor
    taken with the shape config.json ``c`` gives it."""
    d, ff, n = cfg.d_model, cfg.d_ff, cfg.n_encoder_layers
    D, FF = ("dim",), ("dim", "hidden_dim")
    w.check_layers(r"transformer\.layer\.(\d+)\.", n, "n_layers")

    def pair(dst, src, shape, fields=D):
        s[dst + ".weight"], s[dst + ".bias"] = w.take(src + ".weight", shape, fields), \
            w.take(src + ".bias", shape[:1], fields)

    s: dict[str, torch.Tensor] = {}
    word = word_embeddings(w, "embeddings.word_embeddings.weight", ids, c, d, "dim")
    s["src_embed.weight"] = ids.rows(word)
    s["src_pos.weight"] = w.take("embeddings.position_embeddings.weight", (cfg.max_positions, d),
                                 ("max_position_embeddings", "dim"))
    pair("embed_norm", "embeddings.LayerNorm", (d,))
    for i in range(n):
        h, q = f"transformer.layer.{i}.", f"encoder_layers.{i}."
        s[q + "self_attn.in_proj.weight"] = torch.cat([w.take(f"{h}attention.{m}.weight", (d, d), D)
                                                      for m in ("q_lin", "k_lin", "v_lin")])
        s[q + "self_attn.in_proj.bias"] = torch.cat([w.take(f"{h}attention.{m}.bias", (d,), D)
                                                    for m in ("q_lin", "k_lin", "v_lin")])
        for src, dst, shape in (("attention.out_lin", "self_attn.out_proj", (d, d)), ("sa_layer_norm", "res_attn.norm", (d,)),
                                ("ffn.lin1", "ffn.w_1", (ff, d)), ("ffn.lin2", "ffn.w_2", (d, ff)),
                                ("output_layer_norm", "res_ffn.norm", (d,))):
            pair(q + dst, h + src, shape, FF)
    if cfg.task == "classify":
        s.update(classifier_state(w, cfg, c, "pre_classifier", "classifier"))
    elif cfg.mlm_head:
        s.update(mlm_head_state(w, word, ids, c, d, "vocab_transform", "vocab_layer_norm", "vocab_projector.bias",
                                "vocab_projector"))
    return s


FAMILY = Family("DistilBERT", "distilbert.", {"DistilBertForSequenceClassification": "classify"},
                ("DistilBertForMaskedLM",), TOKEN_NAMES, model_config, state, "vocab_projector.bias",
                {"pooler_activation": "relu"})


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, FAMILY)
