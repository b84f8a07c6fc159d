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

    LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM   lm: logits
    GPT2LMHeadModel                                          lm: logits
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from qkv.config import BOS, EOS, PAD
from qkv.errors import QkvError

# ModelConfig fields a transformers config does not carry back (training settings) or carries as a bound
IGNORED = {"dropout", "attention_dropout", "max_positions"}


@dataclass(frozen=True)
class Family:
    kind: str  # "lm"
    config: Callable  # (Source, arch, model ids) -> the transformers config
    read_config: Callable  # (config dict, where, arch, Source) -> the ModelConfig the importer reads from it
    state: Callable  # (Tagged, Source, Config) -> qkv's state dict of addresses (the importer's own mapping)
    not_in_checkpoint: tuple = ()  # parameters the import leaves out: written as the class initialises them


def _ids(src) -> list[int | None]:
    return list(src.tokenizers.src.ids.model_ids)


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

    return llama.state_dict(tagged, src.model, src.tokenizers.src.ids, c.path)


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

    return gpt2.state_dict(tagged, src.model, src.tokenizers.src.ids, c.path)


LLAMA = Family("lm", llama_config, llama_read, llama_state)
FAMILIES = {"LlamaForCausalLM": LLAMA, "Qwen2ForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
            "GPT2LMHeadModel": Family("lm", gpt2_config, gpt2_read, gpt2_state)}


def imported_architecture(src) -> str | None:
    """The transformers class the checkpoint was imported from (config.json's ``imported``), or None."""
    imported = src.config.get("imported")
    arch = imported.get("architecture") if isinstance(imported, dict) else None
    return arch if isinstance(arch, str) else None


def family_of(src) -> tuple[str, Family] | None:
    """(architecture, Family) of an imported checkpoint this module writes; None for every other."""
    arch = imported_architecture(src)
    return (arch, FAMILIES[arch]) if arch in FAMILIES else None


def _value(v) -> str:
    return repr(v).replace("True", "true").replace("False", "false")


def check(src, arch: str, family: Family) -> None:
    """Refuse by name every ModelConfig option the family's config.json cannot carry: the importer reads
    the config this export would write back into the checkpoint's own options, or the export is refused."""
    from qkv.importers.folder import Config

    data = family.config(src, arch).to_dict()
    where = src.path / "config.json"
    try:
        back = family.read_config(Config(data, where), where, arch, src)
    except QkvError as e:
        raise QkvError(f"{src.path}: --format hf cannot write it as {arch} ({e})") from None
    mine, theirs = asdict(src.model), asdict(back)
    differ = [f"{k} = {_value(mine[k])} ({arch} has {_value(theirs[k])})" for k in mine
              if k not in IGNORED and k in theirs and mine[k] != theirs[k]]
    if differ:
        raise QkvError(f"{src.path} has {', '.join(differ)}: --format hf writes it as {arch}, which cannot say it")


__all__ = ["FAMILIES", "Family", "check", "family_of", "imported_architecture"]


# --- writing and checking -------------------------------------------------------------------------------

def tokenizer_files(src, out) -> dict[str, str]:
    """The imported tokenizer.json as it came, and a tokenizer_config.json naming its special tokens by
    role (what the import read them as) for ``PreTrainedTokenizerFast`` / ``AutoTokenizer``."""
    import json

    from qkv.data.pretrained import SLOT_NAMES

    tok = src.tokenizers.src
    (out / "tokenizer.json").write_bytes(tok.tokenizer_json)
    specials = {f"{SLOT_NAMES[slot]}_token": tok.tok.id_to_token(m) for slot, m in enumerate(_ids(src)[:len(SLOT_NAMES)])
                if m is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "model_max_length": src.model.max_positions, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return specials


def write(src, out, arch: str, family: Family, version: str) -> dict:
    """Write ``arch``'s folder for the imported checkpoint ``src`` into ``out`` (empty) and check it."""
    import torch
    import transformers

    from qkv.export.hf_trace import Tagged, invert
    from qkv.export.source import checkpoint_name
    from qkv.importers.folder import Config

    config = family.config(src, arch)
    cls = getattr(transformers, arch)
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in cls(config).named_parameters()}  # tied ones once
    c = Config(config.to_dict(), out / "config.json")
    tagged = Tagged(shapes, c)
    state, unfilled = invert(tagged, family.state(tagged, src, c), src.weights, str(src.path))
    left = sorted(set(unfilled) - set(family.not_in_checkpoint))
    if left:
        raise QkvError(f"internal: the checkpoint fills no {', '.join(left[:5])} of {arch}")
    torch.manual_seed(0)  # the random init of what the import left out (named in qkv_export.json)
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(unfilled) - set(_tied(model)) - set(_buffers(model)):
        raise QkvError(f"internal: {arch} names differ (missing {sorted(missing)[:5]}, unexpected {unexpected[:5]})")
    model.eval()
    model.save_pretrained(str(out))
    specials = tokenizer_files(src, out)
    check = verify(src, out, arch, family)
    return {"format": "hf", "transformers_version": version, "qkv_version": src.qkv_version,
            "checkpoint": checkpoint_name(src.path), "task": src.task, "runtime": f"transformers.{arch}",
            "special_tokens": specials, "tokenizer_json": {"src": "tokenizer.json"}, "not_in_checkpoint": unfilled, "verified": check, "differences": []}


def _tied(model) -> list[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return [k for k in params if k not in dict(model.named_parameters())]


def _buffers(model) -> list[str]:
    return [k for k, _ in model.named_buffers()]


def probe(src) -> list[list[int]]:
    """Right-padded probe sequences of ordinary tokens (qkv ids)."""
    from qkv.export.reference import probe_sequences

    sources, targets = probe_sequences(src)
    return [s + t for s, t in zip(sources, targets)]


def verify(src, out, arch: str, family: Family) -> dict:
    """Load ``out`` with transformers' own class and compare its outputs with the checkpoint's network on a
    right-padded probe batch (max |delta| <= LOGIT_TOLERANCE), and its tokenizer's ids with qkv's."""
    import torch
    import transformers

    from qkv.export.hf import LOGIT_TOLERANCE
    from qkv.export.reference import lm_logits, reference_model

    ids = _ids(src)
    to_model = torch.tensor([m if m is not None else 0 for m in ids])
    have = torch.tensor([m is not None for m in ids])
    seqs = probe(src)
    width = max(map(len, seqs))
    tokens = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    real = torch.zeros_like(tokens, dtype=torch.bool)
    for i, s in enumerate(seqs):
        real[i, :len(s)] = True
    hf = getattr(transformers, arch).from_pretrained(str(out)).eval()
    with torch.inference_mode():
        got = hf(input_ids=to_model[tokens], attention_mask=real.long()).logits.float()
    ref = lm_logits(reference_model(src), seqs)
    delta = float((got[..., to_model[have]] - ref[..., have])[real].abs().max())
    if not delta <= LOGIT_TOLERANCE:
        raise QkvError(f"the exported {arch} disagrees with {src.path}: max |delta logit| = {delta:.3g} "
                       f"(expected <= {LOGIT_TOLERANCE:g})")
    # the tokenizer.json as written (AutoTokenizer may rebuild a family's own pipeline instead: Qwen2's)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    t = src.tokenizers.src
    texts = ["Hello, world! 123", "The quick brown fox.", t.decode([seqs[0]])[0]]
    want = [t.to_model_ids(t.encode_text(x)) for x in texts]
    got_ids = tok(texts)["input_ids"]
    if got_ids != want:
        raise QkvError(f"the exported tokenizer disagrees with {src.path}'s on {texts!r}: {got_ids} != {want}")
    return {"probe_sequences": len(seqs), "positions": int(real.sum()), "max_abs_logit_difference": delta,
            "tokenizer_texts": len(texts)}


def usage(src, here: str) -> str:
    """The model card's code for the written class."""
    arch, family = family_of(src)
    if family.kind == "lm":
        return f"""```python
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

{here}
tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)  # tokenizer.json as imported
model = AutoModelForCausalLM.from_pretrained(model_dir)  # {arch}
batch = tokenizer(["the text to continue"], return_tensors="pt")
out = model.generate(**batch, do_sample=False, max_new_tokens=40)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
```"""
    raise QkvError(f"internal: no card code for {arch}")
