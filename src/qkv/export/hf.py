"""Hugging Face transformers: a ``MarianMTModel`` directory that ``from_pretrained`` loads without qkv.

MarianMTModel is the paper's Transformer in Hugging Face's layout; set up as below it computes
what qkv's encoder-decoder computes, up to float rounding (every export checks the logits):

    qkv                                   MarianConfig / generation_config
    post-norm residual blocks             Marian's layers (post-norm only: a pre-norm model is refused)
    ReLU feed-forward                     activation_function = "relu"
    embeddings × √d_model                 scale_embedding = True
    sinusoidal positions from 0           static sinusoidal positions from 0, recomputed by Marian
                                          (sin in the first half of the dimensions, cos in the second:
                                          see the permutation below); learned positions are refused
    LayerNorm ε = 1e-5                    torch's default in both
    shared / separate embeddings          share_encoder_decoder_embeddings
    tied / untied output projection       tie_word_embeddings (lm_head), final_logits_bias = 0
    PAD 0, EOS 3; decoder starts from BOS decoder_start_token_id = BOS (2), not Marian's usual PAD
    special tokens never emitted          generation_config.suppress_tokens = banned_ids (PAD, UNK, BOS, ...)
    EOS forced at the length limit        forced_eos_token_id = EOS
    a·|x| + b tokens per source           max_new_tokens: one per call (see length_limit)
    stop when no live hypothesis wins     early_stopping = False (qkv's early_stopping: True)

An imported Marian model (``qkv import`` of an OPUS-MT folder: Marian's tokenizer, ``activation =
"silu"``, ``sinusoid_layout = "halves"``, ``output_bias``) goes back as it came: swish,
final_logits_bias, no permutation (its dimensions are already Marian's), the vocabulary rows in
its vocab.json's order (qkv's BOS row is Marian's ``<pad>``, the decoder's start) and its own
source.spm, target.spm and vocab.json.

The permutation. qkv's positional encoding interleaves sin and cos per dimension pair
(``PE[:, 2i] = sin(pos / 10000^(2i/d))``, ``PE[:, 2i+1] = cos(...)``); Marian's puts
``sin(pos / 10000^(2i/d))`` at dimension ``i`` and the cosine at ``d/2 + i``. So Marian's
dimension ``m`` is qkv's dimension ``order[m]`` with ``order = [0, 2, ..., d-2, 1, 3, ..., d-1]``.
Every vector of the residual stream is reordered the same way, which changes nothing the model
computes: each weight that reads the stream (the query/key/value projections, the first FFN
layer, the output projection) has its input columns permuted, each weight and bias that writes
it (the embeddings, the attention output projection, the second FFN layer) its output rows, and
each LayerNorm its gain and bias (LayerNorm's mean and variance do not depend on the order).
The attention heads' own dimensions are not the residual stream and stay as they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qkv.config import BOS, EOS, PAD, UNK
from qkv.decoding import MAX_OUTPUT_LEN, banned_ids, max_output_len
from qkv.errors import QkvError
from qkv.export.source import Source, checkpoint_name

POSITIONS = 2048  # Marian's max_position_embeddings: the sinusoidal rows it builds (sources and outputs)
LOGIT_TOLERANCE = 1e-4


def check(src: Source) -> None:
    """Refuse, by name, what a MarianMTModel (or an imported model's own class) cannot compute."""
    from qkv.export import hf_families

    found = hf_families.family_of(src)
    if found is not None:
        return hf_families.check(src, *found)
    if hf_families.trained_lm(src):  # a language model qkv trained: none of the classes says all its options
        raise hf_families.trained_refusal(src)
    imported = hf_families.imported_architecture(src)
    if imported is not None and imported != "MarianMTModel":
        raise QkvError(f"{src.path} was imported from a {imported} folder: --format hf writes an import back as "
                       f"its own class ({', '.join(hf_families.written())}) and translation models as MarianMTModel")
    cfg = src.model
    if src.key != ("translate", "transformer"):
        other = " (export it with --format ctranslate2)" if cfg.arch == "transformer" and cfg.task in ("lm", "prefix_lm") \
            else ""
        raise QkvError(f"{src.path} is a {cfg.task!r} model with arch {cfg.arch!r}: --format hf writes a MarianMTModel, "
                       f"an encoder-decoder Transformer for translation (task translate, arch transformer){other}")
    problems = []  # every one named, not the first only
    if cfg.norm_first:
        problems.append("is a pre-norm model (norm_first = true): MarianMTModel's layers are post-norm only, so "
                        "--format hf cannot represent it; use --format ctranslate2, which converts pre-norm models")
    if cfg.positional != "sinusoidal":
        problems.append(f"has positional = {cfg.positional!r}, not sinusoidal: MarianMTModel always adds its static "
                        "sinusoidal positions and keeps no table of its own, so --format hf cannot represent it"
                        + ("; use --format ctranslate2, which converts learned positions and none"
                           if cfg.positional in ("learned", "none") else ""))
    refused = family_refusals(cfg)
    if refused:
        problems.append(f"has {', '.join(refused)}: --format hf does not write these (MarianMTModel has the paper's "
                        "LayerNorm with bias, an FFN of two biased matrices, full multi-head attention with biases "
                        "and the 1/sqrt(d_k) scale)")
    if problems:
        raise QkvError(f"{src.path} " + "; and ".join(problems))


# the family switches (qkv.config) at the paper's values, the only ones a MarianMTModel computes
PAPER_SWITCHES = {"norm": "layernorm", "norm_bias": True, "ffn_gated": False, "ffn_bias": True, "qkv_bias": True,
                  "out_bias": True, "attention_scale": True}


def family_refusals(cfg) -> list[str]:
    """Every family switch of ``cfg`` away from the paper's value, as ``field = value``."""
    out = [f"{k} = {getattr(cfg, k)!r}".replace("True", "true").replace("False", "false")
           for k, paper in PAPER_SWITCHES.items() if getattr(cfg, k) != paper]
    if cfg.n_kv_heads not in (0, cfg.n_heads):
        out.append(f"n_kv_heads = {cfg.n_kv_heads}")
    return out


def marian_order(d_model: int, layout: str = "interleaved") -> torch.Tensor:
    """Marian's dimension m holds qkv's dimension order[m]: the sines (even dims), then the cosines (odd
    dims); a model with Marian's own layout (``sinusoid_layout = "halves"``, an imported one) keeps its order."""
    if layout == "halves":
        return torch.arange(d_model)
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_vocabulary(src: Source) -> torch.Tensor | None:
    """For an imported Marian model (its tokenizer is Marian's own), the qkv id of each Marian id: the
    export puts the rows back in the original vocab.json's order (``<pad>`` last, no BOS row); None for
    a model of qkv's own tokenizer, whose ids are written as they are."""
    from qkv.data.marian_tokenizer import MarianTokenizerPair, marian_index

    if not isinstance(src.tokenizers, MarianTokenizerPair):
        return None
    return torch.tensor(marian_index(src.tokenizers.rows))


def marian_ids(src: Source) -> dict[str, int]:
    """The Marian ids of PAD, UNK, EOS and of the decoder's start (BOS, or an imported model's <pad>)."""
    rows = src.tokenizers.rows if marian_vocabulary(src) is not None else list(range(src.model.tgt_vocab_size))
    return {"pad": rows[PAD], "unk": rows[UNK], "bos": rows[BOS], "eos": rows[EOS]}


def marian_state_dict(src: Source) -> dict[str, torch.Tensor]:
    """qkv's weights under MarianMTModel's names, the residual stream permuted by :func:`marian_order`."""
    d = src.model.d_model
    order = marian_order(d, src.model.sinusoid_layout)
    vocab = marian_vocabulary(src)
    out: dict[str, torch.Tensor] = {}

    def rows(w: torch.Tensor) -> torch.Tensor:  # an embedding or output matrix in Marian's id order
        return w if vocab is None else w[vocab]

    def reads(w: torch.Tensor) -> torch.Tensor:  # (out, d) reads the residual stream: permute its columns
        return w[:, order].contiguous()

    def writes(w: torch.Tensor) -> torch.Tensor:  # (d, ...) or (d,) writes it: permute its rows
        return w[order].contiguous()

    def attention(dst: str, name: str) -> None:
        w, b = src.w(name + ".in_proj.weight"), src.w(name + ".in_proj.bias")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):  # in_proj = [W^Q; W^K; W^V]
            out[f"{dst}.{proj}.weight"] = reads(w[j * d:(j + 1) * d])
            out[f"{dst}.{proj}.bias"] = b[j * d:(j + 1) * d].contiguous()
        out[f"{dst}.out_proj.weight"] = writes(src.w(name + ".out_proj.weight"))
        out[f"{dst}.out_proj.bias"] = writes(src.w(name + ".out_proj.bias"))

    def layer_norm(dst: str, name: str) -> None:
        out[dst + ".weight"] = writes(src.w(name + ".weight"))
        out[dst + ".bias"] = writes(src.w(name + ".bias"))

    def ffn(dst: str, name: str) -> None:
        out[dst + ".fc1.weight"] = reads(src.w(name + ".ffn.w_1.weight"))
        out[dst + ".fc1.bias"] = src.w(name + ".ffn.w_1.bias").contiguous()
        out[dst + ".fc2.weight"] = writes(src.w(name + ".ffn.w_2.weight"))
        out[dst + ".fc2.bias"] = writes(src.w(name + ".ffn.w_2.bias"))
        layer_norm(dst + ".final_layer_norm", name + ".res_ffn.norm")

    for i in range(src.model.n_encoder_layers):
        dst, name = f"model.encoder.layers.{i}", f"encoder_layers.{i}"
        attention(dst + ".self_attn", name + ".self_attn")
        layer_norm(dst + ".self_attn_layer_norm", name + ".res_attn.norm")
        ffn(dst, name)
    for i in range(src.model.n_decoder_layers):
        dst, name = f"model.decoder.layers.{i}", f"decoder_layers.{i}"
        attention(dst + ".self_attn", name + ".self_attn")
        layer_norm(dst + ".self_attn_layer_norm", name + ".res_self.norm")
        attention(dst + ".encoder_attn", name + ".cross_attn")
        layer_norm(dst + ".encoder_attn_layer_norm", name + ".res_cross.norm")
        ffn(dst, name)
    if src.model.share_embeddings:
        out["model.shared.weight"] = reads(rows(src.w("src_embed.weight")))
    else:
        out["model.encoder.embed_tokens.weight"] = reads(rows(src.w("src_embed.weight")))
        out["model.decoder.embed_tokens.weight"] = reads(rows(src.w("tgt_embed.weight")))
    if not src.model.tie_output:
        out["lm_head.weight"] = reads(rows(src.w("output_proj.weight")))
    if src.has("output_bias"):
        out["final_logits_bias"] = rows(src.w("output_bias"))[None].contiguous()
    return out


def marian_config(src: Source):
    from transformers import MarianConfig

    cfg = src.model
    ids = marian_ids(src)
    vocab = cfg.src_vocab_size - (marian_vocabulary(src) is not None)  # an imported model: no BOS row
    return MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab if cfg.share_embeddings else cfg.tgt_vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers, decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function={"relu": "relu", "silu": "swish"}[getattr(cfg, "activation", "relu")],
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=0.0,
        max_position_embeddings=max(POSITIONS, cfg.max_positions), scale_embedding=True,
        pad_token_id=ids["pad"], eos_token_id=ids["eos"], bos_token_id=ids["bos"], decoder_start_token_id=ids["bos"],
        forced_eos_token_id=ids["eos"],
        share_encoder_decoder_embeddings=cfg.share_embeddings, tie_word_embeddings=cfg.tie_output,
        architectures=["MarianMTModel"],
    )


def length_limit(src: Source) -> int:
    """generate()'s ``max_new_tokens``: qkv's limit for the longest source training kept (``max_len``
    tokens), then EOS. generate() has one limit per call where qkv gives each source its own."""
    dec = src.decode
    return int(max_output_len(torch.tensor([src.train.max_len]), dec.max_len_a, dec.max_len_b)[0]) + 1


def generation_config(src: Source):
    """qkv's saved decoding settings, as near as Hugging Face's generate() can say them (see :func:`differences`).

    Stopping: Hugging Face's ``early_stopping=False`` is qkv's rule (a sentence is done when it has
    ``num_beams`` finished hypotheses and the best live one, normalised at its current length, cannot
    beat the worst of them), ``True`` is qkv's ``early_stopping``. ("never" would keep searching
    while a hypothesis of ``max_new_tokens`` tokens could still win: to the limit, for any
    length_penalty > 0.)"""
    from transformers import GenerationConfig

    dec = src.decode
    beam = {"num_beams": dec.beam_size, "length_penalty": dec.length_penalty,
            "early_stopping": dec.early_stopping} if dec.beam_size > 1 else {"num_beams": 1}
    ids = marian_ids(src)
    vocab = marian_vocabulary(src)
    banned = list(banned_ids(src.tokenizers.tgt))
    if vocab is not None:  # Marian's ids of what qkv never emits (its <pad> is qkv's PAD and BOS)
        rows = src.tokenizers.rows
        banned = sorted({rows[i] for i in banned_ids(src.tokenizers.tgt)})
    return GenerationConfig(
        decoder_start_token_id=ids["bos"], bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        forced_eos_token_id=ids["eos"], suppress_tokens=banned, max_new_tokens=length_limit(src),
        num_return_sequences=dec.nbest, **beam,
        **({"min_new_tokens": dec.min_len} if dec.min_len else {}),
    )


def differences(src: Source) -> list[str]:
    """Where generate() with the written generation_config.json can differ from ``qkv translate``."""
    dec = src.decode
    notes = [f"length limit: qkv gives each sentence max_len_a * source tokens (with EOS) + max_len_b = "
             f"{dec.max_len_a:g} * |x| + {dec.max_len_b} output tokens (at most {MAX_OUTPUT_LEN}), then EOS; "
             f"generate() has one limit per call, max_new_tokens, written as {length_limit(src)}: qkv's limit for "
             f"the longest source training kept (max_len = {src.train.max_len} tokens) plus EOS. Pass "
             "max_new_tokens = qkv's limit for the call's longest source + 1 (the card's code does) to match "
             "qkv on a sentence that reaches its limit"]
    if dec.beam_size > 1:
        if dec.length_norm == "gnmt":
            notes.append(f"beam search ranks by log P / |Y|^{dec.length_penalty:g} (Hugging Face's length_penalty), "
                         f"qkv by log P / ((5 + |Y|) / 6)^{dec.length_penalty:g} (length_norm gnmt, the paper's): "
                         "outputs may differ where hypotheses of different lengths compete")
        else:
            notes.append("beam search ranks by log P / |Y|^length_penalty in both (|Y| with EOS)")
        notes.append("early_stopping false is qkv's rule: a sentence's search ends when it has num_beams finished "
                     "hypotheses and the best live one, at its current length, cannot beat them"
                     if not dec.early_stopping else
                     "early_stopping true: both end a sentence's search once num_beams hypotheses have finished")
    return notes


def _write_tokenizer(src: Source, out: Path) -> None:
    """source.spm, target.spm, vocab.json (+ target_vocab.json for separate vocabularies) and
    tokenizer_config.json, written by MarianTokenizer.save_pretrained itself."""
    from transformers import MarianTokenizer

    if marian_vocabulary(src) is not None:  # an imported Marian model: its own files back, as they came
        tok = src.tokenizers
        t = out / ".tokenizer-inputs"
        tok.save(t)
        try:
            MarianTokenizer(str(t / "source.spm"), str(t / "target.spm"), str(t / "vocab.json"),
                            unk_token=tok.specials["unk"], eos_token=tok.specials["eos"], pad_token=tok.specials["pad"],
                            model_max_length=src.model.max_positions).save_pretrained(str(out))
        finally:
            shutil.rmtree(t, ignore_errors=True)
        return
    pieces_src, pieces_tgt = src.vocabulary("src"), src.vocabulary("tgt")
    t = out / ".tokenizer-inputs"  # inside the export's own temporary: never left in a system temp folder
    t.mkdir()
    try:
        (t / "source.spm").write_bytes(src.tokenizer("src").model_bytes)
        (t / "target.spm").write_bytes(src.tokenizer("tgt").model_bytes)
        (t / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces_src)}, ensure_ascii=False))
        separate = not src.tokenizers.joint
        if separate:
            (t / "target_vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces_tgt)}, ensure_ascii=False))
        tok = MarianTokenizer(str(t / "source.spm"), str(t / "target.spm"), str(t / "vocab.json"),
                              target_vocab_file=str(t / "target_vocab.json") if separate else None,
                              separate_vocabs=separate, unk_token=pieces_src[UNK], eos_token=pieces_src[EOS],
                              pad_token=pieces_src[PAD], model_max_length=max(POSITIONS, src.model.max_positions) - 1)
        tok.save_pretrained(str(out))
    finally:
        shutil.rmtree(t, ignore_errors=True)


def write(src: Source, out: Path) -> dict:
    """Write the MarianMTModel directory ``out`` (empty) and check it against the checkpoint."""
    from qkv.export.optional import require

    transformers = require("transformers", "--format hf")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" / "Loading weights" bars on stderr
    try:
        return _write(src, out, transformers.__version__)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _write(src: Source, out: Path, version: str) -> dict:
    from transformers import MarianMTModel

    from qkv.export import hf_families

    found = hf_families.family_of(src)
    if found is not None:  # an imported model: its own family's class
        return hf_families.write(src, out, *found, version)

    torch.manual_seed(0)  # the random init that the checkpoint's weights then replace
    model = MarianMTModel(marian_config(src))
    missing, unexpected = model.load_state_dict(marian_state_dict(src), strict=False)
    computed = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    computed |= set() if src.has("output_bias") else {"final_logits_bias"}
    tied = {"lm_head.weight"} if src.model.tie_output else set()
    tied |= {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"} if src.model.share_embeddings \
        else set()
    if unexpected or set(missing) - computed - tied:
        raise QkvError(f"internal: MarianMTModel names differ (missing {sorted(set(missing) - computed - tied)}, "
                       f"unexpected {sorted(unexpected)})")
    with torch.no_grad():
        if not src.has("output_bias"):
            model.final_logits_bias.zero_()
    model.tie_weights()
    model.generation_config = generation_config(src)
    model.eval()
    model.save_pretrained(str(out))
    _write_tokenizer(src, out)
    check = verify(src, out)
    return {"format": "hf", "transformers_version": version, "qkv_version": src.qkv_version,
            "checkpoint": checkpoint_name(src.path), "task": src.task, "runtime": "transformers.MarianMTModel",
            "dimension_order": "Marian dimension m = qkv dimension order[m], order = [0, 2, ..., d-2, 1, 3, ..., d-1]",
            "verified": check, "differences": differences(src)}


def verify(src: Source, out: Path) -> dict:
    """Load ``out`` as a user would (``from_pretrained``) and compare its teacher-forced logits with
    the checkpoint's own network on a padded batch of probe sequences, and its tokenizer's ids with
    qkv's on a few texts."""
    from transformers import MarianMTModel, MarianTokenizer

    from qkv.data.batching import collate
    from qkv.export.reference import probe_sequences, reference_model, translation_logits

    sources, targets = probe_sequences(src)
    ref = translation_logits(reference_model(src), sources, targets)
    batch = collate(sources, targets)
    hf = MarianMTModel.from_pretrained(str(out)).eval()
    vocab = marian_vocabulary(src)
    to_marian = torch.tensor(src.tokenizers.rows) if vocab is not None else torch.arange(src.model.tgt_vocab_size)
    with torch.inference_mode():
        got = hf(input_ids=to_marian[batch.src], attention_mask=batch.src != PAD,
                 decoder_input_ids=to_marian[batch.tgt_in]).logits.float()[..., to_marian]
    real = torch.zeros_like(batch.tgt_in, dtype=torch.bool)
    for i, t in enumerate(targets):
        real[i, : len(t) + 1] = True  # BOS and the target: the positions that are not padding
    if vocab is not None:  # Marian's <pad> column is BOS's row: PAD's own (never emitted, never read) has none
        keep = torch.tensor([q for q in range(ref.size(-1)) if q != PAD])
        got, ref = got[..., keep], ref[..., keep]
    delta = float((got - ref)[real].abs().max())
    if not delta <= LOGIT_TOLERANCE:
        raise QkvError(f"the exported MarianMTModel disagrees with {src.path}: max |delta logit| = {delta:.3g} "
                       f"(expected < {LOGIT_TOLERANCE:g})")
    tok = MarianTokenizer.from_pretrained(str(out))
    texts = src.tokenizer("src").decode(sources) + ["Hello, world! 123"]
    want = [[int(to_marian[i]) for i in ids + [EOS]] for ids in src.tokenizer("src").encode(texts)]
    got_ids = tok(texts)["input_ids"]
    if got_ids != want:
        raise QkvError(f"the exported tokenizer disagrees with {src.path}'s on {texts!r}: {got_ids} != {want}")
    return {"probe_sequences": len(sources), "positions": int(real.sum()), "max_abs_logit_difference": delta,
            "tokenizer_texts": len(texts)}


__all__ = ["check", "write", "marian_order", "marian_state_dict", "marian_config", "generation_config", "differences",
           "length_limit"]
