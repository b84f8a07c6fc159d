"""``qkv import`` is total: hostile and malformed Hugging Face folders end in one line naming the file and
the field (or tensor), exit status 2 and nothing written, never a traceback; a harmless change imports.

Tiny valid folders are built with transformers' own classes and ``save_pretrained`` (BertForMaskedLM,
BertForSequenceClassification, a sentence-transformers folder over a BertModel, GPT2LMHeadModel,
MarianMTModel, LlamaForCausalLM, T5ForConditionalGeneration, RobertaForMaskedLM,
BartForConditionalGeneration), then each case changes one thing: a config field set to 0, -1, null, a string, a huge
number, a fraction, a size that contradicts the weights; a file emptied, truncated, replaced by ``[]``,
garbage or a 200,000-deep JSON; the weights cast to int8 or bool, NaN or inf put in one tensor, a tensor
removed, transposed or cut, a layer added; a pickle that would run code; a sharded index that points at
config.json, outside the folder, or at a shard without its tensor; a broken tokenizer.json, vocab.json,
modules.json, Pooling config, ... The import runs in-process (``qkv.cli.main``); a few cases run the
real command in a subprocess for its exit status and stderr, and ``qkv.load`` takes the same checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers", reason="pip install -c constraints.txt -e '.[pretrained]'")
transformers = pytest.importorskip("transformers", reason="pip install -c constraints.txt -e '.[export]'")

from safetensors.torch import load_file, save_file  # noqa: E402

import qkv  # noqa: E402
from encoder_families import sentence_transformers_layout  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.errors import QkvError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEEP = b"[" * 200_000 + b"]" * 200_000
HUGE = 10**12


@pytest.fixture(scope="module", autouse=True)
def one_parser():
    """``qkv.cli.main`` as it is, with its argument parser built once for the module: building it is
    most of an in-process run's time, and nothing here changes it."""
    import qkv.cli

    built = {}

    def cached(handlers):
        if "parser" not in built:
            built["parser"] = real(handlers)
        return built["parser"]

    real = qkv.cli.build_parser
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qkv.cli, "build_parser", cached)
        yield


# --- the valid folders ---------------------------------------------------------------------------------

def _bert(path: Path, arch: str, **config) -> Path:
    from test_import_bert import bert_folder

    bert_folder(path, arch, **config)
    return path


def _sentence_transformers(path: Path) -> Path:
    """A BertModel with modules.json, Pooling (mean) and Normalize, as sentence-transformers lays it out."""
    _bert(path, "BertModel")
    sentence_transformers_layout(path, 32)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from test_import_bart import build_bart
    from test_import_gpt2 import build_gpt2
    from test_import_llama import build as build_llama
    from test_import_marian import build_marian
    from test_import_roberta import folder as roberta_folder
    from test_import_t5 import build as build_t5

    root = tmp_path_factory.mktemp("valid")
    return {
        "bert": _bert(root / "bert", "BertForMaskedLM"),
        "clf": _bert(root / "clf", "BertForSequenceClassification", num_labels=3,
                     id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2}),
        "st": _sentence_transformers(root / "st"),
        "gpt2": build_gpt2(root / "gpt2", train_steps=0),
        "marian": build_marian(root / "marian", train_steps=0),
        "llama": build_llama(root / "llama", "LlamaForCausalLM"),
        "t5": build_t5(root / "t5", "v1.1"),
        "roberta": roberta_folder(root / "roberta", "Roberta", "ForMaskedLM")[0],
        "bart": build_bart(root / "bart", train_steps=0)[0],
    }


# --- mutations: each takes the copied folder --------------------------------------------------------------

def field(name: str, value, file: str = "config.json"):
    def mutate(d: Path):
        data = json.loads((d / file).read_text())
        data[name] = value
        (d / file).write_text(json.dumps(data))
    return mutate


def contents(file: str, data: bytes | None):
    """``file`` replaced by ``data`` (None: removed)."""
    def mutate(d: Path):
        if data is None:
            (d / file).unlink()
        else:
            (d / file).write_bytes(data)
    return mutate


def special(file: str, kind: str):
    """``file`` replaced by a directory or a FIFO (reading a FIFO would wait for ever)."""
    def mutate(d: Path):
        (d / file).unlink()
        os.mkdir(d / file) if kind == "dir" else os.mkfifo(d / file)
    return mutate


def truncated(file: str):
    def mutate(d: Path):
        raw = (d / file).read_bytes()
        (d / file).write_bytes(raw[: len(raw) // 2])
    return mutate


def tensors(change):
    """model.safetensors rewritten with ``change(dict of tensors)``."""
    def mutate(d: Path):
        w = load_file(str(d / "model.safetensors"))
        save_file(change(dict(w)), str(d / "model.safetensors"))
    return mutate


def biggest(w: dict) -> str:
    return max((k for k in w if w[k].dim() == 2 and w[k].shape[0] != w[k].shape[1]), key=lambda k: w[k].numel())


def poke(value: float):
    def change(w):
        k = sorted(w)[len(w) // 2]
        w[k] = w[k].clone()
        w[k].view(-1)[0] = value
        return w
    return change


def transposed(w):
    k = biggest(w)
    w[k] = w[k].t().contiguous()
    return w


def cut(w):
    k = biggest(w)
    w[k] = w[k][:-1].contiguous()
    return w


def removed(w):
    del w[sorted(w)[len(w) // 2]]
    return w


def extra_block(w):
    """A T5 block added (its layers are the sub-layers of a block)."""
    for k in sorted(w):
        if ".block.1." in k:
            w[k.replace(".block.1.", ".block.7.")] = w[k].clone()
            return w
    raise AssertionError("no block 1")


def extra_layer(w):
    for k in sorted(w):
        for pattern in (".layer.1.", ".h.1.", ".layers.1."):
            if pattern in "." + k:
                w[k.replace(pattern.strip("."), pattern.strip(".").replace("1", "7"))] = w[k].clone()
                return w
    raise AssertionError("no layer 1")


def to_bin(extra=None):
    """The weights as pytorch_model.bin (``extra(dict)`` applied), model.safetensors removed."""
    def mutate(d: Path):
        w = load_file(str(d / "model.safetensors"))
        (d / "model.safetensors").unlink()
        torch.save(extra(w) if extra else w, d / "pytorch_model.bin")
    return mutate


def bin_contents(data: bytes):
    def mutate(d: Path):
        (d / "model.safetensors").unlink()
        (d / "pytorch_model.bin").write_bytes(data)
    return mutate


class RunsCode:
    """Unpickled, it would create the file ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def malicious_bin(d: Path):
    w = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    w["payload"] = RunsCode(str(d.parent / "PWNED"))
    torch.save(w, d / "pytorch_model.bin")


def sharded(weight_map=None, index=None, shard_change=None, pickled=False):
    """The weights in two shards with a model.safetensors.index.json (``pickled``: pytorch_model-*.bin
    shards and pytorch_model.bin.index.json); ``weight_map(map)`` changes the map, ``index`` replaces
    the index's bytes, ``shard_change`` changes the second shard's tensors."""
    def mutate(d: Path):
        w = load_file(str(d / "model.safetensors"))
        (d / "model.safetensors").unlink()
        names = sorted(w)
        stem, ext = ("pytorch_model", "bin") if pickled else ("model", "safetensors")
        half = {f"{stem}-00001-of-00002.{ext}": names[: len(names) // 2],
                f"{stem}-00002-of-00002.{ext}": names[len(names) // 2:]}
        wm = {}
        for shard, keys in half.items():
            part = {k: w[k] for k in keys}
            if shard_change and "-00002-" in shard:
                part = shard_change(part)
            torch.save(part, d / shard) if pickled else save_file(part, str(d / shard))
            wm.update({k: shard for k in keys})
        data = {"metadata": {"total_size": 0}, "weight_map": weight_map(wm) if weight_map else wm}
        (d / f"{stem}.{ext}.index.json").write_bytes(index if index is not None else json.dumps(data).encode())
    return mutate


def point_one(target: str):
    def change(wm):
        wm[sorted(wm)[0]] = target
        return wm
    return change


def bert_post_processor(value):
    def mutate(d: Path):
        data = json.loads((d / "tokenizer.json").read_text())
        data["post_processor"] = value
        (d / "tokenizer.json").write_text(json.dumps(data))
    return mutate


def modules(value):
    return contents("modules.json", json.dumps(value).encode())


# --- the cases: (name, folder, mutation, expected status (None: 0 or 2), words the message must name) -------

INT_VALUES = [("0", 0), ("neg", -1), ("null", None), ("str", "64"), ("huge", HUGE), ("frac", 2.5), ("bool", True)]
FLOAT_VALUES = [("neg", -1.0), ("big", 2.0), ("str", "0.1"), ("list", [0.1])]
INT_FIELDS = {
    "bert": ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
             "type_vocab_size", "vocab_size"],
    "gpt2": ["n_embd", "n_head", "n_layer", "n_positions", "n_inner", "vocab_size", "eos_token_id"],
    "marian": ["d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
               "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings", "vocab_size",
               "decoder_start_token_id"],
}
FLOAT_FIELDS = {"bert": ["hidden_dropout_prob", "layer_norm_eps"], "gpt2": ["attn_pdrop", "layer_norm_epsilon"],
                "marian": ["dropout"]}
# a valid size that contradicts the weights: refused naming the field and the tensor
DISAGREE = {"bert": {"hidden_size": 64, "intermediate_size": 40, "max_position_embeddings": 80, "num_hidden_layers": 3,
                     "type_vocab_size": 3, "vocab_size": 300},
            "gpt2": {"n_embd": 64, "n_inner": 40, "n_positions": 80, "n_layer": 3, "vocab_size": 3000},
            "marian": {"d_model": 64, "encoder_ffn_dim": 40, "decoder_ffn_dim": 40, "encoder_ffn_dim,decoder_ffn_dim": 40,
                       "encoder_layers": 3, "decoder_layers": 1}}
# the families added on the one stack: fewer values per field (each kind of value once)
NEW_INT_VALUES = [("0", 0), ("str", "64"), ("huge", HUGE), ("null", None)]
NEW_INT_FIELDS = {
    "llama": ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
              "max_position_embeddings", "vocab_size"],
    "t5": ["d_model", "num_heads", "d_kv", "d_ff", "num_layers", "relative_attention_num_buckets", "vocab_size"],
    "roberta": ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                "max_position_embeddings", "vocab_size"],
    "bart": ["d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
             "max_position_embeddings", "vocab_size"],
}
NEW_FLOAT_FIELDS = {"llama": ["rms_norm_eps"], "t5": ["dropout_rate", "layer_norm_epsilon"],
                    "roberta": ["layer_norm_eps"], "bart": ["dropout"]}
DISAGREE.update({
    "llama": {"hidden_size": 128, "intermediate_size": 40, "num_hidden_layers": 3, "num_key_value_heads": 4,
              "vocab_size": 3000},
    "t5": {"d_ff": 40, "num_layers": 3, "relative_attention_num_buckets": 16, "vocab_size": 3000},
    "roberta": {"hidden_size": 64, "intermediate_size": 40, "num_hidden_layers": 3, "max_position_embeddings": 80,
                "vocab_size": 3000},
    "bart": {"d_model": 64, "encoder_ffn_dim,decoder_ffn_dim": 40, "encoder_layers": 3, "max_position_embeddings": 80,
             "vocab_size": 3000},
})
NEW_FAMILIES = tuple(NEW_INT_FIELDS)
OPTIONAL = {("gpt2", f) for f in ("n_embd", "n_head", "n_layer", "n_positions", "n_inner", "eos_token_id")} | \
    {("marian", f) for f in ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                             "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
                             "decoder_start_token_id")} | {("bert", "type_vocab_size"), ("bert", "vocab_size"),
                                                           ("gpt2", "vocab_size")}


def _cases():
    cases = []
    for fam, names in INT_FIELDS.items():
        for name in names:
            for label, value in INT_VALUES:
                harmless = value is None and (fam, name) in OPTIONAL or (fam, name, value) == ("gpt2", "eos_token_id", 0)
                cases.append((f"{fam}-{name}-{label}", fam, field(name, value), None if harmless else 2,
                              [] if harmless else ["config.json", name]))
    for fam, names in FLOAT_FIELDS.items():
        for name in names:
            for label, value in FLOAT_VALUES:
                cases.append((f"{fam}-{name}-{label}", fam, field(name, value), 2, ["config.json", name]))
    for fam, names in NEW_INT_FIELDS.items():
        for name in names:
            for label, value in NEW_INT_VALUES:
                # null is the field's default in these families (required ones fail on the weights' shapes)
                cases.append((f"{fam}-{name}-{label}", fam, field(name, value), None if value is None else 2,
                              [] if value is None else ["config.json", name]))
    for fam, names in NEW_FLOAT_FIELDS.items():
        for name in names:
            for label, value in FLOAT_VALUES[::2] + [("big", 2.0)]:
                cases.append((f"{fam}-{name}-{label}", fam, field(name, value), 2, ["config.json", name]))
    for fam, sizes in DISAGREE.items():
        for names, value in sizes.items():
            def both(d: Path, names=names, value=value):
                for n in names.split(","):
                    field(n, value)(d)
            words = ["config.json", names.split(",")[0]]
            cases.append((f"{fam}-{names}-disagrees", fam, both, 2, words))
    for fam in ("bert", "gpt2", "marian", "st", *NEW_FAMILIES):
        cfg = "config.json"
        cases += [
            (f"{fam}-config-empty", fam, contents(cfg, b""), 2, [cfg]),
            (f"{fam}-config-list", fam, contents(cfg, b"[]"), 2, [cfg]),
            (f"{fam}-config-garbage", fam, contents(cfg, b"\x00\xff garbage {"), 2, [cfg]),
            (f"{fam}-config-deep", fam, contents(cfg, DEEP), 2, [cfg]),
            (f"{fam}-config-number", fam, contents(cfg, b"1e999"), 2, [cfg]),
            (f"{fam}-config-missing", fam, contents(cfg, None), 2, [cfg]),
            (f"{fam}-config-truncated", fam, truncated(cfg), 2, [cfg]),
            (f"{fam}-config-directory", fam, special(cfg, "dir"), 2, [cfg]),
            (f"{fam}-architectures-string", fam, field("architectures", "BertModel"), 2, [cfg, "architectures"]),
            (f"{fam}-architectures-unknown", fam, field("architectures", ["Nope"]), 2, [cfg, "Nope"]),
        ]
    for fam in ("bert", "gpt2", "marian"):
        st = "model.safetensors"
        cases += [
            (f"{fam}-weights-int8", fam, tensors(lambda w: {k: v.to(torch.int8) for k, v in w.items()}), 2, [st, "int8"]),
            (f"{fam}-weights-bool", fam, tensors(lambda w: {k: v > 0 for k, v in w.items()}), 2, [st, "bool"]),
            (f"{fam}-weights-one-int64", fam, tensors(lambda w: {**w, biggest(w): w[biggest(w)].long()}), 2,
             [st, "int64"]),
            (f"{fam}-weights-nan", fam, tensors(poke(float("nan"))), 2, [st, "NaN"]),
            (f"{fam}-weights-inf", fam, tensors(poke(float("-inf"))), 2, [st, "inf"]),
            (f"{fam}-weights-removed", fam, tensors(removed), 2, ["tensor"]),
            (f"{fam}-weights-transposed", fam, tensors(transposed), 2, [st, "tensor", "config.json"]),
            (f"{fam}-weights-cut", fam, tensors(cut), 2, [st]),
            (f"{fam}-weights-extra-layer", fam, tensors(extra_layer), 2, ["layers", "config.json"]),
            (f"{fam}-weights-float16", fam, tensors(lambda w: {k: v.half() for k, v in w.items()}), 0, []),
            (f"{fam}-weights-bfloat16", fam, tensors(lambda w: {k: v.bfloat16() for k, v in w.items()}), 0, []),
            (f"{fam}-weights-no-tensors", fam, tensors(lambda w: {}), 2, [st]),
            (f"{fam}-weights-empty", fam, contents(st, b""), 2, [st]),
            (f"{fam}-weights-truncated", fam, truncated(st), 2, [st]),
            (f"{fam}-weights-garbage", fam, contents(st, b"\xff" * 64), 2, [st]),
            (f"{fam}-weights-is-json", fam, contents(st, b'{"a": 1}'), 2, [st]),
            (f"{fam}-weights-missing", fam, contents(st, None), 2, ["no weights"]),
            (f"{fam}-weights-fifo", fam, special(st, "fifo"), 2, [st]),
            (f"{fam}-bin", fam, to_bin(), 0, []),
            (f"{fam}-bin-nan", fam, to_bin(poke(float("nan"))), 2, ["pytorch_model.bin", "NaN"]),
            (f"{fam}-bin-int", fam, to_bin(lambda w: {k: v.int() for k, v in w.items()}), 2,
             ["pytorch_model.bin", "int32"]),
            (f"{fam}-bin-list", fam, to_bin(lambda w: list(w.values())), 2, ["pytorch_model.bin"]),
            (f"{fam}-bin-not-a-tensor", fam, to_bin(lambda w: {k: 1.0 for k in w}), 2, ["pytorch_model.bin"]),
            (f"{fam}-bin-empty", fam, bin_contents(b""), 2, ["pytorch_model.bin"]),
            (f"{fam}-bin-garbage", fam, bin_contents(b"\x80\x02garbage"), 2, ["pytorch_model.bin"]),
            (f"{fam}-bin-zip-garbage", fam, bin_contents(b"PK\x03\x04" + b"\x00" * 40), 2, ["pytorch_model.bin"]),
            (f"{fam}-bin-pickle", fam, malicious_bin, 2, ["pytorch_model.bin", "pickle can run code"]),
            (f"{fam}-sharded", fam, sharded(), 0, []),
            (f"{fam}-index-to-config", fam, sharded(point_one("config.json")), 2,
             ["model.safetensors.index.json", "weight_map"]),
            (f"{fam}-index-outside", fam, sharded(point_one("../model.safetensors")), 2,
             ["model.safetensors.index.json"]),
            (f"{fam}-index-missing-shard", fam, sharded(point_one("model-00009-of-00009.safetensors")), 2,
             ["model-00009-of-00009.safetensors"]),
            (f"{fam}-index-wrong-shard", fam, sharded(point_one("model-00002-of-00002.safetensors")), 2,
             ["model.safetensors.index.json", "does not hold"]),
            (f"{fam}-index-map-list", fam, sharded(lambda wm: list(wm)), 2, ["weight_map"]),
            (f"{fam}-index-map-number", fam, sharded(lambda wm: {k: 3 for k in wm}), 2, ["weight_map"]),
            (f"{fam}-index-list", fam, sharded(index=b"[]"), 2, ["model.safetensors.index.json"]),
            (f"{fam}-index-deep", fam, sharded(index=DEEP), 2, ["model.safetensors.index.json"]),
            (f"{fam}-index-empty", fam, sharded(index=b""), 2, ["model.safetensors.index.json"]),
            (f"{fam}-shard-int", fam, sharded(shard_change=lambda w: {k: v.short() for k, v in w.items()}), 2,
             ["model-00002-of-00002.safetensors", "int16"]),
        ]
    for fam in NEW_FAMILIES:
        st, tj = "model.safetensors", "tokenizer.json"
        cases += [
            (f"{fam}-weights-int8", fam, tensors(lambda w: {k: v.to(torch.int8) for k, v in w.items()}), 2, [st, "int8"]),
            (f"{fam}-weights-nan", fam, tensors(poke(float("nan"))), 2, [st, "NaN"]),
            (f"{fam}-weights-removed", fam, tensors(removed), 2, ["tensor"]),
            (f"{fam}-weights-transposed", fam, tensors(transposed), 2, [st, "tensor", "config.json"]),
            (f"{fam}-weights-cut", fam, tensors(cut), 2, [st]),
            (f"{fam}-weights-extra-layer", fam, tensors(extra_block if fam == "t5" else extra_layer), 2,
             ["layers", "config.json"]),
            (f"{fam}-weights-float16", fam, tensors(lambda w: {k: v.half() for k, v in w.items()}), 0, []),
            (f"{fam}-bin-pickle", fam, malicious_bin, 2, ["pytorch_model.bin", "pickle can run code"]),
            (f"{fam}-tokenizer-empty", fam, contents(tj, b""), 2, [tj]),
            (f"{fam}-tokenizer-no-model", fam, contents(tj, b'{"model": {}}'), 2, [tj]),
            (f"{fam}-tokenizer-missing", fam, contents(tj, None), 2, [tj]),
        ]
    for fam in ("bert", "gpt2"):
        tj = "tokenizer.json"
        cases += [
            (f"{fam}-tokenizer-empty", fam, contents(tj, b""), 2, [tj]),
            (f"{fam}-tokenizer-list", fam, contents(tj, b"[]"), 2, [tj]),
            (f"{fam}-tokenizer-object", fam, contents(tj, b"{}"), 2, [tj]),
            (f"{fam}-tokenizer-no-model", fam, contents(tj, b'{"model": {}}'), 2, [tj]),
            (f"{fam}-tokenizer-garbage", fam, contents(tj, b"\xff\xfe\x00"), 2, [tj]),
            (f"{fam}-tokenizer-deep", fam, contents(tj, DEEP), 2, [tj]),
            (f"{fam}-tokenizer-truncated", fam, truncated(tj), 2, [tj]),
            (f"{fam}-tokenizer-missing", fam, contents(tj, None), 2, [tj]),
            (f"{fam}-tokenizer-fifo", fam, special(tj, "fifo"), 2, [tj]),
        ]
    cases += [
        ("bert-bin-sharded", "bert", sharded(pickled=True), 0, []),
        ("bert-bin-index-to-config", "bert", sharded(point_one("config.json"), pickled=True), 2,
         ["pytorch_model.bin.index.json", "weight_map"]),
        ("bert-bin-shard-nan", "bert", sharded(shard_change=poke(float("nan")), pickled=True), 2,
         ["pytorch_model-00002-of-00002.bin", "NaN"]),
        ("bert-post-processor-list", "bert", bert_post_processor([]), 2, ["tokenizer.json"]),
        ("bert-post-processor-bad-id", "bert", bert_post_processor(
            {"type": "BertProcessing", "cls": ["[CLS]", 99999], "sep": ["[SEP]", 3]}), 2, ["tokenizer.json"]),
        ("bert-post-processor-no-ids", "bert", bert_post_processor({"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "[CLS]", "type_id": 0}}], "pair": [], "special_tokens": {}}), 2, ["tokenizer.json"]),
        ("bert-post-processor-unknown", "bert", bert_post_processor({"type": "RobertaProcessing"}), 2, ["tokenizer.json"]),
        ("bert-special-tokens-list", "bert", contents("special_tokens_map.json", b"[]"), None, []),
        ("bert-special-tokens-deep", "bert", contents("special_tokens_map.json", DEEP), 2, ["special_tokens_map.json"]),
        ("bert-special-tokens-unknown", "bert", field("cls_token", "[NOPE]", "tokenizer_config.json"), 2,
         ["[NOPE]"]),
        ("bert-tokenizer-config-deep", "bert", contents("tokenizer_config.json", DEEP), 2, ["tokenizer_config.json"]),
        ("clf-id2label-list", "clf", field("id2label", ["a", "b"]), 2, ["config.json", "id2label"]),
        ("clf-id2label-string", "clf", field("id2label", "x"), 2, ["config.json", "id2label"]),
        ("clf-id2label-null-name", "clf", field("id2label", {"0": None, "1": "a", "2": "b"}), 2, ["id2label"]),
        ("clf-id2label-twice", "clf", field("id2label", {"0": "a", "1": "a", "2": "b"}), 2, ["id2label"]),
        ("clf-id2label-two", "clf", field("id2label", {"0": "a", "1": "b"}), 2, ["classifier", "id2label"]),
        ("clf-num-labels-huge", "clf", field("num_labels", HUGE), 2, ["num_labels"]),
        ("clf-problem-type-list", "clf", field("problem_type", []), 2, ["problem_type"]),
        ("llama-rope-parameters-list", "llama", field("rope_parameters", [1]), 2, ["config.json", "rope_parameters"]),
        ("llama-rope-theta-str", "llama", field("rope_parameters", {"rope_type": "default", "rope_theta": "x"}), 2,
         ["config.json", "rope_theta"]),
        ("llama-eos-str", "llama", field("eos_token_id", "x"), 2, ["config.json", "eos_token_id"]),
        ("llama-kv-heads-not-dividing", "llama", field("num_key_value_heads", 3), 2,
         ["config.json", "num_key_value_heads"]),
        ("llama-act-number", "llama", field("hidden_act", 3), 2, ["config.json", "hidden_act"]),
        ("t5-feed-forward-number", "t5", field("feed_forward_proj", 3), 2, ["config.json", "feed_forward_proj"]),
        ("t5-eos-str", "t5", field("eos_token_id", "x"), 2, ["config.json", "eos_token_id"]),
        ("t5-start-str", "t5", field("decoder_start_token_id", "0"), 2, ["config.json", "decoder_start_token_id"]),
        ("t5-scale-outputs-str", "t5", field("scale_decoder_outputs", "no"), 2, ["config.json", "scale_decoder_outputs"]),
        ("roberta-pad-str", "roberta", field("pad_token_id", "1"), 2, ["config.json", "pad_token_id"]),
        ("roberta-post-processor-bad-id", "roberta", bert_post_processor(
            {"type": "RobertaProcessing", "cls": ["<s>", 99999], "sep": ["</s>", 2]}), 2, ["tokenizer.json"]),
        ("roberta-post-processor-sequence-deep", "roberta", bert_post_processor(
            {"type": "Sequence", "processors": {"a": 1}}), 2, ["tokenizer.json"]),
        ("bart-start-beyond", "bart", field("decoder_start_token_id", 99999), 2, ["config.json", "decoder_start_token_id"]),
        ("bart-scale-embedding-str", "bart", field("scale_embedding", "yes"), 2, ["config.json", "scale_embedding"]),
        ("bart-generation-beams-0", "bart", field("num_beams", 0, "generation_config.json"), 2,
         ["generation_config.json", "num_beams"]),
        ("bart-heads-differ", "bart", field("decoder_attention_heads", 2), 2, ["config.json", "decoder_attention_heads"]),
        ("gpt2-eos-beyond", "gpt2", field("eos_token_id", 99999), 2, ["config.json", "eos_token_id"]),
        ("marian-vocab-list", "marian", contents("vocab.json", b"[]"), 2, ["vocab.json"]),
        ("marian-vocab-deep", "marian", contents("vocab.json", DEEP), 2, ["vocab.json"]),
        ("marian-vocab-gap", "marian", contents("vocab.json", b'{"</s>": 0, "<unk>": 5, "<pad>": 2}'), 2, ["vocab.json"]),
        ("marian-vocab-missing", "marian", contents("vocab.json", None), 2, ["vocab.json"]),
        ("marian-source-spm-empty", "marian", contents("source.spm", b""), 2, ["source.spm"]),
        ("marian-target-spm-garbage", "marian", contents("target.spm", b"\x00garbage"), 2, ["target.spm"]),
        ("marian-generation-beams-0", "marian", field("num_beams", 0, "generation_config.json"), 2,
         ["generation_config.json", "num_beams"]),
        ("marian-generation-beams-str", "marian", field("num_beams", "4", "generation_config.json"), 2,
         ["generation_config.json", "num_beams"]),
        ("marian-generation-length-penalty", "marian", field("length_penalty", "x", "generation_config.json"), 2,
         ["generation_config.json", "length_penalty"]),
        ("marian-generation-deep", "marian", contents("generation_config.json", DEEP), 2, ["generation_config.json"]),
        ("marian-generation-list", "marian", contents("generation_config.json", b"[]"), 2, ["generation_config.json"]),
        ("marian-pad-is-eos", "marian", field("pad_token", "</s>", "tokenizer_config.json"), 2, ["pad"]),
        ("marian-tokenizer-config-list", "marian", contents("tokenizer_config.json", b"[]"), 2,
         ["tokenizer_config.json"]),
        ("st-modules-empty-list", "st", modules([]), 2, ["modules.json"]),
        ("st-modules-object", "st", modules({}), 2, ["modules.json"]),
        ("st-modules-numbers", "st", modules([1, 2]), 2, ["modules.json"]),
        ("st-modules-outside", "st", modules([{"type": "sentence_transformers.models.Transformer", "path": "../.."}]),
         2, ["modules.json", "path"]),
        ("st-modules-path-missing", "st", modules([{"type": "sentence_transformers.models.Transformer",
                                                    "path": "nope"}]), 2, ["modules.json", "nope"]),
        ("st-modules-path-number", "st", modules([{"type": "x", "path": 3}]), 2, ["modules.json", "path"]),
        ("st-modules-deep", "st", contents("modules.json", DEEP), 2, ["modules.json"]),
        ("st-modules-dense", "st", modules([{"type": "sentence_transformers.models.Transformer", "path": ""},
                                            {"type": "sentence_transformers.models.Dense", "path": "2_Normalize"}]),
         2, ["modules.json", "Dense"]),
        ("st-pooling-list", "st", contents("1_Pooling/config.json", b"[]"), 2, ["1_Pooling"]),
        ("st-pooling-missing", "st", contents("1_Pooling/config.json", None), 2, ["1_Pooling"]),
        ("st-pooling-max", "st", field("pooling_mode_max_tokens", True, "1_Pooling/config.json"), 2, ["pooling"]),
        ("st-pooling-mode-list", "st", field("pooling_mode", ["mean"], "1_Pooling/config.json"), 2, ["pooling"]),
        ("st-max-seq-str", "st", field("max_seq_length", "x", "sentence_bert_config.json"), 2,
         ["sentence_bert_config.json", "max_seq_length"]),
        ("st-max-seq-neg", "st", field("max_seq_length", -5, "sentence_bert_config.json"), 2,
         ["sentence_bert_config.json", "max_seq_length"]),
        ("st-settings-deep", "st", contents("sentence_bert_config.json", DEEP), 2, ["sentence_bert_config.json"]),
        ("st-lower-case-str", "st", field("do_lower_case", "yes", "sentence_bert_config.json"), 2, ["do_lower_case"]),
    ]
    return cases


CASES = _cases()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"not one line: {err!r}"
    assert "Traceback" not in err and "unexpected" not in err, err
    return lines[0]


def test_the_fuzz_set_is_large():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, family, mutate, status, words", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_folder_ends_in_one_line(folders, tmp_path, capsys, name, family, mutate, status, words):
    d = tmp_path / family
    shutil.copytree(folders[family], d)
    mutate(d)
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["import", str(d), "--out", str(out)])
    captured = capsys.readouterr()
    if status is not None:
        assert rc == status, f"{name}: status {rc}, stderr {captured.err!r}"
    assert rc in (0, 2), captured.err
    if rc == 0:
        assert captured.err.startswith("imported ") and len(captured.err.strip().splitlines()) == 1, captured.err
        assert (out / "manifest.json").is_file()
        return
    line = _one_line(captured.err)
    assert line.startswith("qkv import: error: ")
    for w in words:
        assert w in line, f"{name}: {w!r} not in {line!r}"
    assert "weights_only=False" not in line and "weights_only` set to `False" not in line
    assert not out.exists()  # nothing written, not even the directory
    assert not (tmp_path / "PWNED").exists()  # the pickle's code never ran
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())  # no half-written temporary either


# every 5th refused case (and each case of a broken config.json, pickle or index): qkv.load of the folder,
# the in-memory conversion
LOAD_CASES = [c for i, c in enumerate(CASES) if c[3] == 2 and (i % 5 == 0 or any(
    w in c[0] for w in ("-config-", "pickle", "index")))]


@pytest.mark.parametrize("name, family, mutate, status, words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_of_a_malformed_folder_is_refused_in_one_line(folders, tmp_path, name, family, mutate, status, words):
    d = tmp_path / family
    shutil.copytree(folders[family], d)
    mutate(d)
    with pytest.raises(QkvError) as e:
        qkv.load(d)
    message = str(e.value)
    assert "\n" not in message and "unexpected" not in message, message
    assert all(w in message for w in words), f"{name}: {words} not all in {message!r}"
    assert not (tmp_path / "PWNED").exists()
    assert not (d / "manifest.json").exists()


@pytest.mark.parametrize("name", ["bert-bin-empty", "gpt2-weights-int8", "marian-bin-pickle", "bert-hidden_size-disagrees"])
def test_the_command_exits_2_with_one_line_on_stderr(folders, tmp_path, name):
    """The real command, in a subprocess: exit status 2, one line on stderr, nothing on stdout."""
    _, family, mutate, _, words = next(c for c in CASES if c[0] == name)
    d = tmp_path / family
    shutil.copytree(folders[family], d)
    mutate(d)
    env = {**os.environ, "PYTHONPATH": str(Path(qkv.__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "qkv", "import", str(d), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    line = _one_line(r.stderr)
    assert all(w in line for w in words), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "PWNED").exists()


def test_the_messages_name_both_sides(folders, tmp_path, capsys):
    """A config that contradicts its weights names the config's field and the weights' tensor and file;
    an int8 folder names its tensor; a pickle's refusal says why and gives no unsafe advice."""
    def run(family, mutate):
        d = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folders[family], d)
        mutate(d)
        assert main(["import", str(d), "--out", str(tmp_path / "never")]) == 2
        return _one_line(capsys.readouterr().err)

    line = run("bert", field("hidden_size", 64))
    assert "config.json's hidden_size = 64" in line and "model.safetensors: tensor 'embeddings." in line
    assert "is 32" in line or "x 32" in line  # what the weights hold
    line = run("gpt2", tensors(lambda w: {k: v.to(torch.int8) for k, v in w.items()}))
    assert "is int8: model weights must be floating point" in line
    line = run("bert", malicious_bin)
    assert "a pickle can run code" in line and "qkv reads only tensors" in line
    assert "posix.system" in line or "os.system" in line  # what it asked for
    assert "weights_only" not in line
