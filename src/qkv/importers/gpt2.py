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

import re
from pathlib import Path

import torch

from qkv.config import EOS, ModelConfig, TrainConfig
from qkv.errors import QkvError
from qkv.importers.folder import FolderError

ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)
DEFAULT_ARCHITECTURE = "GPT2LMHeadModel"
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def _refuse(where: Path, option: str, why: str) -> None:
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {option} is not supported: {why}")


def model_config(hf, where: Path, vocab_size: int) -> ModelConfig:
    """The qkv decoder-only model of GPT-2's config.json ``hf`` (a dict or a
    :class:`~qkv.importers.folder.Config`); a malformed field is refused naming it."""
    from qkv.importers.folder import Config

    c = hf if isinstance(hf, Config) else Config(hf, where)
    act = c.str("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        _refuse(where, f"activation_function {act!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}")
    for flag in ("add_cross_attention", "scale_attn_by_inverse_layer_idx"):
        if c.bool(flag, False):
            _refuse(where, f"{flag} = true", "qkv's decoder-only layers are GPT-2's without it")
    if c.bool("scale_attn_weights", True) is False:
        _refuse(where, "scale_attn_weights = false", "qkv's attention divides by sqrt(d_k)")
    if c.bool("tie_word_embeddings", True) is False:
        _refuse(where, "tie_word_embeddings = false", "qkv imports GPT-2 with its output tied to wte")
    d, heads = c.int("n_embd", 768), c.int("n_head", 12)
    if d % heads:
        c.error(f"n_embd {d} is not a multiple of n_head {heads}")
    return ModelConfig(
        task="lm", arch="transformer", d_model=d, n_heads=heads,
        d_ff=c.int("n_inner", 4 * d), n_encoder_layers=1, n_decoder_layers=c.int("n_layer", 12),
        dropout=c.float("resid_pdrop", 0.1, at_least=0, below=1),
        attention_dropout=c.float("attn_pdrop", 0.1, at_least=0, below=1),
        positional="learned", max_positions=c.int("n_positions", 1024, at_least=2), norm_first=True, final_norm="auto",
        activation=ACTIVATIONS[act], layer_norm_eps=c.float("layer_norm_epsilon", 1e-5, at_least=0, at_most=1),
        scale_embeddings=False, share_embeddings=True, tie_output=True,
        output_bias=True,  # 0 on the model's tokens, -1e4 on the rows qkv adds: folder.added_rows_bias
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
    ).validate()


def state_dict(weights, cfg: ModelConfig, idmap, where: Path) -> dict[str, torch.Tensor]:
    """qkv's state dict of GPT-2's weights (:class:`~qkv.importers.folder.Weights`), each tensor taken
    with the shape config.json gives it."""
    prefix = "transformer." if any(k.startswith("transformer.") for k in weights) else ""
    d, ff = cfg.d_model, cfg.d_ff

    def w(name: str, shape, fields=("n_embd",)) -> torch.Tensor:
        return weights.take(prefix + name, shape, fields)

    weights.check_layers(re.escape(prefix) + r"h\.(\d+)\.", cfg.n_decoder_layers, "n_layer")
    tokens = sum(m is not None for m in idmap.model_ids)
    vocab = weights.config.int("vocab_size", None) if weights.config else None
    if vocab is not None:
        weights.check_rows(prefix + "wte.weight", vocab, weights.config.says("vocab_size"))
    weights.check_rows(prefix + "wte.weight", tokens, f"tokenizer.json has {tokens} tokens (qkv imports a model whose "
                                                      "vocabulary is its tokenizer's)")
    wte = w("wte.weight", (tokens, d))
    out = {"embed.weight": idmap.rows(wte).contiguous(),
           "pos.weight": w("wpe.weight", (cfg.max_positions, d), ("n_positions", "n_embd")).contiguous(),
           "final_norm.weight": w("ln_f.weight", (d,)), "final_norm.bias": w("ln_f.bias", (d,))}
    FF = ("n_embd", "n_inner")
    for i in range(cfg.n_decoder_layers):
        h, q = f"h.{i}", f"layers.{i}"
        out[f"{q}.self_attn.in_proj.weight"] = w(f"{h}.attn.c_attn.weight", (d, 3 * d)).t().contiguous()  # Conv1D: (in, out)
        out[f"{q}.self_attn.in_proj.bias"] = w(f"{h}.attn.c_attn.bias", (3 * d,))
        out[f"{q}.self_attn.out_proj.weight"] = w(f"{h}.attn.c_proj.weight", (d, d)).t().contiguous()
        out[f"{q}.self_attn.out_proj.bias"] = w(f"{h}.attn.c_proj.bias", (d,))
        out[f"{q}.ffn.w_1.weight"] = w(f"{h}.mlp.c_fc.weight", (d, ff), FF).t().contiguous()
        out[f"{q}.ffn.w_1.bias"] = w(f"{h}.mlp.c_fc.bias", (ff,), FF)
        out[f"{q}.ffn.w_2.weight"] = w(f"{h}.mlp.c_proj.weight", (ff, d), FF).t().contiguous()
        out[f"{q}.ffn.w_2.bias"] = w(f"{h}.mlp.c_proj.bias", (d,))
        for qn, hn in (("res_attn.norm", "ln_1"), ("res_ffn.norm", "ln_2")):
            out[f"{q}.{qn}.weight"], out[f"{q}.{qn}.bias"] = w(f"{h}.{hn}.weight", (d,)), w(f"{h}.{hn}.bias", (d,))
    from qkv.importers.folder import added_rows_bias

    out["output_bias"] = added_rows_bias(idmap)
    return out


def tokenizer(folder: Path, hf: dict):
    """The folder's tokenizer.json with ``<|endoftext|>`` (the config's eos_token_id) as qkv's EOS."""
    from qkv.data.pretrained import HFTokenizer
    from qkv.data.tokenizer import TokenizerPair

    from qkv.importers.folder import Config, read_tokenizer_json

    path = folder / "tokenizer.json"
    if not path.exists():
        raise QkvError(f"{path}: missing (save the tokenizer with GPT2TokenizerFast.save_pretrained, which writes it)")
    raw = read_tokenizer_json(path)
    c = hf if isinstance(hf, Config) else Config(hf, folder / "config.json")
    eos = c.int("eos_token_id", 50256, at_least=0)
    from tokenizers import Tokenizer

    size = Tokenizer.from_str(raw.decode("utf-8")).get_vocab_size(with_added_tokens=True)
    if eos >= size:
        raise FolderError(f"{c.path}: eos_token_id = {eos} is not a token of tokenizer.json ({size} tokens)")
    tok = HFTokenizer.create(raw, {EOS: eos}, (), str(path))
    return TokenizerPair(tok, tok)


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point."""
    import dataclasses

    from qkv.importers import Imported
    from qkv.importers.folder import Config, load_state, read_weights
    from qkv.models import build_model

    where = base / "config.json"
    c = Config(config, where)
    tokenizers = tokenizer(base, c)
    tok = tokenizers.src
    cfg = model_config(c, where, tok.vocab_size)
    sd = state_dict(read_weights(base, c), cfg, tok.ids, base)  # every tensor checked before a model is built
    model = build_model(cfg)
    load_state(model, sd, c)
    train = dataclasses.replace(TrainConfig(), max_len=min(TrainConfig().max_len, cfg.max_positions - 1))
    return Imported(model, cfg, tokenizers, train, {"data": {"train": f"imported from {base.name} ({arch})"}}, arch)


__all__ = ["convert", "model_config", "state_dict", "tokenizer", "ARCHITECTURES"]
