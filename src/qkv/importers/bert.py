"""BERT-family encoders -> qkv's encoder-only model (:class:`~qkv.models.encoder_only.EncoderOnly`).

    BertModel                       task mlm without its head (``mlm_head = false``): embed, search
    BertForMaskedLM                 task mlm with BERT's tied head: fill, embed, search
    BertForSequenceClassification   task classify with BERT's pooler (``pooler = true``) and its labels
    BertForPreTraining              task mlm with its masked-LM head (the next-sentence head is left out)
    sentence-transformers folder    a BertModel + its Pooling (mean or cls) + Normalize: embed, search

BERT is qkv's encoder with these options (:class:`~qkv.config.ModelConfig`): post-norm layers,
learned positions (``max_position_embeddings``), no √d_model embedding scale, token-type embeddings
(row 0: qkv's inputs are one text), a LayerNorm on the embedding sum, ``layer_norm_eps`` (1e-12) and
GELU in the FFN. A text reads ``[CLS] tokens [SEP]``: ``[CLS]`` is qkv's CLS and the tokenizer puts the
``[SEP]`` after the tokens (:mod:`qkv.data.pretrained`).

Weights (``bert.`` prefix in the task models)::

    embeddings.word_embeddings          src_embed (rows in qkv's order, qkv.data.pretrained.IdMap)
    embeddings.position_embeddings      src_pos
    embeddings.token_type_embeddings    src_types
    embeddings.LayerNorm                embed_norm
    encoder.layer.i.attention.self.{query,key,value}   encoder_layers.i.self_attn.in_proj ([Q; K; V])
    encoder.layer.i.attention.output.dense             encoder_layers.i.self_attn.out_proj
    encoder.layer.i.attention.output.LayerNorm         encoder_layers.i.res_attn.norm
    encoder.layer.i.intermediate.dense                 encoder_layers.i.ffn.w_1
    encoder.layer.i.output.dense                       encoder_layers.i.ffn.w_2
    encoder.layer.i.output.LayerNorm                   encoder_layers.i.res_ffn.norm
    pooler.dense, classifier                           pooler, classifier
    cls.predictions.transform.{dense,LayerNorm}, .bias mlm_head.{dense,norm,bias} (the decoder is tied; its
                                                       function hidden_act: mlm_head_activation)

The other BERT-like families (:mod:`qkv.importers.roberta`, ``distilbert``, ``albert``, ``electra``) are
each a :class:`Family`: their names and options, converted by :func:`convert_encoder`.

Refused by name: relative position embeddings, a decoder or cross-attention configuration, a
masked-LM head that is not tied to the embeddings, pooling other
than mean or cls, a sentence-transformers Dense module, a multi-label or regression classifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from qkv.config import CLS, ModelConfig, TrainConfig
from qkv.importers.folder import ADDED_ROW_LOGIT  # the logit of a row qkv adds, one value for every family

ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForPreTraining")
MODEL_TYPES = ("bert",)
DEFAULT_ARCHITECTURE = "BertModel"
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def refuse(where: Path, what: str):
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {what}")


def model_config(cfg, where: Path, task: str, vocab_size: int) -> ModelConfig:
    """The qkv encoder of BERT's config.json ``cfg`` (a dict or a :class:`~qkv.importers.folder.Config`);
    a malformed field is refused naming it, and what qkv's encoder cannot be is refused by name."""
    from qkv.importers.folder import Config

    c = cfg if isinstance(cfg, Config) else Config(cfg, where)
    kind = c.str("position_embedding_type", "absolute")
    if kind != "absolute":
        refuse(where, f"position_embedding_type {kind!r} is not supported (qkv's BERT has absolute learned positions)")
    for key in ("is_decoder", "add_cross_attention"):
        if c.bool(key, False):
            refuse(where, f"{key} = true is not supported (qkv imports BERT as an encoder)")
    act = c.str("hidden_act")
    if act not in ACTIVATIONS:
        refuse(where, f"hidden_act {act!r} is not supported (qkv has {', '.join(ACTIVATIONS)})")
    d, heads = c.int("hidden_size"), c.int("num_attention_heads")
    if d % heads:
        c.error(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
    if c.get("attention_head_size") not in (None, d // heads):
        refuse(where, f"attention_head_size {c.get('attention_head_size')} is not hidden_size / num_attention_heads")
    return ModelConfig(
        task=task, arch="transformer", d_model=d, n_heads=heads, d_ff=c.int("intermediate_size"),
        n_encoder_layers=c.int("num_hidden_layers"), n_decoder_layers=1,
        dropout=c.float("hidden_dropout_prob", 0.1, at_least=0, below=1),
        attention_dropout=c.float("attention_probs_dropout_prob", 0.1, at_least=0, below=1),
        positional="learned", max_positions=c.int("max_position_embeddings", at_least=2), norm_first=False,
        activation=ACTIVATIONS[act], mlm_head_activation=ACTIVATIONS[act], layer_norm_eps=c.float("layer_norm_eps", 1e-12, at_least=0, at_most=1),
        scale_embeddings=False, type_vocab_size=c.int("type_vocab_size", 2), embedding_norm=True,
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True, tie_output=True,
    )


TOKEN_NAMES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def _tokenizer(folder: Path, base: Path, defaults: dict | None = None):
    from qkv.data.pretrained import HFTokenizer, roles, single_template, special_token_names
    from qkv.data.tokenizer import TokenizerPair
    from qkv.importers.folder import read_tokenizer_json

    where = next((p for p in (base, folder) if (p / "tokenizer.json").is_file()), None)
    if where is None:
        refuse(base, "has no tokenizer.json (qkv reads a BERT tokenizer from the tokenizer.json of the "
                     "tokenizers library; a folder with vocab.txt only can be converted by loading it with "
                     "transformers' BertTokenizerFast and save_pretrained)")
    raw = read_tokenizer_json(where / "tokenizer.json")
    names = {**(defaults or TOKEN_NAMES), **special_token_names(where)}
    names.pop("bos", None), names.pop("eos", None)  # BERT has none (a tokenizer_config may alias them)
    r = roles(raw, names, str(where / "tokenizer.json"))
    before, after = single_template(raw, str(where / "tokenizer.json"))
    if before != [r[CLS]]:
        refuse(where / "tokenizer.json", f"a text starts with ids {before}, not with its [CLS] token alone")
    tok = HFTokenizer.create(raw, r, after, str(where / "tokenizer.json"))
    return TokenizerPair(tok, tok)


def _weights(base: Path, config, prefix: str = "bert."):
    from qkv.importers.folder import read_weights

    w = read_weights(base, config)
    # older checkpoints name LayerNorm's weight/bias gamma/beta
    w = w.renamed(lambda k: k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"))
    if any(k.startswith(prefix) for k in w):
        w = w.renamed(lambda k: k[len(prefix):] if k.startswith(prefix) else k)
    return w


@dataclass(frozen=True)
class Family:
    """What sets one BERT-like family apart: its names and options. :func:`convert_encoder` does the rest."""

    name: str  # as the messages say it: "BERT", "RoBERTa", ...
    prefix: str  # the encoder's weights' prefix in the task models ("bert.")
    tasks: dict  # architecture -> qkv task (classify | mlm)
    masked_lm: tuple  # the architectures that must have their masked-LM head
    token_names: dict  # the special tokens' default names by role
    model_config: Callable  # (Config of config.json, where, task, vocab size) -> ModelConfig
    state: Callable  # (Weights, ModelConfig, IdMap, Config) -> qkv's state dict, each tensor taken with its shape
    head_key: str  # a weight only the masked-LM head has
    classifier: dict = field(default_factory=dict)  # ModelConfig fields of its classification head


def convert(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None):
    return convert_encoder(folder, base, cfg, arch, sentence, BERT)


def convert_encoder(folder: Path, base: Path, cfg: dict, arch: str, sentence: dict | None, family: Family):
    """The encoder of ``family`` in ``folder`` as an :class:`~qkv.importers.Imported`: config.json read
    with :class:`~qkv.importers.folder.Config`'s getters, each tensor taken with its shape."""
    from qkv.importers import Imported
    from qkv.importers.folder import Config, load_state
    from qkv.models import build_model

    where = base / "config.json"
    c = cfg if isinstance(cfg, Config) else Config(cfg, where)
    tokenizers = _tokenizer(folder, base, family.token_names)
    ids = tokenizers.src.ids
    extra: dict = {}
    pooling, normalize = "mean", False
    task = family.tasks.get(arch, "mlm")
    mcfg = family.model_config(c, where, task, ids.size)
    max_len = mcfg.max_positions - 1
    if sentence is not None:
        pooling, normalize, max_seq = _sentence_modules(folder, sentence["modules"])
        max_len = min(max_len, max_seq - 1) if max_seq > 1 else max_len
        extra["sentence_embedding"] = {"pooling": pooling, "normalize": normalize}
    w = _weights(base, c, family.prefix)
    if task == "classify":
        problem = c.str("problem_type", "single_label_classification")
        if problem != "single_label_classification":
            refuse(where, f"problem_type {problem!r} is not supported (qkv classifies single labels)")
        id2label = c.dict("id2label", {})
        n = c.int("num_labels", 0, at_least=0, at_most=100_000) or len(id2label) or 2
        if n < 2:
            refuse(where, "a regression head (num_labels = 1) is not supported (qkv classifies)")
        labels = [id2label.get(str(i), id2label.get(i, f"LABEL_{i}")) for i in range(n)]
        if not all(isinstance(label, (str, int, float)) and not isinstance(label, bool) for label in labels):
            c.error("id2label must map each class index to a name")
        labels = [str(label) for label in labels]
        if len(set(labels)) != n:
            refuse(where, f"id2label names a label twice: {labels}")
        extra["labels"] = labels
        mcfg = replace(mcfg, n_classes=n, pooling="cls", pooler=True, **family.classifier)
    else:
        has_head = family.head_key in w
        if arch in family.masked_lm and not has_head:
            refuse(base, f"{arch} without its masked-LM head ({family.head_key})")
        mcfg = replace(mcfg, mlm_head=has_head and sentence is None, pooling=pooling)
    state = family.state(w, mcfg, ids, c)  # every tensor checked against the config before a model is built
    mcfg.validate()
    model = build_model(mcfg)
    load_state(model, state, c, allow_missing=["mlm_head.embed.weight"])  # the tied embedding: src_embed
    model.eval()
    train_cfg = TrainConfig(max_len=max_len, tokenizer_from="")
    return Imported(model, mcfg, tokenizers, train_cfg, extra, arch if sentence is None else
                    f"sentence-transformers {arch}")


def _module_kind(entry: dict) -> str:
    """A sentence-transformers module's class name (``Pooling``), whichever version wrote modules.json
    (``sentence_transformers.models.Pooling``, ``sentence_transformers.sentence_transformer.modules.pooling.Pooling``)."""
    kind = str(entry.get("type", ""))
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else kind


POOLING_MODES = {"mean": "mean", "cls": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def _sentence_modules(folder: Path, modules: list) -> tuple[str, bool, int]:
    """(pooling, normalize, max_seq_length) of a sentence-transformers folder; other modules are refused."""
    from qkv.importers.folder import Config, read_json

    pooling, normalize = "mean", False
    if _module_kind(modules[0]) != "Transformer":
        refuse(folder / "modules.json", f"its first module is {modules[0].get('type')!r}, not a Transformer")
    for m in modules[1:]:
        kind, path = _module_kind(m), folder / m.get("path", "")
        if kind == "Pooling":
            pc = read_json(path / "config.json")
            mode = pc.get("pooling_mode")  # sentence-transformers 6: one name; before: a flag per mode
            modes = [mode] if isinstance(mode, str) else [k for k, v in pc.items() if k.startswith("pooling_mode") and v]
            if len(modes) != 1 or modes[0] not in POOLING_MODES:
                refuse(path / "config.json", f"pooling {', '.join(map(str, modes)) or 'none'} is not supported (qkv "
                                             "pools mean over the tokens or the [CLS] token)")
            pooling = POOLING_MODES[modes[0]]
        elif kind == "Normalize":
            normalize = True
        else:
            refuse(folder / "modules.json", f"module {m.get('type')!r} is not supported (qkv reproduces a Transformer, "
                                            "Pooling and Normalize)")
    st = folder / "sentence_bert_config.json"
    settings = Config(read_json(st) if st.exists() else {}, st)
    if settings.bool("do_lower_case", False):
        refuse(st, "do_lower_case = true is not supported (the tokenizer's own normaliser is used)")
    own = folder / "config_sentence_transformers.json"
    if own.exists() and read_json(own).get("default_prompt_name"):
        refuse(own, "a default prompt (default_prompt_name) is not supported (qkv embeds the text as given)")
    max_seq = settings.int("max_seq_length", 0, at_least=2)
    tc = folder / "tokenizer_config.json"
    if not max_seq and tc.exists():
        limit = read_json(tc).get("model_max_length")
        max_seq = int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and 1 < limit < 10**6 else 0
    return pooling, normalize, max_seq


# the heads' weights by family: (pooler, classifier) and (dense, LayerNorm, bias, decoder) of the masked-LM head
BERT_HEADS = (("pooler.dense", "classifier"),
              ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.bias",
               "cls.predictions.decoder"))


def word_embeddings(w, name: str, ids, c, width: int, width_field: str = "hidden_size") -> torch.Tensor:
    """The word embeddings ``name``, checked: as many rows as config.json's vocab_size and the tokenizer's
    tokens (qkv imports a model whose vocabulary is its tokenizer's), ``width`` columns."""
    tokens = sum(m is not None for m in ids.model_ids)
    vocab = c.int("vocab_size", None)
    if vocab is not None:
        w.check_rows(name, vocab, c.says("vocab_size"))
    w.check_rows(name, tokens, f"tokenizer.json has {tokens} tokens (qkv imports a model whose vocabulary is its "
                               "tokenizer's)")
    return w.take(name, (tokens, width), (width_field,))


def classifier_state(w, cfg: ModelConfig, c, pooler: str, classifier: str) -> dict[str, torch.Tensor]:
    """The pooler (or the family's dense layer before its output) and the classifier, with their shapes."""
    d, k = cfg.d_model, cfg.n_classes
    labels = ("hidden_size", "num_labels" if "num_labels" in c else "id2label")
    return {"pooler.weight": w.take(pooler + ".weight", (d, d), ("hidden_size",)),
            "pooler.bias": w.take(pooler + ".bias", (d,), ("hidden_size",)),
            "classifier.weight": w.take(classifier + ".weight", (k, d), labels),
            "classifier.bias": w.take(classifier + ".bias", (k,), labels)}


def _state(w, cfg: ModelConfig, ids, c, heads: tuple = BERT_HEADS) -> dict[str, torch.Tensor]:
    """qkv's state dict of a BERT-named encoder (BERT, RoBERTa, ELECTRA: ``heads`` name their heads) from
    its weights ``w`` (:class:`~qkv.importers.folder.Weights`), each tensor taken with the shape config.json
    ``c`` gives it."""
    d, ff, n = cfg.d_model, cfg.d_ff, cfg.n_encoder_layers
    e_dim = cfg.embedding_dim or d
    D, FF = ("hidden_size",), ("hidden_size", "intermediate_size")
    E = ("embedding_size",) if cfg.embedding_dim else D
    w.check_layers(r"encoder\.layer\.(\d+)\.", n, "num_hidden_layers")

    s: dict[str, torch.Tensor] = {}
    e = "embeddings."
    word = word_embeddings(w, e + "word_embeddings.weight", ids, c, e_dim, E[0])
    s["src_embed.weight"] = ids.rows(word)
    s["src_pos.weight"] = w.take(e + "position_embeddings.weight", (cfg.max_positions + cfg.position_offset, e_dim),
                                 ("max_position_embeddings", *E))
    if cfg.type_vocab_size:
        s["src_types.weight"] = w.take(e + "token_type_embeddings.weight", (cfg.type_vocab_size, e_dim),
                                       ("type_vocab_size", *E))
    s["embed_norm.weight"], s["embed_norm.bias"] = (w.take(e + "LayerNorm." + p, (e_dim,), E) for p in ("weight", "bias"))
    if cfg.embedding_dim:  # ELECTRA's embeddings_project
        s["embed_proj.weight"] = w.take("embeddings_project.weight", (d, e_dim), ("hidden_size", "embedding_size"))
        s["embed_proj.bias"] = w.take("embeddings_project.bias", (d,), D)
    for i in range(n):
        h, q = f"encoder.layer.{i}.", f"encoder_layers.{i}."
        att = h + "attention.self."
        s[q + "self_attn.in_proj.weight"] = torch.cat([w.take(att + m + ".weight", (d, d), D)
                                                      for m in ("query", "key", "value")])
        s[q + "self_attn.in_proj.bias"] = torch.cat([w.take(att + m + ".bias", (d,), D) for m in ("query", "key", "value")])
        for src, dst, shape, bias in (("attention.output.dense", "self_attn.out_proj", (d, d), d),
                                      ("attention.output.LayerNorm", "res_attn.norm", (d,), d),
                                      ("intermediate.dense", "ffn.w_1", (ff, d), ff),
                                      ("output.dense", "ffn.w_2", (d, ff), d),
                                      ("output.LayerNorm", "res_ffn.norm", (d,), d)):
            s[q + dst + ".weight"] = w.take(h + src + ".weight", shape, FF)
            s[q + dst + ".bias"] = w.take(h + src + ".bias", (bias,), FF)
    (pooler, classifier), (dense, norm, bias, decoder) = heads
    if cfg.task == "classify":
        s.update(classifier_state(w, cfg, c, pooler, classifier))
    elif cfg.mlm_head:
        s.update(mlm_head_state(w, word, ids, c, d, dense, norm, bias, decoder))
    return s


def mlm_head_state(w, word: torch.Tensor, ids, c, d: int, dense: str, norm: str, bias: str, decoder: str,
                   width: int | None = None) -> dict:
    """qkv's ``mlm_head`` of a masked-LM head ``LayerNorm(f(dense h)) Eᵀ + bias`` with its decoder tied to
    ``word`` (rows: the model's tokens, ``width`` = E columns; d: the width of the states it reads)."""
    rows, e = word.shape
    D = ("hidden_size",)
    weight = w.take(decoder + ".weight", (rows, e), D, default=None)
    if weight is not None and not torch.equal(weight, word):
        refuse(c.path.parent, "its masked-LM decoder is not tied to the word embeddings (qkv's head is tied)")
    own = w.take(decoder + ".bias", (rows,), ("vocab_size",), default=None)
    if own is not None and bias in w and not torch.equal(own, w.take(bias, (rows,), ("vocab_size",))):
        refuse(c.path.parent, f"its masked-LM decoder's bias is not {bias} (qkv's head has one bias)")
    head_bias = w.take(bias, (rows,), ("vocab_size",)) if bias in w else w.take(decoder + ".bias", (rows,), ("vocab_size",))
    return {"mlm_head.dense.weight": w.take(dense + ".weight", (e, d), D), "mlm_head.dense.bias": w.take(dense + ".bias", (e,), D),
            "mlm_head.norm.weight": w.take(norm + ".weight", (e,), D), "mlm_head.norm.bias": w.take(norm + ".bias", (e,), D),
            # a row the model lacks (BERT's BOS, EOS) gets no probability: every other token keeps its own
            "mlm_head.bias": ids.rows(head_bias, fill=ADDED_ROW_LOGIT)}


BERT = Family("BERT", "bert.", {"BertForSequenceClassification": "classify"}, ("BertForMaskedLM", "BertForPreTraining"),
              TOKEN_NAMES, lambda cfg, where, task, vocab: model_config(cfg, where, task, vocab), lambda *a: _state(*a),
              "cls.predictions.bias")
