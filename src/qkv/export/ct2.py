"""CTranslate2: a converter on CTranslate2's own interface, built as its fairseq and OpenNMT-py
converters are (a ``ctranslate2.converters.Converter`` whose ``_load`` fills a ``ModelSpec``).

    translate, transformer   TransformerSpec.from_config              ->  ctranslate2.Translator
    lm, transformer          TransformerDecoderModelSpec.from_config  ->  ctranslate2.Generator
    prefix_lm, transformer   TransformerDecoderModelSpec.from_config  ->  ctranslate2.Generator
                             (prompt: source pieces, "</s>", "<sep>", "<s>"; stop at "</s>")
    classify, transformer    TransformerEncoderModelSpec(TransformerEncoderSpec)  ->  ctranslate2.Encoder
    mlm, transformer         (the encoder stack only, as CTranslate2's BERT converter builds it: the heads
                             are not written; qkv's CTranslate2 engine, :mod:`qkv.engines`, runs them in
                             torch on its last hidden states)

What carries over, and how:

* token embeddings × √d_model: CTranslate2's ``scale_embeddings`` (on by default; off for a model with
  ``scale_embeddings = false``, an imported GPT-2);
* positions: qkv's table itself. Sinusoidal positions interleave sin and cos per dimension pair
  (``PE[:, 2i] = sin``, ``PE[:, 2i+1] = cos``, :func:`qkv.nn.positional.sinusoidal_table`), where
  CTranslate2's built-in table puts sin in the first half and cos in the second, so the exact
  table is written (:data:`POSITIONS` rows, positions 0 .. POSITIONS-1); learned positions are
  their own table (``max_positions`` rows, from row ``position_offset``: BART's 2). Positions start at 0
  on both sides, as in qkv; a LayerNorm on each stack's embeddings (``embedding_norm``, BART's) is
  CTranslate2's ``layernorm_embedding``;
* post-norm (the paper) or pre-norm with the final LayerNorm of each stack; LayerNorm ε = 1e-5
  (torch's default, which qkv uses; CTranslate2's own default is 1e-6);
* attention: qkv's fused ``in_proj = [W^Q; W^K; W^V]`` is CTranslate2's fused self-attention
  ``linear[0]``; cross-attention splits it into the query ``linear[0]`` and the fused key/value
  ``linear[1]``; ReLU feed-forward (SWISH for ``activation = "silu"``, an imported Marian model's;
  GELU and GELUTanh for ``gelu`` and ``gelu_tanh``, an imported GPT-2's); LayerNorm ε as the model's;
* the output projection (tied to the target embedding, or its own matrix), no bias (an imported Marian
  model's ``output_bias``: that bias) but -1e4 on
  the special tokens qkv's decoders never emit (:func:`qkv.decoding.banned_ids`: PAD, UNK, BOS,
  and ``<cls>``, ``[MASK]``, ``<sep>`` where the tokenizer has them); with this bias CTranslate2
  never emits them either, whatever options it is called with. The other logits are unchanged;
  CTranslate2's log-probabilities are normalised over the other tokens (qkv's are not: a beam score
  differs by the sum of log(1 - p(special)) over its tokens, which may keep another hypothesis in
  CTranslate2's beam than in qkv's, so beam outputs agree mostly, not always: :data:`BEAM_NOTE`);
* the family switches (:func:`family_options`, as CTranslate2's own Llama and T5 converters fill its
  specs): rotary positions as ``rotary_dim = 0, rotary_interleave = False, rotary_base = rope_theta``
  (qkv's rotate-half RoPE; decoder-only models), RMSNorm (``rms_norm``), the gated FFN (``ffn_glu``:
  W_1 is ``linear_0``, the activated one, W_3 ``linear_0_noact``), grouped-query attention
  (``num_heads_kv``; decoder-only models), absent biases left out, ``attention_scale = false`` as
  ``queries_scale = 1``; what the specs cannot hold is refused by field (:func:`family_refusals`);
* the source ends with EOS (``add_source_eos``), the decoder starts from BOS ``<s>``
  (``decoder_start_token``), as ``qkv.data.batching.collate`` and qkv's decoders do;
* the vocabularies: the SentencePiece pieces in the order of their ids, so CTranslate2's token
  ids are qkv's; the SentencePiece models themselves are copied into the model directory. An
  imported model's Hugging Face tokenizer (GPT-2's byte-level BPE) is copied as its
  ``tokenizer.json`` (an imported translation model's, BART's or T5's, serves source and target): its
  tokens are the vocabulary's strings (a row qkv adds for a special role has a name of its own,
  :func:`pieces`), so CTranslate2 reads what ``tokenizers`` writes; the pieces a text has around its
  own (BART's ``<s>`` before, BERT's ``[SEP]`` after) are in qkv_export.json (``around_text``) and the card.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qkv.config import BOS, CLS, EOS, PAD, SEP, UNK
from qkv.decoding.greedy import banned_ids
from qkv.errors import QkvError
from qkv.export.source import Source, checkpoint_name
from qkv.nn.positional import sinusoidal_table

POSITIONS = 2048  # rows of the sinusoidal table written (CTranslate2 refuses positions beyond its table)
NEVER_EMITTED = -1e4  # output bias on the special tokens qkv never emits
# encoder-only models: the encoder stack only (its last hidden states); the heads (pooler, classifier, masked-LM
# head) are not written (the engines, qkv.engines, run them in torch on CTranslate2's states)
ENCODERS = {("classify", "transformer"): "Encoder", ("mlm", "transformer"): "Encoder"}
SUPPORTED = {("translate", "transformer"): "Translator", ("lm", "transformer"): "Generator",
             ("prefix_lm", "transformer"): "Generator", **ENCODERS}
ENCODER_SPM = "source.spm"
SPM_FILES = {"src": "source.spm", "tgt": "target.spm"}  # translation; a language model has one: spm.model
LM_SPM = "spm.model"
HF_TOKENIZER = "tokenizer.json"  # a language model whose tokenizer is Hugging Face's (an imported GPT-2)


def _require():
    """The ctranslate2 package, imported now (it is an optional dependency)."""
    from qkv.export.optional import require

    return require("ctranslate2", "--format ctranslate2")


def check(src: Source) -> None:
    """Every (task, arch) pair in :data:`SUPPORTED` converts (encoder-only models included), unless a family
    switch it does not write is on (:func:`family_refusals`); other pairs are refused by name."""
    if src.key not in SUPPORTED:
        kinds = ", ".join(f"{t} ({a})" for t, a in SUPPORTED)
        raise QkvError(f"{src.path} is a {src.task!r} model with arch {src.model.arch!r}: --format ctranslate2 "
                       f"converts these Transformer models: {kinds}")
    refused = family_refusals(src)
    if refused:
        raise QkvError(f"{src.path} has " + "; ".join(f"{field}: --format ctranslate2 does not write {why}"
                                                      for field, why in refused))


def family_refusals(src: Source) -> list[tuple[str, str]]:
    """The family switches (:mod:`qkv.config`'s "family switches") this converter does not write, as
    ``(field = value, what)`` pairs; empty when the model converts. A decoder-only model takes rotary
    positions (rotate-half, any θ), RMSNorm, the gated FFN, grouped-query attention, every bias switch and
    attention_scale (CTranslate2's TransformerDecoderModelSpec, as its own Llama converter fills it); a
    translation model (TransformerSpec) all of these but rotary positions and grouped-query attention."""
    cfg = src.model
    out = []
    if cfg.positional == "relative" and src.task != "translate":
        out.append(("positional = 'relative'", "relative position buckets (T5's) in a decoder-only model "
                    "(CTranslate2's TransformerDecoderModelSpec has none)"))
    if cfg.positional == "rotary" and src.task == "translate":
        out.append(("positional = 'rotary'", "rotary positions in an encoder-decoder (CTranslate2's TransformerSpec "
                    "has none)"))
    if src.task == "translate" and cfg.n_kv_heads not in (0, cfg.n_heads):
        out.append((f"n_kv_heads = {cfg.n_kv_heads}", "grouped-query attention in an encoder-decoder (CTranslate2's "
                    "TransformerSpec has none)"))
    if is_encoder(src) and cfg.embedding_dim:
        out.append((f"embedding_dim = {cfg.embedding_dim}", "embeddings narrower than d_model and their projection "
                    "(ALBERT's, ELECTRA-small's: CTranslate2's TransformerEncoderSpec has no projection)"))
    if is_encoder(src) and cfg.layer_groups:
        out.append((f"layer_groups = {cfg.layer_groups}", "layers that share weights (ALBERT's)"))
    if is_encoder(src):  # the engines' encoder spec is BERT's: the paper's positions, norms, FFN and attention
        paper = {"positional": ("sinusoidal", "learned", "none"), "norm": ("layernorm",), "ffn_gated": (False,),
                 "attention_scale": (True,), "n_kv_heads": (0, cfg.n_heads)}
        for field, allowed in paper.items():
            if getattr(cfg, field) not in allowed:
                out.append((f"{field} = {getattr(cfg, field)!r}", "this switch in an encoder-only model (the encoder "
                            "spec is BERT's)"))
    if cfg.norm == "rmsnorm" and cfg.norm_bias:
        out.append(("norm = 'rmsnorm' with norm_bias = true", "a bias on RMSNorm (CTranslate2's RMSNorm has a gain "
                    "only)"))
    return out


def family_options(src: Source) -> dict:
    """The ``from_config`` arguments of the family switches (the paper's values give CTranslate2's defaults)."""
    cfg = src.model
    options = {"ffn_glu": cfg.ffn_gated, "rms_norm": cfg.norm == "rmsnorm"}
    if src.task == "translate" and cfg.positional == "relative":
        options["relative_attention_bias"] = True
    if src.task != "translate":
        if cfg.positional == "rotary":  # rotate-half over all of d_k (rotary_dim 0), as qkv.nn.rotary
            options.update(rotary_dim=0, rotary_interleave=False, rotary_base=cfg.rope_theta)
        if cfg.n_kv_heads not in (0, cfg.n_heads):
            options["num_heads_kv"] = cfg.n_kv_heads
    return options


def _set_relative(stack, src: Source, name: str) -> None:
    """T5's relative position bias: the stack's table ``(buckets, heads)`` in every self-attention (one
    array, as CTranslate2's T5 converter shares the first layer's), bidirectional in the encoder."""
    table = _np(src.w(name))
    for layer in stack.layer:
        layer.self_attention.relative_attention_bias = table
        layer.self_attention.relative_attention_max_distance = np.dtype("int32").type(src.model.relative_max_distance)


def _set_attention_scale(spec, src: Source) -> None:
    """attention_scale = false (T5's attention): CTranslate2's queries_scale 1 instead of 1/sqrt(d_k)."""
    if src.model.attention_scale:
        return
    for stack in (getattr(spec, "encoder", None), spec.decoder):
        for layer in getattr(stack, "layer", []):
            for name in ("self_attention", "attention"):
                if hasattr(layer, name):
                    getattr(layer, name).queries_scale = np.float32(1.0)


def is_encoder(src: Source) -> bool:
    return src.key in ENCODERS


def pieces(tokenizer) -> list[str]:
    """The vocabulary CTranslate2 is given, in qkv's id order: each piece's string, so that CTranslate2's token ids
    are qkv's. CTranslate2 looks a token up by its string, so the strings must differ: a row qkv adds for one of
    its special roles (:class:`qkv.data.pretrained.IdMap`: an imported BART's BOS, a copy of ``</s>`` written
    ``<s>``; an imported T5's PAD, written ``<pad>``) whose name is also one of the model's own tokens is
    written ``<qkv-ROLE>`` (``<qkv-bos>``, ``<qkv-pad>``), so the model's token keeps its name."""
    from qkv.data.pretrained import SLOT_NAMES

    table = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    ids = getattr(tokenizer, "ids", None)  # an imported model's IdMap: which rows qkv added
    if ids is None or len(set(table)) == len(table):
        return table
    added = {i for i, m in enumerate(ids.model_ids) if m is None}
    own = {p for i, p in enumerate(table) if i not in added}
    for i in sorted(added):
        if table[i] in own:
            table[i] = f"<qkv-{SLOT_NAMES.get(i, i)}>"
    if len(set(table)) != len(table):
        twice = next(p for p in table if table.count(p) > 1)
        raise QkvError(f"the tokenizer has two tokens written {twice!r}: CTranslate2 looks tokens up by their "
                       "strings and cannot tell them apart")
    return table


# --- the converter ---------------------------------------------------------------------------------

def converter_class():
    """:class:`QkvConverter`, defined once ctranslate2 is importable (it subclasses its Converter)."""
    global _CONVERTER
    ctranslate2 = _require()  # every time: a missing package is named, even after an earlier export
    if _CONVERTER is None:
        from ctranslate2.converters.converter import Converter

        class QkvConverter(Converter):
            """Converts a qkv checkpoint (see :mod:`qkv.export.ct2`)."""

            def __init__(self, source: Source):
                self.source = source

            def _load(self):
                return model_spec(self.source)

        QkvConverter.ctranslate2_version = ctranslate2.__version__
        _CONVERTER = QkvConverter
    return _CONVERTER


_CONVERTER = None


def model_spec(src: Source):
    """The filled ``ModelSpec`` of ``src``: weights, configuration, vocabularies, SentencePiece files."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = src.model
    relu = {"relu": common_spec.Activation.RELU, "silu": common_spec.Activation.SWISH,
            "gelu": common_spec.Activation.GELU, "gelu_tanh": common_spec.Activation.GELUTanh}[cfg.activation]
    if is_encoder(src):
        return encoder_spec(src, relu)
    if src.task == "translate":
        spec = transformer_spec.TransformerSpec.from_config(
            (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.norm_first, activation=relu,
            alignment_heads=0, layernorm_embedding=cfg.embedding_norm,
            **family_options(src))  # return_attention: the last layer's mean over all heads, as qkv's alignments
        _set_encoder(spec.encoder, src)
        _set_decoder(spec.decoder, src, "decoder_layers", "tgt_embed.weight", "tgt_pos.weight", "decoder_norm")
        spec.register_source_vocabulary(pieces(src.tokenizer("src")))
        spec.register_target_vocabulary(pieces(src.tokenizer("tgt")))
        spec.config.decoder_start_token = pieces(src.tokenizer("tgt"))[BOS]
        spec.config.add_source_eos = True
    else:
        spec = transformer_spec.TransformerDecoderModelSpec.from_config(
            cfg.n_decoder_layers, cfg.n_heads, pre_norm=cfg.norm_first, activation=relu, **family_options(src))
        _set_decoder(spec.decoder, src, "layers", "embed.weight", "pos.weight", "final_norm", self_only=True)
        spec.register_vocabulary(pieces(src.tokenizer("tgt")))
    vocab = pieces(src.tokenizer("tgt"))
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = vocab[UNK], vocab[BOS], vocab[EOS]
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    _set_attention_scale(spec, src)
    if src.task == "translate" and cfg.positional == "relative":
        _set_relative(spec.encoder, src, "src_pos.weight")
        _set_relative(spec.decoder, src, "tgt_pos.weight")
    return spec


def encoder_spec(src: Source, activation):
    """An encoder-only model as CTranslate2's BERT converter builds it (``TransformerEncoderSpec`` in a
    ``TransformerEncoderModelSpec``, no pooling layer): embeddings (scaled or not), positions, the
    embedding LayerNorm (an imported BERT's), post- or pre-norm layers. The token-type table (an
    imported BERT's, every token of segment 0) is folded into the position table: row 0 added to
    every position, as qkv's stack adds it, so CTranslate2 needs no token-type input."""
    from ctranslate2.specs import transformer_spec

    cfg = src.model
    enc = transformer_spec.TransformerEncoderSpec(cfg.n_encoder_layers, cfg.n_heads, pre_norm=cfg.norm_first,
                                                  activation=activation, layernorm_embedding=cfg.embedding_norm)
    spec = transformer_spec.TransformerEncoderModelSpec(enc)
    _set_encoder(spec.encoder, src, embed_norm="embed_norm")  # the encoder-only model's own name
    if src.has("src_types.weight"):
        spec.encoder.position_encodings.encodings = (spec.encoder.position_encodings.encodings
                                                     + _np(src.w("src_types.weight"))[0][None, :])
    spec.register_vocabulary(pieces(src.tokenizer("src")))
    spec.config.unk_token = pieces(src.tokenizer("src"))[UNK]
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    return spec


def _np(t: torch.Tensor) -> np.ndarray:
    """A copy: CTranslate2's quantization may rewrite the arrays it is given, and the checkpoint's
    tensors are still needed (the reference of :func:`verify`)."""
    return np.array(t.numpy(), dtype=np.float32, order="C", copy=True)


def _linear(spec, src: Source, name: str) -> None:
    spec.weight = _np(src.w(name + ".weight"))
    if src.has(name + ".bias"):  # qkv_bias / out_bias / ffn_bias false: no bias (CTranslate2's is optional)
        spec.bias = _np(src.w(name + ".bias"))


def _layer_norm(spec, src: Source, name: str) -> None:
    spec.gamma = _np(src.w(name + ".weight"))
    if hasattr(spec, "beta"):  # RMSNorm has a gain only
        spec.beta = _np(src.w(name + ".bias")) if src.has(name + ".bias") else np.zeros_like(spec.gamma)


def _positions(src: Source, learned_name: str) -> np.ndarray:
    if src.model.positional == "learned":  # from row position_offset (BART's 2), where position 0 is read
        return _np(src.w(learned_name)[src.model.position_offset:])
    if src.model.positional == "none":  # a table of zeros: the same sums as no positions
        return np.zeros((max(POSITIONS, src.model.max_positions), src.model.d_model), dtype=np.float32)
    return _np(sinusoidal_table(max(POSITIONS, src.model.max_positions), src.model.d_model, src.model.sinusoid_layout))


def _self_attention(spec, src: Source, prefix: str, norm: str) -> None:
    _linear(spec.linear[0], src, prefix + ".in_proj")  # fused [W^Q; W^K; W^V]
    _linear(spec.linear[1], src, prefix + ".out_proj")
    _layer_norm(spec.layer_norm, src, norm)


def _cross_attention(spec, src: Source, prefix: str, norm: str) -> None:
    d = src.model.d_model
    w = src.w(prefix + ".in_proj.weight")
    spec.linear[0].weight, spec.linear[1].weight = _np(w[:d]), _np(w[d:])  # W^Q, fused [W^K; W^V]
    if src.has(prefix + ".in_proj.bias"):
        b = src.w(prefix + ".in_proj.bias")
        spec.linear[0].bias, spec.linear[1].bias = _np(b[:d]), _np(b[d:])
    _linear(spec.linear[2], src, prefix + ".out_proj")
    _layer_norm(spec.layer_norm, src, norm)


def _ffn(spec, src: Source, prefix: str) -> None:
    _linear(spec.linear_0, src, prefix + ".ffn.w_1")  # gated: the activated W_1, ...
    if src.model.ffn_gated:
        _linear(spec.linear_0_noact, src, prefix + ".ffn.w_3")  # ... times x W_3
    _linear(spec.linear_1, src, prefix + ".ffn.w_2")
    _layer_norm(spec.layer_norm, src, prefix + ".res_ffn.norm")


def _set_encoder(spec, src: Source, embed_norm: str = "src_embed_norm") -> None:
    """The encoder stack; ``embed_norm``: the model's name of its embedding LayerNorm (the encoder-decoder's
    ``src_embed_norm``, BART's; the encoder-only model's ``embed_norm``, BERT's)."""
    spec.embeddings[0].weight = _np(src.w("src_embed.weight"))
    spec.scale_embeddings = src.model.scale_embeddings
    if src.model.positional not in ("rotary", "relative"):  # (those add nothing to the embeddings)
        spec.position_encodings.encodings = _positions(src, "src_pos.weight")
    if src.model.embedding_norm:  # CTranslate2's layernorm_embedding
        _layer_norm(spec.layernorm_embedding, src, embed_norm)
    for i, layer in enumerate(spec.layer):
        p = f"encoder_layers.{i}"
        _self_attention(layer.self_attention, src, p + ".self_attn", p + ".res_attn.norm")
        _ffn(layer.ffn, src, p)
    if src.model.norm_first:
        _layer_norm(spec.layer_norm, src, "encoder_norm")


def _set_decoder(spec, src: Source, layers: str, embed: str, pos: str, final_norm: str, self_only: bool = False) -> None:
    spec.embeddings.weight = _np(src.w(embed))
    spec.scale_embeddings = src.model.scale_embeddings
    if src.model.positional not in ("rotary", "relative"):
        spec.position_encodings.encodings = _positions(src, pos)
    if src.model.embedding_norm and not self_only:
        _layer_norm(spec.layernorm_embedding, src, "tgt_embed_norm")
    output = src.w("output_proj.weight") if src.has("output_proj.weight") else src.w(embed)
    spec.projection.weight = _np(output)  # tied: the same array as the embedding, which CTranslate2 aliases
    bias = _np(src.w("output_bias")) if src.has("output_bias") else np.zeros(output.shape[0], dtype=np.float32)
    bias[list(banned_ids(src.tokenizers.tgt))] = NEVER_EMITTED  # (Marian's final_logits_bias on the others)
    spec.projection.bias = bias
    for i, layer in enumerate(spec.layer):
        p = f"{layers}.{i}"
        if self_only:  # a decoder-only layer: qkv's CausalLayer, the encoder layer's sublayer names
            _self_attention(layer.self_attention, src, p + ".self_attn", p + ".res_attn.norm")
        else:
            _self_attention(layer.self_attention, src, p + ".self_attn", p + ".res_self.norm")
            _cross_attention(layer.attention, src, p + ".cross_attn", p + ".res_cross.norm")
        _ffn(layer.ffn, src, p)
    if src.model.norm_first:
        _layer_norm(spec.layer_norm, src, final_norm)


# --- writing -----------------------------------------------------------------------------------------

def write(src: Source, out: Path, quantization: str | None = None) -> dict:
    """Convert ``src`` into the empty directory ``out``; returns the description written to
    ``out/qkv_export.json`` (how to tokenize, decode and what was checked)."""
    from qkv.export.formats import QUANTIZATIONS

    if quantization not in (None, *QUANTIZATIONS):
        raise QkvError(f"--quantization {quantization}: choose one of {', '.join(QUANTIZATIONS)}")
    converter = converter_class()(src)
    converter.convert(str(out), quantization=quantization, force=True)
    spm = _write_tokenizers(src, out)
    if is_encoder(src):
        check = verify_encoder(src, out, quantization)
        info = describe_encoder(src, spm, quantization, check, converter.ctranslate2_version)
    else:
        check = verify(src, out, quantization)
        info = describe(src, spm, quantization, check, converter.ctranslate2_version)
    info["files"] = sorted([*(p.name for p in out.iterdir()), "qkv_export.json", "README.md"])
    return info


def _write_tokenizers(src: Source, out: Path) -> dict[str, str]:
    """The SentencePiece models, byte for byte: source.spm and target.spm (translation; the same model
    twice when the vocabulary is joint) or spm.model (a language model)."""
    if is_encoder(src):
        if hf_tokenizer(src, "src"):
            (out / HF_TOKENIZER).write_bytes(src.tokenizer("src").tokenizer_json)
            return {"src": HF_TOKENIZER}
        (out / ENCODER_SPM).write_bytes(src.tokenizer("src").model_bytes)
        return {"src": ENCODER_SPM}
    if src.task == "translate" and hf_tokenizer(src):  # one vocabulary (an imported BART's, T5's): source and target
        (out / HF_TOKENIZER).write_bytes(src.tokenizer("src").tokenizer_json)
        return {"src": HF_TOKENIZER, "tgt": HF_TOKENIZER}
    if src.task == "translate":
        for side, name in SPM_FILES.items():
            (out / name).write_bytes(src.tokenizer(side).model_bytes)
        return dict(SPM_FILES)
    if hf_tokenizer(src):
        (out / HF_TOKENIZER).write_bytes(src.tokenizer("tgt").tokenizer_json)
        return {"tgt": HF_TOKENIZER}
    (out / LM_SPM).write_bytes(src.tokenizer("tgt").model_bytes)
    return {"tgt": LM_SPM}


def hf_tokenizer(src: Source, side: str = "tgt") -> bool:
    """Whether the model's tokenizer is a Hugging Face tokenizer.json (an imported GPT-2's or BERT's), not
    SentencePiece."""
    from qkv.data.pretrained import HFTokenizer

    return isinstance(src.tokenizer(side), HFTokenizer)


def joined(before: list[str], expr: str, after: list[str]) -> str:
    """``before + expr + after`` as code (the card's and qkv_export.json's), leaving out an empty list."""
    return " + ".join([*([repr(before)] if before else []), expr, *([repr(after)] if after else [])])


def affixes(src: Source, side: str = "src") -> tuple[list[str], list[str]]:
    """The pieces a Hugging Face tokenizer's model puts before and after a text's own tokens, as qkv reads a
    text (an imported BART's ``<s>`` before; an imported BERT's ``[SEP]`` after), in the export's vocabulary."""
    tok, vocab = src.tokenizer(side), pieces(src.tokenizer(side))
    return [vocab[i] for i in getattr(tok, "prefix", [])], [vocab[i] for i in getattr(tok, "suffix", [])]


def describe(src: Source, spm: dict[str, str], quantization: str | None, check: dict, version: str) -> dict:
    """What a user of the directory needs, as data: the files, the tokenization, the decoding settings."""
    vocab = pieces(src.tokenizer("tgt"))
    cfg, dec = src.model, src.decode
    positions = cfg.max_positions if cfg.positional == "learned" else max(POSITIONS, cfg.max_positions)
    info = {
        "format": "ctranslate2",
        "ctranslate2_version": version,
        "qkv_version": src.qkv_version,
        "checkpoint": checkpoint_name(src.path),
        "task": src.task,
        "runtime": f"ctranslate2.{SUPPORTED[src.key]}",
        "quantization": quantization or "float32",
        "model": {k: getattr(cfg, k) for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                                               "norm_first", "positional", "share_embeddings", "tie_output")},
        "positions": positions,
        **({"tokenizer_json": spm} if hf_tokenizer(src) else {"sentencepiece": spm}),
        "special_tokens": {"pad": vocab[PAD], "unk": vocab[UNK], "bos": vocab[BOS], "eos": vocab[EOS]},
        "special_ids": {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS},
        "never_emitted": [vocab[i] for i in banned_ids(src.tokenizers.tgt)],
        "verified": check,
    }
    if src.task == "translate" and hf_tokenizer(src):
        before, after = affixes(src)
        info["tokenize"] = ("tok = tokenizers.Tokenizer.from_file('tokenizer.json'); pieces = "
                            + joined(before, "tok.encode(text, add_special_tokens=False).tokens", after)
                            + f"; the model appends "
                            f"{vocab[EOS]!r} to the source itself (add_source_eos) and starts the target from "
                            f"{vocab[BOS]!r} (the model's decoder start)")
        info["detokenize"] = ("tok.decode([tok.token_to_id(p) for p in hypothesis_pieces], skip_special_tokens=True)")
        info["around_text"] = {"before": before, "after": after}  # the pieces a source has around its text's
    elif src.task == "translate":
        info["tokenize"] = ("pieces = sentencepiece.SentencePieceProcessor(model_file='source.spm').encode(text, "
                            "out_type=str); the model appends </s> to the source itself (add_source_eos) and starts "
                            "the target from <s>")
        info["detokenize"] = "sentencepiece.SentencePieceProcessor(model_file='target.spm').decode(hypothesis_pieces)"
    if src.task == "translate":
        info["decode"] = {
            "qkv": {"beam_size": dec.beam_size, "length_penalty": dec.length_penalty, "length_norm": dec.length_norm,
                    "max_len_a": dec.max_len_a, "max_len_b": dec.max_len_b, "min_len": dec.min_len},
            "ctranslate2": {"beam_size": dec.beam_size, "length_penalty": dec.length_penalty,
                            "min_decoding_length": dec.min_len,  # CTranslate2's default is 1
                            "max_decoding_length": f"{dec.max_len_a:g} * len(source pieces + </s>) + {dec.max_len_b} "
                                                   "(per sentence; CTranslate2's own default is 256)",
                            "max_input_length": positions},  # counts the </s> it appends: qkv's cut exactly
            "differences": _differences(dec),
        }
    elif hf_tokenizer(src):
        info["tokenize"] = ("tok = tokenizers.Tokenizer.from_file('tokenizer.json'); pieces = tok.encode(line, "
                            f"add_special_tokens=False).tokens; lines of a prompt are joined by {vocab[EOS]!r} "
                            f"(the training stream ends each line with it); an empty prompt is [{vocab[BOS]!r}]")
        info["detokenize"] = (f"tok.decode([tok.token_to_id(p) for p in pieces]); {vocab[EOS]!r} ends a line")
    else:
        info["tokenize"] = ("pieces = sentencepiece.SentencePieceProcessor(model_file='spm.model').encode(line, "
                            "out_type=str); lines of a prompt are joined by '</s>' (the training stream ends each "
                            "line with </s>); an empty prompt is ['<s>']")
        info["detokenize"] = "sentencepiece.SentencePieceProcessor(model_file='spm.model').decode(pieces); '</s>' ends a line"
        if src.task == "prefix_lm":
            info["prompt"] = ["<source pieces>", vocab[EOS], vocab[SEP], vocab[BOS]]
            info["tokenize"] = ("prompt = sp.encode(source, out_type=str) + ['</s>', '<sep>', '<s>'] (what qkv's decoder "
                                "reads before the first target token); generate with end_token='</s>'")
    return info


def _differences(dec) -> list[str]:
    notes = ["source length: qkv reads any length with sinusoidal positions and cuts a source to max_positions "
             "tokens with </s> with learned ones; CTranslate2 cuts at max_input_length (default 1024; this model's "
             "position table allows decoding.ctranslate2.max_input_length, which with learned positions is qkv's cut)",
             "CTranslate2 has one max_decoding_length per call where qkv gives each sentence "
             "max_len_a * source length + max_len_b tokens: pass that per call (or per sentence) to get qkv's outputs "
             "for sentences that reach the limit"]
    if dec.beam_size > 1:
        if dec.length_norm == "gnmt":
            notes.append(f"beam search: CTranslate2 divides a hypothesis' log-probability by |Y|^{dec.length_penalty:g} "
                         f"(length_penalty), qkv by ((5 + |Y|) / 6)^{dec.length_penalty:g} (length_norm gnmt): "
                         "beam outputs may differ where hypotheses of different lengths compete")
        else:
            notes.append("beam search: both divide the log-probability by |Y|^length_penalty (length_norm length)")
        notes.append(BEAM_NOTE)
    return notes


BEAM_NOTE = ("beam search: CTranslate2 ends a sentence's search as soon as beam_size hypotheses have finished, "
             "qkv's --early-stopping rule (qkv's default searches on while a live hypothesis can still win); with "
             "min_decoding_length = qkv's min_len (CTranslate2's default, 1, forbids the empty output qkv allows) "
             "its beam outputs are mostly, not always, qkv's with --length-norm length --early-stopping: it ranks "
             "hypotheses by log-probabilities renormalised over the tokens qkv never emits (qkv's are the model's "
             "own), which can keep another hypothesis in the beam, and one that reaches max_decoding_length ends "
             "there without </s> (qkv's ends with </s>, its log-probability counted); greedy outputs are qkv's")


def describe_encoder(src: Source, spm: dict[str, str], quantization: str | None, check: dict, version: str) -> dict:
    """An encoder's description: its files, how a text becomes the pieces qkv's encoder reads, what was checked."""
    cfg = src.model
    vocab = pieces(src.tokenizer("src"))
    embedding = encoder_embedding(src)
    if hf_tokenizer(src, "src"):
        before, after = affixes(src)
        text = (f"tok = tokenizers.Tokenizer.from_file('tokenizer.json'); pieces = {[vocab[CLS]] + before!r} + "
                "tok.encode(text, add_special_tokens=False).tokens" + (f" + {after!r}" if after else ""))
    else:
        after = []
        text = (f"pieces = [{vocab[CLS]!r}] + sentencepiece.SentencePieceProcessor(model_file='{ENCODER_SPM}')"
                ".encode(text, out_type=str)")
    return {
        "format": "ctranslate2", "ctranslate2_version": version, "qkv_version": src.qkv_version,
        "checkpoint": checkpoint_name(src.path), "task": src.task, "runtime": "ctranslate2.Encoder",
        "quantization": quantization or "float32",
        "model": {k: getattr(cfg, k) for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "norm_first",
                                               "positional", "embedding_norm")},
        **({"tokenizer_json": spm} if hf_tokenizer(src, "src") else {"sentencepiece": spm}),
        "tokenize": f"{text}; at most {embedding['max_pieces']} pieces after the first (qkv keeps a longer text's "
                    f"first ones{' and ' + repr(after) + ' last' if after else ''}); "
                    "forward_batch([pieces, ...]).last_hidden_state (batch, longest, d_model): a row's states past "
                    "its own length are padding",
        **({"around_text": {"before": [vocab[CLS]] + before, "after": after}} if hf_tokenizer(src, "src") else {}),
        "embedding": embedding,
        "not_written": "the heads (pooler, classifier, masked-LM head): the export holds the encoder stack",
        "verified": check,
    }


def encoder_embedding(src: Source) -> dict:
    """How ``qkv embed`` makes a sentence vector of the states: its pooling (the <cls> state or the mean over the
    text's pieces, <cls> included), L2-normalised or not, and the pieces it reads at most."""
    sentence = src.config.get("sentence_embedding") or {}
    task_pooling = src.model.pooling if src.task == "classify" else "mean"
    max_pieces = min(src.train.max_len, src.model.max_positions - 1)
    return {"pooling": sentence.get("pooling") or task_pooling, "normalize": bool(sentence.get("normalize")),
            "max_pieces": max_pieces}


def verify_encoder(src: Source, out: Path, quantization: str | None) -> dict:
    """The last hidden states of fixed probe sequences (``<cls>`` + ordinary pieces, padded against each
    other) from ``ctranslate2.Encoder`` and from the checkpoint's network in PyTorch: equal to
    :data:`ENCODER_TOLERANCE` (float32; quantized models: reported, not checked)."""
    import ctranslate2

    from qkv.export.reference import FIRST_ORDINARY, reference_model

    g = torch.Generator().manual_seed(0)
    vocab = src.model.src_vocab_size
    rows = [[CLS, *torch.randint(min(FIRST_ORDINARY, vocab - 1), vocab, (n,), generator=g).tolist()]
            for n, _ in PROBE_ENCODER]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    with torch.inference_mode():
        ref = reference_model(src).encode(tokens)[0].double()  # (B, T, d)
    model = ctranslate2.Encoder(str(out), device="cpu", intra_threads=1)
    got = torch.from_numpy(np.array(model.forward_batch(rows).last_hidden_state)).double()
    del model
    delta = max(float((got[i, : len(r)] - ref[i, : len(r)]).abs().max()) for i, r in enumerate(rows))
    if quantization is None and not delta <= ENCODER_TOLERANCE:
        raise QkvError(f"the converted encoder disagrees with {src.path}: max |delta state| = {delta:.3g} on the probe "
                       f"sequences (expected < {ENCODER_TOLERANCE:g}); this checkpoint's layout is not what the "
                       "converter expects")
    return {"probe_sequences": len(rows), "tokens": sum(map(len, rows)), "max_abs_state_difference": delta,
            "checked": quantization is None}


PROBE_ENCODER = ((5, 0), (9, 0), (1, 0))
ENCODER_TOLERANCE = 1e-4  # max |delta state| of a float32 conversion (a tiny BERT's: about 1e-6)  # ordinary pieces after <cls> in each probe sequence


def verify(src: Source, out: Path, quantization: str | None) -> dict:
    """Score the fixed probe sequences with the exported model (``score_batch``) and with the
    checkpoint's own network in PyTorch: the per-token log-probabilities must agree (float32: to
    1e-3; quantized models: reported, not checked). A wrong conversion fails here, not in use."""
    import ctranslate2

    from qkv.export.reference import reference_log_probs, probe_sequences

    sources, targets = probe_sequences(src)
    ref = reference_log_probs(src, sources, targets)  # per sequence, (T + 1,) with EOS
    tgt_pieces = pieces(src.tokenizer("tgt"))
    if src.task == "translate":
        src_pieces = pieces(src.tokenizer("src"))
        model = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
        results = model.score_batch([[src_pieces[i] for i in s] for s in sources],
                                    [[tgt_pieces[i] for i in t] for t in targets])
    else:
        model = ctranslate2.Generator(str(out), device="cpu", intra_threads=1)
        results = model.score_batch([[tgt_pieces[i] for i in (p + t)] for p, t in zip(sources, targets)])
    got = [np.asarray(r.log_probs, dtype=np.float64) for r in results]
    del model
    if [len(g) for g in got] != [len(r) for r in ref]:
        raise QkvError(f"the converted model scores {[len(g) for g in got]} tokens of the probe sequences where "
                       f"{src.path} scores {[len(r) for r in ref]}")
    delta = max(float(np.abs(g - r.numpy()).max()) for g, r in zip(got, ref))
    if quantization is None and not delta <= 1e-3:
        raise QkvError(f"the converted model disagrees with {src.path}: max |delta log p| = {delta:.3g} on the probe "
                       "sequences (expected < 1e-3); this checkpoint's layout is not what the converter expects")
    return {"probe_sequences": len(sources), "tokens": int(sum(len(r) for r in ref)),
            "max_abs_log_prob_difference": delta, "checked": quantization is None}


__all__ = ["check", "is_encoder", "write", "model_spec", "ENCODERS", "converter_class", "SUPPORTED", "POSITIONS",
           "BEAM_NOTE"]
