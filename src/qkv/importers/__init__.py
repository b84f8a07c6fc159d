"""``qkv import HF_DIR --out CKPT``: a pretrained model from a local Hugging Face folder as a qkv checkpoint.

The folder's ``config.json`` names the architecture (``architectures``, else ``model_type``); a
sentence-transformers folder (``modules.json``) is a BERT-family encoder with its pooling. Each family
has a converter module (``bert``, ...) with

    ARCHITECTURES: the names it converts (``config.json``'s ``architectures``)
    MODEL_TYPES:   the ``model_type`` values it converts
    convert(folder, config, architecture) -> Imported

that reads the weights and tokenizer, builds a :class:`~qkv.config.ModelConfig` of the options the
model needs (every option it cannot express is refused by name, never converted approximately) and
returns the qkv model, its tokenizer pair and the config.json entries to save. :func:`import_model`
writes them as an ordinary checkpoint directory, which every qkv command takes.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError

# converter modules, in the order they are asked
FAMILIES = ("qkv.importers.bert", "qkv.importers.marian", "qkv.importers.gpt2", "qkv.importers.roberta",
            "qkv.importers.distilbert", "qkv.importers.albert", "qkv.importers.electra", "qkv.importers.bart")


class ImportRefused(QkvError):
    """The folder holds a model (or an option of one) qkv does not convert; the message names it."""


@dataclass
class Imported:
    model: torch.nn.Module
    model_cfg: Any  # ModelConfig
    tokenizers: Any  # TokenizerPair
    train_cfg: Any = None  # TrainConfig (max_len from the model), None: the defaults
    extra: dict = field(default_factory=dict)  # config.json entries (labels, sentence_embedding, imported)
    source: str = ""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise QkvError(f"{path}: not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QkvError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise QkvError(f"{path}: expected a JSON object")
    return data


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights: model.safetensors (or its sharded index), else pytorch_model.bin (read with
    ``weights_only``: tensors, never pickled code)."""
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        try:
            return load_file(str(single))
        except Exception as e:  # safetensors' own error types
            raise QkvError(f"{single}: not a readable safetensors file ({e})") from None
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        out: dict[str, torch.Tensor] = {}
        for name in shards:
            out.update(load_file(str(folder / name)))
        return out
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise QkvError(f"{pt}: not a readable PyTorch state dict ({str(e).splitlines()[0]})") from None
    raise QkvError(f"{folder}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def model_folder(folder: Path) -> tuple[Path, dict | None]:
    """The folder with config.json and the sentence-transformers modules.json (None: not such a folder)."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return folder, None
    try:
        listed = json.loads(modules.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QkvError(f"{modules}: not valid JSON ({e})") from None
    if not isinstance(listed, list) or not listed:
        raise QkvError(f"{modules}: expected a list of modules")
    return folder / listed[0].get("path", ""), {"modules": listed}


def convert(folder: str | Path) -> Imported:
    """The qkv model of the Hugging Face folder ``folder`` (see the module's docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QkvError(f"{folder}: no such folder (give a local Hugging Face model folder)")
    base, sentence = model_folder(folder)
    config = read_json(base / "config.json")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    for name in FAMILIES:
        family = importlib.import_module(name)
        arch = next((a for a in architectures if a in family.ARCHITECTURES), None)
        if arch is None and not architectures and model_type in family.MODEL_TYPES:
            arch = family.DEFAULT_ARCHITECTURE
        if arch is None and model_type in family.MODEL_TYPES:
            raise ImportRefused(f"{base / 'config.json'}: architecture {', '.join(map(str, architectures))} of "
                                f"model_type {model_type!r} is not supported; qkv imports {', '.join(family.ARCHITECTURES)}")
        if arch is not None:
            return family.convert(folder, base, config, arch, sentence)
    known = [a for n in FAMILIES for a in importlib.import_module(n).ARCHITECTURES]
    what = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    raise ImportRefused(f"{base / 'config.json'}: {what} is not supported; qkv imports {', '.join(known)}")


def import_model(folder: str | Path, out: str | Path, log=print) -> Path:
    """Convert ``folder`` and write the qkv checkpoint directory ``out`` (a new or empty directory)."""
    from dataclasses import asdict

    from qkv.checkpoint import save_checkpoint
    from qkv.config import DecodeConfig, TrainConfig
    from qkv.files import check_output_dir

    out = Path(out)
    check_output_dir(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QkvError(f"--out {out} exists and is not empty: give a new directory (an import never overwrites one)")
    start = time.perf_counter()
    imported = convert(folder)
    train_cfg = imported.train_cfg or TrainConfig()
    config = {"model": asdict(imported.model_cfg), "train": asdict(train_cfg), "decode": asdict(DecodeConfig()),
              "imported": {"from": str(Path(folder).resolve()), "architecture": imported.source},
              **imported.extra}
    save_checkpoint(out, imported.model, config, write_extra=imported.tokenizers.save)
    log(f"imported {imported.source} from {folder} into {out} ({sum(p.numel() for p in imported.model.parameters()):,}"
        f" parameters, task {imported.model_cfg.task}) in {time.perf_counter() - start:.1f} s")
    return out
