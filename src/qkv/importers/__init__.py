"""``qkv import HF_DIR --out CKPT``: a pretrained model from a local Hugging Face folder as a qkv checkpoint.

The folder's ``config.json`` names the architecture (``architectures``, else ``model_type``); a
sentence-transformers folder (``modules.json``) is a BERT-family encoder with its pooling. Each family
has a converter module (``bert``, ...) with

    ARCHITECTURES: the names it converts (``config.json``'s ``architectures``)
    MODEL_TYPES:   the ``model_type`` values it converts
    convert(folder, base, config, architecture, sentence) -> Imported

that reads the weights and tokenizer, builds a :class:`~qkv.config.ModelConfig` of the options the
model needs (every option it cannot express is refused by name, never converted approximately) and
returns the qkv model, its tokenizer pair and the config.json entries to save. :func:`import_model`
writes them as an ordinary checkpoint directory, which every qkv command takes.

A converter reads the folder through :mod:`qkv.importers.folder` (``Config(config, path)`` or
``read_config``, ``read_weights`` and ``Weights.take``, ``read_tokenizer_json``), which refuses every
malformed file in one line naming the file and the field or tensor, before any model is built: an
import ends in a checkpoint or in that line (exit status 2), never in a traceback.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.importers.folder import Config, FolderError, Weights, read_config, read_tokenizer_json  # noqa: F401

# converter modules, in the order they are asked
FAMILIES = ("qkv.importers.bert", "qkv.importers.marian", "qkv.importers.gpt2", "qkv.importers.llama",
            "qkv.importers.t5", "qkv.importers.roberta", "qkv.importers.distilbert", "qkv.importers.albert",
            "qkv.importers.electra", "qkv.importers.bart")
# a folder with modules.json (model_folder): its first module is a folder of one of the FAMILIES
SENTENCE_TRANSFORMERS = ("a sentence-transformers folder (modules.json) of a BERT-family encoder, with its "
                         "pooling (mean or cls) and normalisation")


def families() -> list[tuple[str, tuple[str, ...]]]:
    """What ``qkv import`` converts, read from the converter modules of :data:`FAMILIES` in the order they
    are asked: each one's ``model_type`` values (joined) and ``ARCHITECTURES`` (``qkv import --help``)."""
    out = []
    for name in FAMILIES:
        family = importlib.import_module(name)
        out.append((", ".join(family.MODEL_TYPES), tuple(family.ARCHITECTURES)))
    return out


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
    """A JSON object file of the folder, checked (:func:`qkv.importers.folder.read_json`)."""
    from qkv.importers.folder import read_json as read

    return read(path)


def read_weights(folder: Path, config=None):
    """The folder's weights (:func:`qkv.importers.folder.read_weights`: a :class:`~qkv.importers.folder.Weights`,
    whose ``take`` checks each tensor's dtype, finiteness and shape)."""
    from qkv.importers.folder import read_weights as read

    return read(folder, config)


def model_folder(folder: Path) -> tuple[Path, dict | None]:
    """The folder with config.json and the sentence-transformers modules.json (None: not such a folder)."""
    from qkv.importers.folder import FolderError, read_json as read

    modules = folder / "modules.json"
    if not modules.is_file():
        return folder, None
    listed = read(modules, list)
    if not listed:
        raise FolderError(f"{modules}: expected a list of modules, got an empty list")
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict):
            raise FolderError(f"{modules}: module {i} must be an object (with 'type' and 'path')")
        for key in ("type", "path"):
            if not isinstance(entry.get(key, ""), str):
                raise FolderError(f"{modules}: module {i}'s {key} must be a string")
        path = entry.get("path", "")
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise FolderError(f"{modules}: module {i}'s path {path!r} must be a folder inside the model's folder")
    base = folder / listed[0].get("path", "")
    if not base.is_dir():
        raise FolderError(f"{modules}: module 0's path {listed[0].get('path')!r} is not a folder of {folder}")
    return base, {"modules": listed}


def convert(folder: str | Path) -> Imported:
    """The qkv model of the Hugging Face folder ``folder`` (see the module's docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QkvError(f"{folder}: no such folder (give a local Hugging Face model folder)")
    base, sentence = model_folder(folder)
    config = read_json(base / "config.json")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise FolderError(f"{base / 'config.json'}: architectures must be a list of names")
    if model_type is not None and not isinstance(model_type, str):
        raise FolderError(f"{base / 'config.json'}: model_type must be a string")
    for name in FAMILIES:
        family = importlib.import_module(name)
        arch = next((a for a in architectures if a in family.ARCHITECTURES), None)
        if arch is None and not architectures and model_type in family.MODEL_TYPES:
            arch = family.DEFAULT_ARCHITECTURE
        if arch is None and model_type in family.MODEL_TYPES:
            why = next((f" ({why})" for a, why in getattr(family, "REFUSED", {}).items() if a in architectures), "")
            raise ImportRefused(f"{base / 'config.json'}: architecture {', '.join(map(str, architectures))} of "
                                f"model_type {model_type!r} is not supported{why}; qkv imports "
                                f"{', '.join(family.ARCHITECTURES)}")
        if arch is not None:
            return as_given(_converted(family, folder, base, config, arch, sentence))
    known = [a for n in FAMILIES for a in importlib.import_module(n).ARCHITECTURES]
    what = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    raise ImportRefused(f"{base / 'config.json'}: {what} is not supported; qkv imports {', '.join(known)}")


def as_given(imported: Imported) -> Imported:
    """An imported model reads its texts as given: qkv's own text cleaning (``clean_html``, <br /> ->
    space) belongs to the models trained with it, never to an import."""
    from dataclasses import replace

    from qkv.config import TrainConfig

    imported.train_cfg = replace(imported.train_cfg or TrainConfig(), clean_html=False)
    return imported


def _converted(family, folder: Path, base: Path, config: dict, arch: str, sentence: dict | None) -> Imported:
    """``family.convert(...)``: a malformed folder is refused by the converter (the checks of
    :mod:`qkv.importers.folder`); what slips past them still ends in one line naming the folder (the
    fuzz set of tests/test_import_fuzz.py checks that none does)."""
    try:
        return family.convert(folder, base, config, arch, sentence)
    except (QkvError, KeyboardInterrupt):
        raise
    except MemoryError:
        raise FolderError(f"{base / 'config.json'}: the model it describes does not fit in memory") from None
    except Exception as e:  # a converter's slip on a folder no check foresaw: one line, never a traceback
        lines = [s for s in str(e).splitlines() if s.strip()]
        raise FolderError(f"{base}: cannot be converted as {arch} (unexpected {type(e).__name__}: "
                          f"{lines[0][:200] if lines else ''})") from None


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
