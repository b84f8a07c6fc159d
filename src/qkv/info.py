"""Model size and cost: parameter count by component, training FLOPs per target token.

The parameter count covers every model (for a recurrent encoder–decoder the encoder includes
its memory projection, the decoder its bridge and attentional layer W_c); the FLOP formula
below is the Transformer's.

FLOPs count the matrix multiplies (2 FLOPs per multiply-add), as Kaplan et al. (2020) and the
PaLM MFU convention do; layer norms, softmax, biases and the optimizer are left out. For a source
of S tokens and a target of T tokens, one forward pass costs

    encoder, per layer:  2·4d²·S (Q, K, V, O)   + 2·2·d·d_ff·S (FFN)   + 2·2·S²·d (QKᵀ and AV)
    decoder, per layer:
        self-attention   2·4d²·T + 2·2·T²·d
        cross-attention  2·2d²·T (Q, O) + 2·2d²·S (K, V of the memory) + 2·2·T·S·d
        FFN              2·2·d·d_ff·T
    output projection:   2·d·V·T

and training (forward + backward) three times that. With the family switches: grouped-query attention
projects K and V to n_kv·d_k (4d² becomes 2d² + 2·d·n_kv·d_k), a gated FFN has three matrices
(2·2·d·d_ff becomes 2·3·d·d_ff). The count is divided by T to give FLOPs per
target token (the unit of tokens/s in the benchmarks).

The presets' facts (:func:`preset_facts`, :func:`preset_table`) come from ``qkv.config``'s presets;
their measured training time from ``preset_times.json`` beside this module, which
``benchmarks/preset_speed.py`` writes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.config import PRESETS, ModelConfig, preset
from qkv.training.progress import clock

PRESET_TIMES = Path(__file__).with_name("preset_times.json")


def parameter_breakdown(model: nn.Module) -> dict[str, int]:
    """Parameters per component; a shared matrix is counted once, under the first name that holds it."""
    groups = {
        "embeddings (shared)" if getattr(model, "src_embed", None) is getattr(model, "tgt_embed", 1) else "embeddings": 0,
        "positional (learned)": 0,
        "encoder": 0,
        "decoder": 0,
        "output projection (untied)": 0,
    }
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith(("src_embed", "tgt_embed")):
            key = next(k for k in groups if k.startswith("embeddings"))
        elif name.startswith(("src_pos", "tgt_pos")):
            key = "positional (learned)"
        elif name.startswith(("encoder_layers", "encoder_norm", "encoder.", "memory_proj")):
            key = "encoder"
        elif name.startswith(("decoder_layers", "decoder_norm", "decoder.", "bridge_", "combine")):
            key = "decoder"
        elif name.startswith("score."):
            key = "attention score"
            groups.setdefault(key, 0)
        elif name.startswith("output_proj"):
            key = "output projection (untied)"
        else:
            key = "other"
            groups.setdefault(key, 0)
        groups[key] += p.numel()
    out = {k: v for k, v in groups.items() if v}
    out["total"] = sum(out.values())
    return out


def family_switches(cfg: ModelConfig) -> list[str]:
    """The family switches of a Transformer config (``ModelConfig``'s switch fields) that differ from the
    paper's, each named as a flag would set it: what makes this model Llama-, T5- or Qwen2-like."""
    out = []
    if cfg.positional == "rotary":
        out.append(f"rotary positions (RoPE, θ={cfg.rope_theta:g})")
    elif cfg.positional == "relative":
        out.append(f"relative positions (T5 buckets: {cfg.relative_buckets}, max distance {cfg.relative_max_distance})")
    if cfg.norm != "layernorm" or not cfg.norm_bias:
        out.append(f"{'RMSNorm' if cfg.norm == 'rmsnorm' else 'LayerNorm'}{'' if cfg.norm_bias else ' without bias'}")
    if cfg.ffn_gated:
        name = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU (tanh GELU)"}.get(cfg.activation,
                                                                                       f"gated {cfg.activation}")
        out.append(f"gated FFN ({name})")
    if not cfg.ffn_bias:
        out.append("FFN without biases")
    if cfg.kv_heads != cfg.n_heads:
        kind = "multi-query" if cfg.kv_heads == 1 else "grouped-query"
        out.append(f"{kind} attention ({cfg.n_heads} query heads over {cfg.kv_heads} key/value heads)")
    if not cfg.qkv_bias:
        out.append("no Q/K/V biases")
    if not cfg.out_bias:
        out.append("no W^O bias")
    if not cfg.attention_scale:
        out.append("no 1/√d_k (T5)")
    if not cfg.tie_output:
        out.append("untied output projection")
    return out


@dataclass(frozen=True)
class Flops:
    forward: float  # per target token
    training: float  # per target token, forward + backward (3 x forward)


def transformer_flops(cfg: ModelConfig, src_len: int, tgt_len: int, vocab_size: int | None = None) -> Flops:
    """Matmul FLOPs of the encoder–decoder per target token (formula in the module docstring)."""
    d, f, s, t = cfg.d_model, cfg.d_ff, src_len, tgt_len
    v = vocab_size if vocab_size is not None else cfg.tgt_vocab_size
    kv = cfg.kv_heads * cfg.d_k  # the width of K and V (d, but for grouped-query attention)
    ffn = 3 if cfg.ffn_gated else 2  # matrices of the FFN
    enc = cfg.n_encoder_layers * (2 * (2 * d * d + 2 * d * kv) * s + 2 * ffn * d * f * s + 2 * 2 * s * s * d)
    dec_layer = (
        2 * (2 * d * d + 2 * d * kv) * t + 2 * 2 * t * t * d  # masked self-attention
        + 2 * 2 * d * d * t + 2 * 2 * d * kv * s + 2 * 2 * t * s * d  # cross-attention
        + 2 * ffn * d * f * t  # FFN
    )
    dec = cfg.n_decoder_layers * dec_layer
    out = 2 * d * v * t
    forward = (enc + dec + out) / t
    return Flops(forward=forward, training=3 * forward)


# ModelConfig fields that describe a model's size, data or head rather than which Transformer it is
NOT_SWITCHES = frozenset({"task", "arch", "d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                          "dropout", "attention_dropout", "max_positions", "n_classes", "src_vocab_size",
                          "tgt_vocab_size", "rnn_nonlinearity", "bidirectional", "attention", "input_feeding",
                          "pooling", "positional", "norm_first"})
# the switches that family_switches already names in words (positions, norms, FFN, attention)
DESCRIBED = frozenset({"rope_theta", "relative_buckets", "relative_max_distance", "norm", "norm_bias", "ffn_gated",
                       "ffn_bias", "n_kv_heads", "qkv_bias", "out_bias", "attention_scale", "tie_output"})


def switches(cfg: ModelConfig) -> dict:
    """The family switches of a Transformer's config that are not the paper's (ModelConfig's defaults):
    what makes it BERT, RoBERTa, ALBERT, ... rather than the base model (the line above names the
    positions and the norm's place)."""
    paper = ModelConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in NOT_SWITCHES | DESCRIBED and getattr(cfg, f.name) != getattr(paper, f.name)}


def describe(model: nn.Module, src_len: int = 25, tgt_len: int = 25) -> str:
    """What ``qkv info`` prints: the architecture in a line, the parameters by component, and for an
    encoder-decoder Transformer the training FLOPs per target token."""
    from qkv.tasks import get_task

    cfg = model.cfg
    if cfg.is_recurrent:
        lines = [f"{cfg.arch}: hidden={cfg.d_model} layers={cfg.n_encoder_layers}/{cfg.n_decoder_layers} "
                 f"vocab={cfg.src_vocab_size}/{cfg.tgt_vocab_size} "
                 f"{'bidirectional' if cfg.bidirectional else 'unidirectional'} encoder, attention {cfg.attention}"
                 + (", input feeding" if cfg.input_feeding else "")
                 + (f", f={cfg.rnn_nonlinearity}" if cfg.arch == "rnn" else "")]
    else:
        lines = [f"{cfg.arch} ({cfg.task}): d_model={cfg.d_model} h={cfg.n_heads} d_ff={cfg.d_ff} "
                 f"N={cfg.n_encoder_layers}/{cfg.n_decoder_layers} vocab={cfg.src_vocab_size}/{cfg.tgt_vocab_size} "
                 f"{'post' if not cfg.norm_first else 'pre'}-norm, {cfg.positional} positions"]
        described = family_switches(cfg)
        if described:
            lines.append(f"  switches beyond the paper's: {'; '.join(described)}")
        named = switches(cfg)
        if named:
            lines.append("switches (the paper's value otherwise): " + ", ".join(f"{k}={v}" for k, v in named.items()))
    parts = parameter_breakdown(model)
    width = max(len(k) for k in parts)
    lines += [f"  {k:<{width}}  {n:>13,}  ({n / 1e6:.1f}M)" for k, n in parts.items()]
    if cfg.is_recurrent or get_task(cfg.task).stack != "encoder-decoder":
        lines.append(f"(the FLOPs formula is the encoder-decoder Transformer's; not computed for a {cfg.task} "
                     f"{cfg.arch} model)")
    else:
        fl = transformer_flops(cfg, src_len, tgt_len)
        lines.append(f"FLOPs per target token (matmuls, source {src_len} / target {tgt_len} tokens): "
                     f"forward {fl.forward / 1e6:.1f} MFLOP, training (3x) {fl.training / 1e6:.1f} MFLOP")
    return "\n".join(lines)


# --- presets ---------------------------------------------------------------------------------------

#: the columns of :func:`preset_table`, in order (the keys of :func:`preset_facts`, then the time)
PRESET_COLUMNS = ("updates", "warmup", "tokens per batch", "vocabulary", "layers (enc/dec)", "d_model", "heads",
                  "FFN", "parameters")


def preset_model(name: str) -> nn.Module:
    """The preset's model with its own vocabulary (shared), on the meta device: shapes only."""
    from qkv.models import build_model

    model_cfg, train_cfg = preset(name)
    v = train_cfg.vocab_size
    with torch.device("meta"):
        return build_model(dataclasses.replace(model_cfg, src_vocab_size=v, tgt_vocab_size=v))


def preset_facts(name: str) -> dict[str, int | str]:
    """A preset's training values and model shape (the columns of :data:`PRESET_COLUMNS`)."""
    m, t = preset(name)
    return {"updates": t.max_steps, "warmup": t.warmup_steps, "tokens per batch": t.max_tokens,
            "vocabulary": t.vocab_size, "layers (enc/dec)": f"{m.n_encoder_layers}/{m.n_decoder_layers}",
            "d_model": m.d_model, "heads": m.n_heads, "FFN": m.d_ff,
            "parameters": parameter_breakdown(preset_model(name))["total"]}


def preset_times() -> dict:
    """What ``benchmarks/preset_speed.py`` measured, from :data:`PRESET_TIMES` ({} when it has not been run)."""
    return json.loads(PRESET_TIMES.read_text(encoding="utf-8")) if PRESET_TIMES.is_file() else {}


def preset_time(name: str, times: dict, facts: dict | None = None) -> dict | None:
    """The measured time of ``name`` in ``times`` (:func:`preset_times`), or None when none was measured
    for the preset as it is now (its tokens per batch and parameter count as recorded)."""
    r = times.get("presets", {}).get(name)
    facts = facts or preset_facts(name)
    if not r or r.get("max_tokens") != facts["tokens per batch"] or r.get("parameters") != facts["parameters"]:
        return None
    return r


def _number(v: int | str) -> str:
    return f"{v:,}" if isinstance(v, int) else v


def preset_table(times: dict | None = None) -> str:
    """The Markdown table of docs/training.md: every preset's facts and its measured time per 1,000
    updates, with the line that says where and how the time was measured."""
    times = preset_times() if times is None else times
    threads = times.get("threads", "?")
    head = ("preset", *PRESET_COLUMNS, f"time per 1,000 updates ({threads} CPU threads)")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in PRESETS:
        facts = preset_facts(name)
        r = preset_time(name, times, facts)
        lines.append("| " + " | ".join([name, *(_number(v) for v in facts.values()),
                                        clock(r["seconds_per_1000_updates"]) if r else "not measured"]) + " |")
    if times:
        split = ", ".join(f"{n} on 1/{r['batch_split']}" for n, r in times["presets"].items() if r["batch_split"] > 1)
        lines += ["", f"Time (H:MM:SS) extrapolated from a few updates each (their median), on generated sentence "
                      f"pairs of {times['lengths'][0]}-{times['lengths'][1]} tokens at the preset's tokens per batch"
                      + (f" ({split} of the batch, the time multiplied back)" if split else "")
                      + f"; {times['machine']}, {times['date']}, commit {times['commit']}; "
                      f"`{times['command']}`." + (f" {_notes(times)}" if _notes(times) else "")]
    return "\n".join(lines)


def _seconds(s: float) -> str:
    """Three significant digits, or whole seconds from 100 on: 2.94, 42.2, 2,150."""
    return f"{s:.3g}" if s < 100 else f"{s:,.0f}"


def _notes(times: dict) -> str:
    notes = dict.fromkeys(r.get("note", "") for r in times.get("presets", {}).values())
    return " ".join(f"{n[0].upper()}{n[1:]}{'' if n.endswith('.') else '.'}" for n in notes if n)


def describe_preset(name: str, model_cfg: ModelConfig, vocab_size: int) -> str:
    """What ``qkv info --preset NAME`` adds: the preset's training values, and its measured training
    time when ``model_cfg`` and ``vocab_size`` are the preset's own (flags may change them)."""
    m, t = preset(name)
    lines = [f"preset {name}: {t.max_steps:,} updates, warmup {t.warmup_steps:,}, {t.max_tokens:,} tokens per batch, "
             f"vocabulary {t.vocab_size:,}"]
    times = preset_times()
    r = preset_time(name, times)
    if model_cfg != m or vocab_size != t.vocab_size:
        lines.append("measured training time: only for the preset unchanged (the flags change the model here)")
    elif r is None:
        lines.append(f"measured training time: none for the preset as it is now (python benchmarks/preset_speed.py "
                     f"--presets {name} measures it)")
    else:
        split = f", timed on 1/{r['batch_split']} of the batch" if r["batch_split"] > 1 else ""
        lines.append(f"measured training time: {clock(r['seconds_per_1000_updates'])} per 1,000 updates "
                     f"({_seconds(r['seconds_per_update'])} s per update, the median of {r['extrapolated_from_updates']} "
                     f"timed{split}; extrapolated) on {times['threads']} CPU threads of {times['machine']}, "
                     f"{r['date']}" + (f"; {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)
