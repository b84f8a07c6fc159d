"""Hugging Face ``GPT2LMHeadModel`` folder -> a qkv language model checkpoint (task lm).

GPT-2 is qkv's decoder-only Transformer with these options, each a named
:class:`~qkv.config.ModelConfig` field:

    GPT2Config / the folder                 qkv ModelConfig
    pre-norm blocks (ln_1, ln_2)            norm_first = true
    ln_f after the last block               final_norm = "auto" (on with pre-norm)
    gelu_new                                activation = "gelu_tanh"
    learned positions wpe (n_positions)     positional = "learned", max_positions = n_positions
    no embedding scaling                    scale_embeddings = false
    lm_head tied to wte                     tie_output = true
    layer_norm_epsilon                      layer_norm_eps
    tokenizer.json (byte-level BPE)         :class:`qkv.data.pretrained.HFTokenizer`

GPT-2's ``Conv1D`` stores weights as (in, out): each is transposed into torch's (out, in).
``<|endoftext|>`` is qkv's EOS; qkv's other special ids (PAD, UNK, BOS, CLS, MASK, SEP) are rows of
their own (zero, never emitted), added by the tokenizer's id map.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.config import EOS, ModelConfig, TrainConfig
from qkv.errors import QkvError

ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)
DEFAULT_ARCHITECTURE = "GPT2LMHeadModel"
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def _refuse(where: Path, option: str, why: str) -> None:
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {option} is not supported: {why}")


def model_config(hf: dict, where: Path, vocab_size: int) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        _refuse(where, f"activation_function {act!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}")
    for flag in ("add_cross_attention", "scale_attn_by_inverse_layer_idx"):
        if hf.get(flag):
            _refuse(where, f"{flag} = true", "qkv's decoder-only layers are GPT-2's without it")
    if hf.get("scale_attn_weights", True) is False:
        _refuse(where, "scale_attn_weights = false", "qkv's attention divides by sqrt(d_k)")
    if hf.get("tie_word_embeddings", True) is False:
        _refuse(where, "tie_word_embeddings = false", "qkv imports GPT-2 with its output tied to wte")
    d = int(hf.get("n_embd", 768))
    return ModelConfig(
        task="lm", arch="transformer", d_model=d, n_heads=int(hf.get("n_head", 12)),
        d_ff=int(hf.get("n_inner") or 4 * d), n_encoder_layers=1, n_decoder_layers=int(hf.get("n_layer", 12)),
        dropout=float(hf.get("resid_pdrop", 0.1)), attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        positional="learned", max_positions=int(hf.get("n_positions", 1024)), norm_first=True, final_norm="auto",
        activation=ACTIVATIONS[act], layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        scale_embeddings=False, share_embeddings=True, tie_output=True,
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
    ).validate()


def state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig, idmap, where: Path) -> dict[str, torch.Tensor]:
    def w(name: str) -> torch.Tensor:
        for candidate in (name, "transformer." + name):
            if candidate in weights:
                return weights[candidate].float()
        raise QkvError(f"{where}: the weights have no {name!r} (not a GPT2LMHeadModel state dict?)")

    out = {"embed.weight": idmap.rows(w("wte.weight")).contiguous(), "pos.weight": w("wpe.weight").contiguous(),
           "final_norm.weight": w("ln_f.weight"), "final_norm.bias": w("ln_f.bias")}
    if out["pos.weight"].size(0) < cfg.max_positions:
        raise QkvError(f"{where}: wpe has {out['pos.weight'].size(0)} rows, n_positions says {cfg.max_positions}")
    out["pos.weight"] = out["pos.weight"][: cfg.max_positions].contiguous()
    for i in range(cfg.n_decoder_layers):
        h, q = f"h.{i}", f"layers.{i}"
        out[f"{q}.self_attn.in_proj.weight"] = w(f"{h}.attn.c_attn.weight").t().contiguous()  # Conv1D: (in, out)
        out[f"{q}.self_attn.in_proj.bias"] = w(f"{h}.attn.c_attn.bias")
        out[f"{q}.self_attn.out_proj.weight"] = w(f"{h}.attn.c_proj.weight").t().contiguous()
        out[f"{q}.self_attn.out_proj.bias"] = w(f"{h}.attn.c_proj.bias")
        out[f"{q}.ffn.w_1.weight"] = w(f"{h}.mlp.c_fc.weight").t().contiguous()
        out[f"{q}.ffn.w_1.bias"] = w(f"{h}.mlp.c_fc.bias")
        out[f"{q}.ffn.w_2.weight"] = w(f"{h}.mlp.c_proj.weight").t().contiguous()
        out[f"{q}.ffn.w_2.bias"] = w(f"{h}.mlp.c_proj.bias")
        for qn, hn in (("res_attn.norm", "ln_1"), ("res_ffn.norm", "ln_2")):
            out[f"{q}.{qn}.weight"], out[f"{q}.{qn}.bias"] = w(f"{h}.{hn}.weight"), w(f"{h}.{hn}.bias")
    return out


def tokenizer(folder: Path, hf: dict):
    """The folder's tokenizer.json with ``<|endoftext|>`` (the config's eos_token_id) as qkv's EOS."""
    from qkv.data.pretrained import HFTokenizer
    from qkv.data.tokenizer import TokenizerPair

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise QkvError(f"{path}: missing (save the tokenizer with GPT2TokenizerFast.save_pretrained, which writes it)")
    eos = hf.get("eos_token_id", 50256)
    tok = HFTokenizer.create(path.read_bytes(), {EOS: eos}, (), str(path))
    return TokenizerPair(tok, tok)


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point."""
    import dataclasses

    from qkv.importers import Imported, read_weights
    from qkv.models import build_model

    where = base / "config.json"
    tokenizers = tokenizer(base, config)
    tok = tokenizers.src
    cfg = model_config(config, where, tok.vocab_size)
    weights = read_weights(base)
    model = build_model(cfg)
    sd = state_dict(weights, cfg, tok.ids, base)
    missing = sorted(set(model.state_dict()) - set(sd))
    if missing:
        raise QkvError(f"internal: the GPT-2 import left qkv parameters unset: {missing}")
    model.load_state_dict(sd, strict=True)
    train = dataclasses.replace(TrainConfig(), max_len=min(TrainConfig().max_len, cfg.max_positions - 1))
    return Imported(model, cfg, tokenizers, train, {"data": {"train": f"imported from {base.name} ({arch})"}}, arch)


__all__ = ["convert", "model_config", "state_dict", "tokenizer", "ARCHITECTURES"]
