"""``--format hf`` for an imported model: the folder of its own family's transformers class.

A checkpoint that ``qkv import`` made goes back as the class it came from (config.json's
``architectures``, recorded in the checkpoint). Each family below is one :class:`Family`: the
transformers config of a qkv :class:`~qkv.config.ModelConfig` (written here, the only thing said per
family) and the call of its importer's weight mapping, which :mod:`qkv.export.hf_trace` runs backwards
(the names, transposes, splits and row orders are the importer's, never written twice). Two checks
make the config honest before anything is written: the importer reads the written config.json back
into the checkpoint's own ModelConfig (any option the class cannot say, e.g. a qkv-only switch, is
refused by name), and the written folder, loaded by transformers, computes the checkpoint's logits
or hidden states (``verify``).

A language model ``qkv train`` made with Llama's (Qwen2's, GPT-2's) switches is written the same way, as
the first of :data:`TRAINED` whose config says it all (:func:`as_import` holds it as an import would be:
its √d_model folded into an untied embedding, a zero output bias), its SentencePiece model as a
tokenizer.json of the same ids (:func:`sentencepiece_json`).

    LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel      logits
    {Bert, Roberta, XLMRoberta, Camembert, DistilBert, Albert}{Model,            hidden states, logits
      ForMaskedLM, ForSequenceClassification}, ElectraModel,                    or class logits
      ElectraForSequenceClassification (BertForPreTraining: BertForMaskedLM)
    BartForConditionalGeneration, T5ForConditionalGeneration                    teacher-forced logits
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from qkv.config import BOS, CLS, EOS, PAD, SEP, UNK
from qkv.errors import QkvError

LOGIT_TOLERANCE = 1e-4  # max |delta| of the written folder's outputs against the checkpoint's (float32)
# ModelConfig fields a transformers config does not carry back (training settings) or carries as a bound
IGNORED = {"dropout", "attention_dropout", "max_positions"}


@dataclass(frozen=True)
class Family:
    kind: str  # "lm", "encoder" or "seq2seq": what verify compares
    config: Callable  # (Source, arch) -> the transformers config
    read_config: Callable  # (config dict, where, arch, Source) -> the ModelConfig the importer reads from it
    state: Callable  # (Tagged, Source, Config) -> qkv's state dict of addresses (the importer's own mapping)
    not_in_checkpoint: tuple = ()  # parameters the import leaves out (a pooler): not written


def _idmap(src):
    """qkv id -> the model's: an import's (its tokenizer.json's ids), or one to one for a language model qkv
    trained (its SentencePiece ids are qkv's)."""
    from qkv.data.pretrained import IdMap

    ids = getattr(src.tokenizers.src, "ids", None)
    return ids if ids is not None else IdMap(tuple(range(src.model.tgt_vocab_size)))


def _ids(src) -> list[int | None]:
    return list(_idmap(src).model_ids)


def _vocab(src) -> int:
    return max(m for m in _ids(src) if m is not None) + 1


def _id(src, slot: int) -> int | None:
    return _ids(src)[slot]


# --- Llama, Qwen2, Mistral ------------------------------------------------------------------------------

def llama_config(src, arch: str):
    import transformers

    cfg = src.model
    common = dict(vocab_size=_vocab(src), hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_decoder_layers, num_attention_heads=cfg.n_heads,
                  num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_positions,
                  rms_norm_eps=cfg.layer_norm_eps, hidden_act=cfg.activation if cfg.activation != "gelu_tanh"
                  else "gelu_pytorch_tanh", tie_word_embeddings=cfg.tie_output,
                  bos_token_id=_id(src, BOS), eos_token_id=_id(src, EOS), attention_dropout=cfg.attention_dropout,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, architectures=[arch])
    if arch == "LlamaForCausalLM":
        return transformers.LlamaConfig(**common, attention_bias=cfg.qkv_bias, mlp_bias=cfg.ffn_bias)
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.MistralConfig(**common, sliding_window=None)


def llama_read(data: dict, where, arch: str, src):
    from qkv.importers import llama

    return llama.model_config(data, where, arch, src.model.src_vocab_size)


def llama_state(tagged, src, c):
    from qkv.importers import llama

    return llama.state_dict(tagged, src.model, _idmap(src), c.path)


# --- GPT-2 ----------------------------------------------------------------------------------------------

GPT2_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def gpt2_config(src, arch: str):
    from transformers import GPT2Config

    cfg = src.model
    eos = _id(src, EOS)
    return GPT2Config(vocab_size=_vocab(src), n_positions=cfg.max_positions, n_embd=cfg.d_model,
                      n_layer=cfg.n_decoder_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                      activation_function=GPT2_ACTIVATIONS.get(cfg.activation, cfg.activation),
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
                      layer_norm_epsilon=cfg.layer_norm_eps, bos_token_id=eos, eos_token_id=eos,
                      tie_word_embeddings=True, architectures=[arch])


def gpt2_read(data: dict, where, arch: str, src):
    from qkv.importers import gpt2

    return gpt2.model_config(data, where, src.model.src_vocab_size)


def gpt2_state(tagged, src, c):
    from qkv.importers import gpt2

    return gpt2.state_dict(tagged, src.model, _idmap(src), c.path)


# --- BERT, RoBERTa (XLM-R, CamemBERT), DistilBERT, ALBERT, ELECTRA ----------------------------------------

ENCODER_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def _labels(src) -> dict:
    """A classifier's labels (the import kept them) as config.json says them."""
    if src.model.task != "classify":
        return {}
    labels = src.config.get("labels") or [f"LABEL_{i}" for i in range(src.model.n_classes)]
    return {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)},
            "problem_type": "single_label_classification"}


def bert_like_config(src, arch: str):
    """BertConfig and the configs of BERT's names (RoBERTa's, ELECTRA's, ALBERT's)."""
    import transformers

    cfg = src.model
    prefix = next(p for p in ("XLMRoberta", "Camembert", "Roberta", "Electra", "Albert", "Bert") if arch.startswith(p))
    extra = {}
    if prefix in ("XLMRoberta", "Camembert", "Roberta"):  # RoBERTa's positions: row t + pad_token_id + 1
        extra = {"pad_token_id": cfg.position_offset - 1, "bos_token_id": _id(src, CLS), "eos_token_id": _id(src, SEP)}
    if prefix in ("Electra", "Albert"):
        extra["embedding_size"] = cfg.embedding_dim or cfg.d_model
    if prefix == "Albert":
        extra.update(num_hidden_groups=cfg.layer_groups, inner_group_num=1)
    return getattr(transformers, f"{prefix}Config")(
        vocab_size=_vocab(src), hidden_size=cfg.d_model, num_hidden_layers=cfg.n_encoder_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.d_ff,
        hidden_act=ENCODER_ACTIVATIONS.get(cfg.activation, cfg.activation), hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_positions + cfg.position_offset,
        type_vocab_size=cfg.type_vocab_size, layer_norm_eps=cfg.layer_norm_eps,
        **{"pad_token_id": _id(src, PAD), **extra}, **_labels(src), architectures=[arch])


def distilbert_config(src, arch: str):
    from transformers import DistilBertConfig

    cfg = src.model
    return DistilBertConfig(vocab_size=_vocab(src), dim=cfg.d_model, n_layers=cfg.n_encoder_layers, n_heads=cfg.n_heads,
                            hidden_dim=cfg.d_ff, activation=ENCODER_ACTIVATIONS.get(cfg.activation, cfg.activation),
                            dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                            max_position_embeddings=cfg.max_positions, sinusoidal_pos_embds=False,
                            pad_token_id=_id(src, PAD), **_labels(src), architectures=[arch])


def _importer(arch: str):
    """The importer's :class:`~qkv.importers.bert.Family` of an encoder architecture."""
    from qkv.importers import albert, bert, distilbert, electra, roberta

    for module, family in ((bert, bert.BERT), (roberta, roberta.FAMILY), (distilbert, distilbert.FAMILY),
                           (albert, albert.FAMILY), (electra, electra.FAMILY)):
        if arch in module.ARCHITECTURES:
            return family
    raise QkvError(f"internal: no importer for {arch}")


def encoder_read(data, where, arch: str, src):
    """The importer's ModelConfig of ``data`` with the head the checkpoint has (as ``convert_encoder`` sets it)."""
    from dataclasses import replace

    family, cfg = _importer(arch), src.model
    back = family.model_config(data, where, cfg.task, cfg.src_vocab_size)
    if cfg.task == "classify":
        return replace(back, n_classes=cfg.n_classes, pooling="cls", pooler=True, **family.classifier)
    return replace(back, mlm_head=cfg.mlm_head, pooling=cfg.pooling)


def encoder_state(tagged, src, c):
    family = _importer(c.get("architectures")[0])
    n = len(family.prefix)
    return family.state(tagged.renamed(lambda k: k[n:] if k.startswith(family.prefix) else k), src.model,
                        src.tokenizers.src.ids, c)


# --- BART, T5 -------------------------------------------------------------------------------------------

def bart_start(src) -> int:
    """BART's decoder_start_token_id: the token (its eos, or the one a text starts with) whose embedding the
    import copied into qkv's BOS row."""
    import torch

    tok, emb = src.tokenizers.src, src.w("src_embed.weight")
    to_qkv = tok.ids.to_qkv
    for m in [_id(src, EOS), *(tok.ids.model_ids[q] for q in tok.prefix)]:
        if m is not None and torch.equal(emb[to_qkv[m]], emb[BOS]):
            return m
    raise QkvError(f"{src.path}: its BOS row is no token's embedding (BART's decoder starts from one of its tokens)")


def bart_config(src, arch: str):
    from transformers import BartConfig

    from qkv.importers.marian import ACTIVATIONS

    cfg, tok = src.model, src.tokenizers.src
    act = next((k for k, v in ACTIVATIONS.items() if v == cfg.activation), cfg.activation)
    prefix = [tok.ids.model_ids[q] for q in tok.prefix]
    return BartConfig(vocab_size=_vocab(src), d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
                      decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
                      decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
                      activation_function=act, dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                      activation_dropout=0.0, max_position_embeddings=cfg.max_positions,
                      scale_embedding=cfg.scale_embeddings, tie_word_embeddings=cfg.tie_output,
                      pad_token_id=_id(src, PAD), eos_token_id=_id(src, EOS),
                      bos_token_id=prefix[0] if prefix else _id(src, EOS), decoder_start_token_id=bart_start(src),
                      forced_eos_token_id=_id(src, EOS), architectures=[arch])


def bart_read(data, where, arch: str, src):
    from qkv.importers import bart

    return bart.model_config(data, where, src.model.src_vocab_size)


def bart_state(tagged, src, c):
    from qkv.importers import bart

    return bart.state_dict(tagged, src.model, src.tokenizers.src.ids, c.int("decoder_start_token_id"), c.path.parent)


def t5_tied(src) -> bool:
    """T5 v1: the output is the shared embedding (lm_head tied), the decoder output scaled by d_model^-0.5,
    as the import folded it into output_proj; v1.1 and Flan: an lm_head of its own, unscaled."""
    import torch

    emb, out = src.w("src_embed.weight"), src.w("output_proj.weight")
    return bool(torch.allclose(out, emb * src.model.d_model ** -0.5, rtol=1e-6, atol=0))


def t5_config(src, arch: str):
    from transformers import T5Config

    from qkv.importers.t5 import ACTIVATIONS

    cfg = src.model
    act = next((k for k, v in ACTIVATIONS.items() if v == cfg.activation), cfg.activation)
    proj = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if cfg.ffn_gated else act
    tied = t5_tied(src)
    config = T5Config(vocab_size=_vocab(src), d_model=cfg.d_model, d_kv=cfg.d_k, d_ff=cfg.d_ff,
                    num_layers=cfg.n_encoder_layers, num_decoder_layers=cfg.n_decoder_layers, num_heads=cfg.n_heads,
                    relative_attention_num_buckets=cfg.relative_buckets,
                    relative_attention_max_distance=cfg.relative_max_distance, dropout_rate=cfg.dropout,
                    layer_norm_epsilon=cfg.layer_norm_eps, feed_forward_proj=proj, tie_word_embeddings=tied,
                    pad_token_id=_id(src, BOS), eos_token_id=_id(src, EOS), decoder_start_token_id=_id(src, BOS),
                    architectures=[arch])
    config.tie_word_embeddings = tied  # T5Config sets true whatever it is given (and scales unless given false)
    return config


def t5_read(data, where, arch: str, src):
    from qkv.importers import t5

    return t5.model_config(data, where, src.model.src_vocab_size)


def t5_state(tagged, src, c):
    from qkv.importers import t5

    out = t5.state_dict(tagged, src.model, c, src.tokenizers.src.ids, c.path.parent)
    if c.bool("tie_word_embeddings"):  # T5 v1 computes its scaled output from the shared embedding itself
        out.pop("output_proj.weight")
    return out


LLAMA = Family("lm", llama_config, llama_read, llama_state)
BERT_LIKE = Family("encoder", bert_like_config, encoder_read, encoder_state,
                   ("pooler.dense.weight", "pooler.dense.bias", "pooler.weight", "pooler.bias"))
FAMILIES = {"LlamaForCausalLM": LLAMA, "Qwen2ForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
            "GPT2LMHeadModel": Family("lm", gpt2_config, gpt2_read, gpt2_state),
            **{f"{n}{kind}": BERT_LIKE for n in ("Bert", "Roberta", "XLMRoberta", "Camembert", "Albert")
               for kind in ("Model", "ForMaskedLM", "ForSequenceClassification")},
            "ElectraModel": BERT_LIKE, "ElectraForSequenceClassification": BERT_LIKE,
            **{f"DistilBert{kind}": Family("encoder", distilbert_config, encoder_read, encoder_state)
               for kind in ("Model", "ForMaskedLM", "ForSequenceClassification")}}
FAMILIES.update({"BartForConditionalGeneration": Family("seq2seq", bart_config, bart_read, bart_state),
                 "T5ForConditionalGeneration": Family("seq2seq", t5_config, t5_read, t5_state)})
WRITTEN_AS = {"BertForPreTraining": "BertForMaskedLM"}  # its next-sentence head is not imported


def written() -> list[str]:
    """The classes an import is written back as (``qkv export --help``, the refusals)."""
    return [*FAMILIES, *WRITTEN_AS]


def imported_architecture(src) -> str | None:
    """The transformers class the checkpoint was imported from (config.json's ``imported``), or None."""
    imported = src.config.get("imported")
    arch = imported.get("architecture") if isinstance(imported, dict) else None
    return arch if isinstance(arch, str) else None


# --- a language model qkv trained (its own SentencePiece model, qkv's ids) ------------------------------

# the classes a qkv-trained language model is written as, in this order (the first whose config says it all)
TRAINED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
# ModelConfig fields a decoder-only language model never reads (an encoder's, a classifier's, a recurrent
# model's, the initialisation): a trained one keeps them at whatever its run had
LM_UNREAD = {"n_encoder_layers", "share_embeddings", "src_vocab_size", "mlm_head", "mlm_head_activation", "pooling",
             "pooler", "pooler_activation", "pooler_dropout", "n_classes", "rnn_nonlinearity", "bidirectional",
             "attention", "input_feeding", "init"}


def trained_lm(src) -> bool:
    """A decoder-only language model ``qkv train`` made: qkv's own SentencePiece model, no import record."""
    from qkv.data.tokenizer import Tokenizer

    pair = src.tokenizers
    return (src.key == ("lm", "transformer") and src.config.get("imported") is None
            and isinstance(pair.src, Tokenizer) and pair.tgt is pair.src)


def as_import(src):
    """``src`` as an import of the family would hold it, and what of it no such class computes (``field = value``).

    An import (or a model fine-tuned from one) is returned as it is. A language model qkv trained is held
    the importer's way: its embedding scale √d_model folded into the embedding table (possible only when
    the output projection is a table of its own: a tied one would be scaled too, refused by name), an
    output bias of zeros where it has none (a trained, non-zero one is refused by name)."""
    from dataclasses import replace

    if not trained_lm(src):
        return src, []
    import math

    import torch

    cfg, weights, problems = src.model, dict(src.weights), []
    if cfg.scale_embeddings:
        if cfg.tie_output:
            problems.append("scale_embeddings = true with tie_output = true (the classes scale no embedding, and the "
                            "factor √d_model cannot be folded into a table the output projection shares)")
        else:
            weights["embed.weight"] = weights["embed.weight"] * math.sqrt(cfg.d_model)
    bias = weights.get("output_bias")
    if bias is not None and bool(bias.any()):
        problems.append("output_bias = true (the classes' logits have no bias)")
    weights["output_bias"] = torch.zeros(cfg.tgt_vocab_size)
    return replace(src, model=replace(cfg, scale_embeddings=False, output_bias=True), weights=weights), problems


def trained_refusal(src) -> QkvError:
    """Why a language model qkv trained is none of :data:`TRAINED`: what the first cannot say, by name."""
    try:
        check(src, TRAINED[0], FAMILIES[TRAINED[0]])
    except QkvError as e:
        return QkvError(f"{e}; --format hf writes a language model qkv trained as {' or '.join(TRAINED)} (the "
                        "first whose config says every option; --format ctranslate2 converts other switches)")
    return QkvError(f"internal: {src.path} is a {TRAINED[0]}")


def sentencepiece_json(model_bytes: bytes, where) -> str:
    """qkv's SentencePiece model as a tokenizer.json that reads a text into the same ids: its pieces and
    scores (BPE's merges in the order of their pieces' scores, as transformers' ``generate_merges`` orders
    them; Unigram's scores; a char model: its characters, no merges), its normalisation (the precompiled
    NFKC map, extra whitespace removed), the dummy prefix ``▁``, byte fallback, its control and
    user-defined pieces as added tokens. Not the same: a text that spells a control piece (``</s>``) or a
    user-defined one (``[MASK]``: SentencePiece puts a ``▁`` piece before it)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    from transformers.convert_slow_tokenizer import generate_merges

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if spec.model_type == 1:  # unigram
        model = Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    elif spec.model_type in (2, 4):  # bpe, char
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        merges = generate_merges(vocab, pieces) if spec.model_type == 2 else []
        model = BPE(vocab, merges, unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=spec.byte_fallback)
    else:
        raise QkvError(f"{where}: a SentencePiece model of type {spec.model_type} (qkv trains bpe, unigram, char)")
    tok = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()]
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if norm.add_dummy_prefix
                                                 else "never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else [])])
    tok.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3) for p in proto.pieces if p.type in (3, 4)])
    return tok.to_str(pretty=True)


def family_of(src) -> tuple[str, Family] | None:
    """(architecture, Family) of an imported checkpoint this module writes; None for every other. A
    checkpoint that records no import but reads a tokenizer.json (one that ``train --init-from`` an
    import wrote) is the first class of its task whose config.json says every one of its options."""
    arch = imported_architecture(src)
    if arch is None and src.config.get("imported") is None:
        arch = _class_of_options(src)
    arch = WRITTEN_AS.get(arch, arch)
    return (arch, FAMILIES[arch]) if arch in FAMILIES else None


# the classes a checkpoint without an import record is tried as, by task (and masked-LM head), in this order
CANDIDATES = {
    "lm": ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"),
    "translate": ("BartForConditionalGeneration", "T5ForConditionalGeneration"),
    "classify": tuple(f"{n}ForSequenceClassification" for n in ("Bert", "Roberta", "DistilBert", "Albert", "Electra")),
    "mlm-head": tuple(f"{n}ForMaskedLM" for n in ("Bert", "Roberta", "DistilBert", "Albert")),
    "mlm": tuple(f"{n}Model" for n in ("Bert", "Roberta", "DistilBert", "Albert", "Electra")),
}


def _class_of_options(src) -> str | None:
    pair = src.tokenizers
    trained = trained_lm(src)
    if not trained and (getattr(getattr(pair, "src", None), "tokenizer_json", None) is None or pair.tgt is not pair.src):
        return None  # qkv's own SentencePiece models but a language model's: --format hf writes a MarianMTModel
    task = src.model.task + ("-head" if src.model.task == "mlm" and src.model.mlm_head else "")
    for arch in TRAINED if trained else CANDIDATES.get(task, ()):
        try:
            check(src, arch, FAMILIES[arch])
        except QkvError:
            continue
        return arch
    return None


def _value(v) -> str:
    return repr(v).replace("True", "true").replace("False", "false")


def check(src, arch: str, family: Family) -> None:
    """Refuse by name every ModelConfig option the family's config.json cannot carry: the importer reads
    the config this export would write back into the checkpoint's own options, or the export is refused."""
    from qkv.importers.folder import Config

    trained = trained_lm(src)
    ignored = IGNORED | (LM_UNREAD if trained else set())
    src, problems = as_import(src)
    data = family.config(src, arch).to_dict()
    where = src.path / "config.json"
    try:
        back = family.read_config(Config(data, where), where, arch, src)
    except QkvError as e:
        raise QkvError(f"{src.path}: --format hf cannot write it as {arch} ({e})") from None
    mine, theirs = asdict(src.model), asdict(back)
    if trained and src.model.kv_heads == back.kv_heads:  # 0 is n_heads: the same attention
        mine["n_kv_heads"] = theirs["n_kv_heads"]
    differ = [f"{k} = {_value(mine[k])} ({arch} has {_value(theirs[k])})" for k in mine
              if k not in ignored and k in theirs and mine[k] != theirs[k]] + problems
    if differ:
        raise QkvError(f"{src.path} has {', '.join(differ)}: --format hf writes it as {arch}, which cannot say it")


# --- writing and checking -------------------------------------------------------------------------------

def tokenizer_files(src, out) -> dict[str, str]:
    """The imported tokenizer.json as it came, and a tokenizer_config.json naming its special tokens by
    role (what the import read them as) for ``PreTrainedTokenizerFast`` / ``AutoTokenizer``."""
    import json

    from qkv.data.pretrained import SLOT_NAMES

    tok = src.tokenizers.src
    if trained_lm(src):  # qkv's SentencePiece model, converted; its ids are qkv's
        (out / "tokenizer.json").write_text(sentencepiece_json(tok.model_bytes, src.path / "spm.model"),
                                            encoding="utf-8")
        specials = {f"{name}_token": tok.id_to_piece(slot) for slot, name in ((PAD, "pad"), (UNK, "unk"), (BOS, "bos"),
                                                                               (EOS, "eos"))}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
                  "add_eos_token": False, "model_max_length": src.model.max_positions,
                  "clean_up_tokenization_spaces": False}
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
        return specials
    (out / "tokenizer.json").write_bytes(tok.tokenizer_json)
    roles = dict(SLOT_NAMES)
    if imported_architecture(src) == "T5ForConditionalGeneration":
        roles[BOS] = "pad"  # qkv's BOS is T5's pad, the decoder's start; qkv's PAD a row of its own
    specials = {f"{roles[slot]}_token": tok.tok.id_to_token(m) for slot, m in enumerate(_ids(src)[:len(SLOT_NAMES)])
                if m is not None}
    if tok.prefix and "bos_token" not in specials:  # BART's <s>, put before every text
        specials["bos_token"] = tok.tok.id_to_token(tok.ids.model_ids[tok.prefix[0]])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "model_max_length": src.model.max_positions, "clean_up_tokenization_spaces": False}
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return specials


def write(src, out, arch: str, family: Family, version: str) -> dict:
    """Write ``arch``'s folder for the imported checkpoint ``src`` into ``out`` (empty) and check it."""
    import torch
    import transformers

    from qkv.export.hf_trace import Tagged, invert
    from qkv.export.source import checkpoint_name
    from qkv.importers.folder import Config

    original, (src, _) = src, as_import(src)  # check() refused what the class cannot hold
    config = family.config(src, arch)
    cls = getattr(transformers, arch)
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in parameters(cls(config)).items()}
    c = Config(config.to_dict(), out / "config.json")
    tagged = Tagged(shapes, c)
    state, unfilled = invert(tagged, family.state(tagged, src, c), src.weights, str(src.path))
    # a copy the class keeps of another tensor where it does not tie them (T5's untied stacks' embed_tokens)
    copies = getattr(cls, "_tied_weights_keys", None)
    for name, source in (copies.items() if isinstance(copies, dict) else ()):
        if name in unfilled and source in state:
            state[name] = state[source]
            unfilled.remove(name)
    left = sorted(set(unfilled) - set(family.not_in_checkpoint))
    if left:
        raise QkvError(f"internal: the checkpoint fills no {', '.join(left[:5])} of {arch}")
    torch.manual_seed(0)  # the random init of what the import left out (named in qkv_export.json)
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(unfilled) - set(_tied(model)) - set(_buffers(model)):
        raise QkvError(f"internal: {arch} names differ (missing {sorted(missing)[:5]}, unexpected {unexpected[:5]})")
    model.eval()
    if trained_lm(original):  # qkv's search never emits its special pieces (EOS ends a text) and pads with PAD
        from qkv.decoding.greedy import banned_ids

        model.generation_config.update(suppress_tokens=list(banned_ids(original.tokenizers.tgt)), pad_token_id=PAD)
    if family.kind == "seq2seq":  # qkv's saved search as generate()'s (the import read it from these fields)
        dec = src.decode
        start = 2 if arch == "BartForConditionalGeneration" else 1  # max_length counts the start (and BART's <s>)
        model.generation_config.update(num_beams=dec.beam_size, length_penalty=dec.length_penalty,
                                       early_stopping=dec.early_stopping, max_length=dec.max_len_b + start)
    # what the import left out (a BertModel's pooler) is not written: transformers initialises it and says so
    model.save_pretrained(str(out), state_dict=state)
    specials = tokenizer_files(original, out)
    check = verify(original, out, arch, family)  # against the checkpoint as it is (its scale not folded)
    return {"format": "hf", "transformers_version": version, "qkv_version": src.qkv_version,
            "checkpoint": checkpoint_name(src.path), "task": src.task, "runtime": f"transformers.{arch}",
            "special_tokens": specials, "tokenizer_json": {"src": "tokenizer.json"}, "not_in_checkpoint": unfilled,
            "verified": check, "differences": []}


def parameters(model) -> dict:
    """The model's parameters, a tied one once: under the input side's name (the word embeddings, not a
    decoder tied to them), as the importers read it."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
    groups: dict[int, list[str]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        groups.setdefault(id(p), []).append(name)
    chosen = {}
    for key, names in groups.items():
        own = [n for n in names if not (key in output and n.startswith(_module_name(model, out_emb)))]
        name = (own or names)[0]
        chosen[name] = params[name]
    saved = model.state_dict()  # and the buffers it saves (BART's final_logits_bias)
    chosen.update({k: b for k, b in model.named_buffers() if k in saved and b.is_floating_point()})
    return chosen


def _module_name(model, module) -> str:
    return next((n + "." for n, m in model.named_modules() if m is module), "\0")


def _tied(model) -> list[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    mine = parameters(model)
    return [k for k in params if k not in mine]


def _buffers(model) -> list[str]:
    return [k for k, _ in model.named_buffers()]


def probe(src) -> list[list[int]]:
    """Right-padded probe sequences of ordinary tokens (qkv ids)."""
    from qkv.export.reference import probe_sequences

    sources, targets = probe_sequences(src)
    return [s + t for s, t in zip(sources, targets)]


def padded(seqs: list[list[int]]):
    """``seqs`` right-padded with PAD, and where they are real."""
    import torch

    width = max(map(len, seqs))
    tokens = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    return tokens, tokens != PAD


def outputs(src, hf, family: Family, to_model) -> tuple:
    """(transformers' outputs, the checkpoint's, the positions compared, what they are) on a probe batch."""
    import torch

    from qkv.export.reference import lm_logits, probe_sequences, reference_model, translation_logits

    model = reference_model(src)
    if family.kind == "seq2seq":  # teacher-forced: source EOS -> BOS target (BOS: the decoder's start token)
        from qkv.data.batching import collate

        sources, targets = probe_sequences(src)
        batch = collate(sources, targets)
        to_model = to_model.clone()
        to_model[BOS] = hf.config.decoder_start_token_id
        real = torch.zeros_like(batch.tgt_in, dtype=torch.bool)
        for i, t in enumerate(targets):
            real[i, :len(t) + 1] = True
        got = hf(input_ids=to_model[batch.src], attention_mask=(batch.src != PAD).long(),
                 decoder_input_ids=to_model[batch.tgt_in]).logits
        return got, translation_logits(model, sources, targets), real, "logit"
    seqs = probe(src)
    if family.kind == "encoder":  # a text as the encoder reads it: [CLS] tokens [SEP]
        seqs = [[CLS] + s + ([SEP] if _id(src, SEP) is not None else []) for s in seqs]
    tokens, real = padded(seqs)
    out = hf(input_ids=to_model[tokens], attention_mask=real.long())
    if family.kind == "lm":
        return out.logits, lm_logits(model, seqs), real, "logit"
    if src.model.task == "classify":
        return out.logits, model(tokens), torch.ones(len(seqs), dtype=torch.bool), "class logit"
    if src.model.mlm_head:
        return out.logits, model(tokens), real, "logit"
    return out.last_hidden_state, model.encode(tokens)[0], real, "hidden state"


def verify(src, out, arch: str, family: Family) -> dict:
    """Load ``out`` with transformers' own class and compare its outputs with the checkpoint's network on a
    right-padded probe batch (max |delta| <= LOGIT_TOLERANCE, over the tokens both have), and its
    tokenizer's ids with qkv's."""
    import torch
    import transformers

    ids = _ids(src)
    to_model = torch.tensor([m if m is not None else 0 for m in ids])
    have = torch.tensor([m is not None for m in ids])
    hf = getattr(transformers, arch).from_pretrained(str(out)).eval()
    with torch.inference_mode():
        got, ref, real, what = outputs(src, hf, family, to_model)
    got, ref = got.float(), ref.float()
    if what == "logit":  # over the vocabulary: the model's tokens, in qkv's order
        got, ref = got[..., to_model[have]], ref[..., have]
    delta = float((got - ref)[real].abs().max())
    if not delta <= LOGIT_TOLERANCE:
        raise QkvError(f"the exported {arch} disagrees with {src.path}: max |delta {what}| = {delta:.3g} "
                       f"(expected <= {LOGIT_TOLERANCE:g})")
    # the tokenizer.json as written (AutoTokenizer may rebuild a family's own pipeline instead: Qwen2's)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    t = src.tokenizers.src
    texts = ["Hello, world! 123", "The quick brown fox.", t.decode([probe(src)[0]])[0]]
    # a trained model's prompt: its SentencePiece ids, no BOS (qkv's LanguageModel.prompt_ids of one line)
    want = t.encode(texts) if trained_lm(src) else [t.to_model_ids(t.encode_text(x)) for x in texts]
    got_ids = tok(texts)["input_ids"]
    if got_ids != want:
        raise QkvError(f"the exported tokenizer disagrees with {src.path}'s on {texts!r}: {got_ids} != {want}")
    return {"probe_sequences": int(real.size(0)), "positions": int(real.sum()), "compared": what + "s",
            "max_abs_logit_difference": delta, "tokenizer_texts": len(texts)}


def usage(src, here: str) -> str:
    """The model card's code for the written class."""
    arch, family = family_of(src)
    if family.kind == "lm":
        made = "from qkv's SentencePiece model" if trained_lm(src) else "as imported"
        return f"""```python
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

{here}
tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)  # tokenizer.json {made}
model = AutoModelForCausalLM.from_pretrained(model_dir)  # {arch}
batch = tokenizer(["the text to continue"], return_tensors="pt")
out = model.generate(**batch, do_sample=False, max_new_tokens=40)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
```"""
    if family.kind == "seq2seq":
        return f"""```python
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

{here}
tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)  # tokenizer.json as imported
model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)  # {arch}; generation_config.json: qkv's search
batch = tokenizer(["your text"], return_tensors="pt", padding=True, return_token_type_ids=False)
out = model.generate(**batch)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
```"""
    auto = {"classify": "AutoModelForSequenceClassification", "mlm": "AutoModelForMaskedLM"}[src.model.task] \
        if src.model.task == "classify" or src.model.mlm_head else "AutoModel"
    result = {"AutoModelForSequenceClassification": "print([model.config.id2label[int(i)] for i in "
                                                    "out.logits.argmax(-1)])",
              "AutoModelForMaskedLM": "print(out.logits.shape)  # (texts, tokens, vocabulary)",
              "AutoModel": "print(out.last_hidden_state.shape)  # (texts, tokens, hidden size)"}[auto]
    return f"""```python
import torch
from transformers import {auto}, PreTrainedTokenizerFast

{here}
tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)  # tokenizer.json as imported
model = {auto}.from_pretrained(model_dir).eval()  # {arch}
batch = tokenizer(["a text", "another text"], return_tensors="pt", padding=True, return_token_type_ids=False)
with torch.no_grad():
    out = model(**batch)
{result}
```"""


def pipeline_tag(src) -> str:
    """The model card's pipeline_tag of the written class."""
    if src.model.task == "translate":
        return "text2text-generation"
    if src.model.task == "classify":
        return "text-classification"
    if src.model.task == "mlm":
        return "fill-mask" if src.model.mlm_head else "feature-extraction"
    return "text-generation"


__all__ = ["FAMILIES", "Family", "as_import", "check", "family_of", "imported_architecture", "pipeline_tag",
           "sentencepiece_json", "trained_lm", "trained_refusal", "usage", "verify", "write", "written"]
