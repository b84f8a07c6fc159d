"""Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM`` folders -> qkv
language model checkpoints (task lm).

The three are one decoder-only Transformer: qkv's, with these switches (each a named
:class:`~qkv.config.ModelConfig` field; the importer maps names and settings and computes nothing):

    the folder's config.json                     qkv ModelConfig
    pre-norm blocks, a norm after the last       norm_first = true, final_norm = "auto"
    RMSNorm (rms_norm_eps), no bias              norm = "rmsnorm", norm_bias = false, layer_norm_eps
    rotary positions (rope_theta), rotate-half   positional = "rotary", rope_theta
    SwiGLU MLP gate/up/down_proj (hidden_act)    ffn_gated = true, activation = "silu"; W_1/W_3/W_2
    mlp_bias (Llama)                             ffn_bias
    num_key_value_heads                          n_kv_heads (grouped-query attention)
    attention_bias (Llama: q, k, v and o)        qkv_bias, out_bias
    Qwen2: q, k, v biases, none on o_proj        qkv_bias = true, out_bias = false
    no embedding scaling                         scale_embeddings = false
    tie_word_embeddings (lm_head)                tie_output
    tokenizer.json (byte-fallback or             :class:`qkv.data.pretrained.HFTokenizer`
    byte-level BPE)

Refused by name: RoPE scaling other than the default (``rope_type`` llama3, linear, yarn, ...), a
``head_dim`` other than hidden_size / num_attention_heads, and sliding-window attention (Mistral's
``sliding_window``, Qwen2's ``use_sliding_window``) unless the window covers every position
(``>= max_position_embeddings``), where it changes nothing.

An embedding padded beyond the tokenizer's vocabulary (``vocab_size`` above tokenizer.json's size)
keeps the tokenizer's rows: no text is ever those ids. The model's BOS and EOS tokens are qkv's BOS and EOS; qkv's other special ids are rows of their own
(zero, never emitted). The model's pad token, if any, stays an ordinary token (qkv pads with its own).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from qkv.config import BOS, EOS, MAX_POSITIONS, UNK, ModelConfig, TrainConfig
from qkv.errors import QkvError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "qwen2", "mistral")
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"
BY_TYPE = dict(zip(MODEL_TYPES, ARCHITECTURES))
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}


def _refuse(where: Path, option: str, why: str) -> None:
    from qkv.importers import ImportRefused

    raise ImportRefused(f"{where}: {option} is not supported: {why}")


def rope_theta(c, where: Path) -> float:
    """θ of the default RoPE (``rope_parameters`` of transformers 5, or the older ``rope_theta`` /
    ``rope_scaling``); any scaled RoPE is refused by name (``c``: config.json, a
    :class:`~qkv.importers.folder.Config`)."""
    from qkv.importers.folder import Config

    params = c.dict("rope_parameters", {})
    scaling = c.get("rope_scaling") or {}
    for source, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = p.get("rope_type", p.get("type", "default")) if isinstance(p, dict) else p
        if kind not in (None, "default"):
            _refuse(where, f"{source} rope_type {kind!r}", "qkv's rotary positions are RoPE's default, unscaled")
    if "rope_theta" in params:
        return Config(params, where).float("rope_theta", at_least=1.0, at_most=1e12)
    return c.float("rope_theta", 10000.0, at_least=1.0, at_most=1e12)


def model_config(hf, where: Path, arch: str, vocab_size: int) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama, Qwen2 or Mistral config.json (a dict or a
    :class:`~qkv.importers.folder.Config`); a malformed field is refused naming it, what qkv cannot
    compute is refused by name."""
    from qkv.importers.folder import Config

    c = hf if isinstance(hf, Config) else Config(hf, where)
    d, heads = c.int("hidden_size", 4096), c.int("num_attention_heads", 32, at_most=4096)
    kv = c.int("num_key_value_heads", heads, at_most=heads)
    act = c.str("hidden_act", "silu")
    if act not in ACTIVATIONS:
        _refuse(where, f"hidden_act {act!r}", f"qkv computes {', '.join(sorted(ACTIVATIONS))}")
    if d % heads:
        c.error(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
    if heads % kv:
        c.error(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = c.int("head_dim", d // heads)
    if head_dim != d // heads:
        _refuse(where, f"head_dim = {head_dim}", f"qkv's heads are hidden_size / num_attention_heads = {d // heads} wide")
    positions = c.int("max_position_embeddings", 2048, at_least=2)
    window = c.get("sliding_window")
    layer_types = c.list("layer_types", [])
    sliding = window is not None and (
        arch == "MistralForCausalLM" or c.bool("use_sliding_window", False) or "sliding_attention" in layer_types)
    if sliding and not (isinstance(window, int) and not isinstance(window, bool) and window >= positions):
        _refuse(where, f"sliding_window = {window}", "qkv's attention sees every earlier position (a window of at "
                f"least max_position_embeddings = {positions}, or null, imports)")
    qwen = arch == "Qwen2ForCausalLM"
    attention_bias = c.bool("attention_bias", False)
    return ModelConfig(
        task="lm", arch="transformer", d_model=d, n_heads=heads, n_kv_heads=kv,
        d_ff=c.int("intermediate_size", 11008), n_encoder_layers=1, n_decoder_layers=c.int("num_hidden_layers", 32),
        dropout=0.0, attention_dropout=c.float("attention_dropout", 0.0, at_least=0, below=1),
        positional="rotary", rope_theta=rope_theta(c, where), max_positions=min(positions, MAX_POSITIONS),
        norm_first=True, final_norm="auto", norm="rmsnorm", norm_bias=False,
        layer_norm_eps=c.float("rms_norm_eps", 1e-6, at_least=0, at_most=1), activation=ACTIVATIONS[act],
        ffn_gated=True, ffn_bias=c.bool("mlp_bias", False), qkv_bias=qwen or attention_bias,
        out_bias=attention_bias and not qwen, scale_embeddings=False, share_embeddings=True,
        tie_output=c.bool("tie_word_embeddings", False), src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
        output_bias=True,  # 0 on the model's tokens, -1e4 on the rows qkv adds: folder.added_rows_bias
    ).validate()


def state_dict(weights, cfg: ModelConfig, idmap, where: Path, vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The folder's weights (:class:`~qkv.importers.folder.Weights`) under qkv's names, vocabulary rows in
    qkv's order (``idmap``); each tensor taken with the shape config.json gives it (``vocab``: its
    vocab_size, the embedding's rows; None: any)."""
    prefixed = any(k.startswith("model.") for k in weights)
    d, ff, kv = cfg.d_model, cfg.d_ff, cfg.kv_heads * cfg.d_k
    D, FF, KV = ("hidden_size",), ("hidden_size", "intermediate_size"), ("hidden_size", "num_key_value_heads")

    def w(name: str, shape, fields=D) -> torch.Tensor:
        return weights.take(("model." if prefixed else "") + name, shape, fields)

    weights.check_layers(("model\\." if prefixed else "") + r"layers\.(\d+)\.", cfg.n_decoder_layers,
                         "num_hidden_layers")
    V = ("vocab_size", "hidden_size")
    out = {"embed.weight": idmap.rows(w("embed_tokens.weight", (vocab, d), V)).contiguous(),
           "final_norm.weight": w("norm.weight", (d,))}
    for i in range(cfg.n_decoder_layers):
        h, q = f"layers.{i}", f"layers.{i}"
        att = f"{h}.self_attn"
        sizes = {"q": d, "k": kv, "v": kv}
        out[f"{q}.self_attn.in_proj.weight"] = torch.cat([w(f"{att}.{p}_proj.weight", (sizes[p], d), KV) for p in "qkv"])
        if cfg.qkv_bias:
            out[f"{q}.self_attn.in_proj.bias"] = torch.cat([w(f"{att}.{p}_proj.bias", (sizes[p],), KV) for p in "qkv"])
        out[f"{q}.self_attn.out_proj.weight"] = w(f"{att}.o_proj.weight", (d, d))
        if cfg.out_bias:
            out[f"{q}.self_attn.out_proj.bias"] = w(f"{att}.o_proj.bias", (d,))
        for qn, hn, shape in (("w_1", "gate_proj", (ff, d)), ("w_3", "up_proj", (ff, d)), ("w_2", "down_proj", (d, ff))):
            out[f"{q}.ffn.{qn}.weight"] = w(f"{h}.mlp.{hn}.weight", shape, FF)
            if cfg.ffn_bias:
                out[f"{q}.ffn.{qn}.bias"] = w(f"{h}.mlp.{hn}.bias", shape[:1], FF)
        out[f"{q}.res_attn.norm.weight"] = w(f"{h}.input_layernorm.weight", (d,))
        out[f"{q}.res_ffn.norm.weight"] = w(f"{h}.post_attention_layernorm.weight", (d,))
    if not cfg.tie_output:
        out["output_proj.weight"] = idmap.rows(weights.take("lm_head.weight", (vocab, d),
                                                            ("vocab_size", "hidden_size", "tie_word_embeddings"))).contiguous()
    from qkv.importers.folder import added_rows_bias

    out["output_bias"] = added_rows_bias(idmap)
    return out


def _first(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokenizer(folder: Path, hf: dict):
    """The folder's tokenizer.json: config.json's ``bos_token_id`` and ``eos_token_id`` (the first of a
    list) as qkv's BOS and EOS, the tokenizer's unk token (byte-fallback BPE has one) as qkv's UNK."""
    from qkv.data.pretrained import HFTokenizer, special_token_names
    from qkv.data.tokenizer import TokenizerPair
    from qkv.importers.folder import Config, FolderError, read_tokenizer_json

    c = hf if isinstance(hf, Config) else Config(hf, folder / "config.json")
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise QkvError(f"{path}: missing (save the tokenizer with its fast class's save_pretrained, which writes it)")
    data = read_tokenizer_json(path)
    for key in ("eos_token_id", "bos_token_id"):
        value = c.get(key)
        if value is not None and _first(value) is None:
            raise FolderError(f"{c.path}: {key} must be a token id (or a list of them), got {str(value)[:40]}")
    eos, bos = _first(c.get("eos_token_id")), _first(c.get("bos_token_id"))
    if eos is None:
        raise QkvError(f"{folder / 'config.json'}: no eos_token_id (qkv's language models end a text with it)")
    roles = {EOS: eos, BOS: bos if bos != eos else None}
    unk = special_token_names(folder).get("unk")
    from qkv.data.pretrained import _hf

    unk_id = _hf().Tokenizer.from_str(data.decode("utf-8")).token_to_id(unk) if unk else None
    if unk_id is not None and unk_id not in roles.values():
        roles[UNK] = unk_id
    tok = HFTokenizer.create(data, roles, (), str(path))
    return TokenizerPair(tok, tok)


def convert(folder: Path, base: Path, config: dict, arch: str, sentence: dict | None):
    """:mod:`qkv.importers`' entry point."""
    from qkv.importers import Imported
    from qkv.importers.folder import Config, FolderError, load_state, read_weights
    from qkv.models import build_model

    where = base / "config.json"
    config = config if isinstance(config, Config) else Config(config, where)
    if sentence is not None:
        _refuse(where, "a sentence-transformers folder", f"{arch} imports as a language model")
    tokenizers = tokenizer(base, config)
    tok = tokenizers.src
    cfg = model_config(config, where, arch, tok.vocab_size)
    vocab = config.int("vocab_size", 32000)
    known = sum(m is not None for m in tok.ids.model_ids)  # the tokenizer's ids; rows beyond them are never read
    if vocab < known:
        raise FolderError(f"{where}: vocab_size {vocab} is smaller than tokenizer.json's {known} tokens")
    sd = state_dict(read_weights(base, config), cfg, tok.ids, base, vocab)  # every tensor checked first
    model = build_model(cfg)
    load_state(model, sd, config)
    train = dataclasses.replace(TrainConfig(), max_len=min(TrainConfig().max_len, cfg.max_positions - 1))
    return Imported(model, cfg, tokenizers, train, {"data": {"train": f"imported from {base.name} ({arch})"}}, arch)


__all__ = ["convert", "model_config", "state_dict", "tokenizer", "ARCHITECTURES"]
