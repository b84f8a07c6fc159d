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

and training (forward + backward) three times that. The count is divided by T to give FLOPs per
target token (the unit of tokens/s in the benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from qkv.config import ModelConfig


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


@dataclass(frozen=True)
class Flops:
    forward: float  # per target token
    training: float  # per target token, forward + backward (3 x forward)


def transformer_flops(cfg: ModelConfig, src_len: int, tgt_len: int, vocab_size: int | None = None) -> Flops:
    """Matmul FLOPs of the encoder–decoder per target token (formula in the module docstring)."""
    d, f, s, t = cfg.d_model, cfg.d_ff, src_len, tgt_len
    v = vocab_size if vocab_size is not None else cfg.tgt_vocab_size
    enc = cfg.n_encoder_layers * (2 * 4 * d * d * s + 2 * 2 * d * f * s + 2 * 2 * s * s * d)
    dec_layer = (
        2 * 4 * d * d * t + 2 * 2 * t * t * d  # masked self-attention
        + 2 * 2 * d * d * t + 2 * 2 * d * d * s + 2 * 2 * t * s * d  # cross-attention
        + 2 * 2 * d * f * t  # FFN
    )
    dec = cfg.n_decoder_layers * dec_layer
    out = 2 * d * v * t
    forward = (enc + dec + out) / t
    return Flops(forward=forward, training=3 * forward)


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
