"""Reading a Hugging Face model folder, checked: every importer reads its files through this module.

A folder is untrusted input. Whatever is wrong with it ends in one :class:`~qkv.errors.QkvError` line
that names the file and the field (or tensor), before anything is written; never a traceback.

    read_json(path)                 a JSON object (or list): unreadable, not JSON, nested too deep,
                                    or of the wrong kind is refused by file
    read_config(path) -> Config     config.json with typed getters that name file and field
                                    (``Config(dict, path)`` wraps the dict a converter is given):
        cfg.int("hidden_size")                  an integer >= 1 (at_least=, at_most=, default=)
        cfg.float("layer_norm_eps", 1e-12)      a finite number (at_least=, at_most=, below=)
        cfg.bool("tie_word_embeddings", True)   true or false
        cfg.str("hidden_act", "gelu")           a string (choices=)
        cfg.dict("id2label", {}) / cfg.list(..) an object / a list
        cfg.says("hidden_size", ...)            "config.json's hidden_size = 64" (for messages)
        cfg.refuse("what")                      raise ImportRefused("<path>: what") (not supported)
        cfg.error("what")                       raise FolderError("<path>: what") (malformed)
      (null counts as absent: the default if there is one, else "has no 'hidden_size'")
    read_weights(folder, cfg) -> Weights    model.safetensors, its sharded index, or pytorch_model.bin
                                    (tensors only: a pickle that asks for anything else is refused,
                                    saying why); an index must name shard files of the folder
        w.take(name, shape, fields)     the tensor as float32, checked: present, floating point,
                                        finite, and of ``shape`` (ints; None: any size), else refused
                                        naming the tensor, its file and config.json's ``fields``
        w.take(name, ..., default=None) the same, or ``default`` when the folder has no such tensor
        name in w, w.names()            what the folder holds (nothing checked)
        w.renamed(fn)                   the same tensors under fn(name) (a prefix, legacy names)
        w.check_layers(pattern, n, field)   the weights' layer count (a regex with one group: the
                                        layer index) equals config.json's ``field`` = n
        w.check_rows(name, rows, what)  the tensor has ``rows`` rows (e.g. the tokenizer's tokens)
    read_tokenizer_json(path) -> bytes  a tokenizer.json the tokenizers package reads
    load_state(model, state, cfg)       ``model.load_state_dict(state)``, a mismatch refused by name

:func:`qkv.importers.convert` runs a converter; anything that still escapes these checks ends in one
line naming the folder ("unexpected ..."), which tests/test_import_fuzz.py requires never to happen.

Converters take each tensor with :meth:`Weights.take` and the shape the config gives it, so that a
config that contradicts its weights is refused naming both, before any model is built.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError

REQUIRED = object()  # a getter's default: the field must be there
MAX_INT = 2**31 - 1  # no size, count or id of a model is larger
#: the logit of a row qkv adds to an imported vocabulary (PAD, <cls>, ... where the model has none): exp(-1e4)
#: is 0 in float32, finite so that a label-smoothed loss stays finite
ADDED_ROW_LOGIT = -1e4


def added_rows_bias(idmap) -> torch.Tensor:
    """An output bias for a model that has none of its own: 0 on the model's tokens, :data:`ADDED_ROW_LOGIT` on
    the rows qkv adds (``idmap``'s rows without a model id). Without it those rows would have logit 0 and take
    probability from every score and perplexity the model's own tokens get in transformers."""
    known = [m for m in idmap.model_ids if m is not None]
    return idmap.rows(torch.zeros(max(known) + 1), fill=ADDED_ROW_LOGIT).contiguous()


class FolderError(QkvError):
    """A file of the model folder is malformed: the message names the file and the field or tensor."""


def _refused(message: str) -> QkvError:
    from qkv.importers import ImportRefused

    return ImportRefused(message)


def _reason(e: BaseException) -> str:
    """The first non-empty line of an exception's message (its type when it has none)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


# --- JSON ---------------------------------------------------------------------------------------------

def parse_json(text: str | bytes, where: str | Path) -> Any:
    """``text`` as JSON; not JSON, or nested too deep for Python, refused naming ``where``."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise FolderError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise FolderError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise FolderError(f"{where}: JSON nested too deeply to read") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer of more digits than Python reads
        raise FolderError(f"{where}: not valid JSON ({_reason(e)})") from None


def read_json(path: str | Path, kind: type = dict) -> Any:
    """The JSON file ``path``, which must hold a ``kind`` (a dict: an object; a list)."""
    path = Path(path)
    if not path.is_file():
        raise FolderError(f"{path}: not a file" if path.exists() else f"{path}: not found")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise FolderError(f"{path}: cannot be read ({e.strerror or _reason(e)})") from None
    data = parse_json(raw, path)
    if not isinstance(data, kind):
        want = "a JSON object" if kind is dict else "a JSON list" if kind is list else kind.__name__
        raise FolderError(f"{path}: expected {want}, got {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# --- config.json --------------------------------------------------------------------------------------

class Config:
    """A model's config.json (any JSON object of the folder) with getters that check each field's type
    and range, naming the file and the field when it is wrong."""

    def __init__(self, data: dict, path: str | Path) -> None:
        self.data, self.path = data, Path(path)

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value (unchecked); null counts as absent."""
        value = self.data.get(key)
        return default if value is None else value

    def _value(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is REQUIRED:
                raise FolderError(f"{self.path}: has no {key!r}" if key not in self.data
                                  else f"{self.path}: {key} is null")
            return default
        return value

    def _bad(self, key: str, want: str, value: Any) -> FolderError:
        shown = json.dumps(value) if not isinstance(value, (dict, list)) else _json_kind(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return FolderError(f"{self.path}: {key} must be {want}, got {shown}")

    def int(self, key: str, default: Any = REQUIRED, *, at_least: int = 1, at_most: int = MAX_INT) -> Any:
        """An integer in [at_least, at_most] (a default is returned as given)."""
        value = self._value(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= at_most:
            want = f"an integer >= {at_least}" if at_most == MAX_INT else f"an integer in [{at_least}, {at_most}]"
            raise self._bad(key, want, value)
        return value

    def float(self, key: str, default: Any = REQUIRED, *, at_least: float | None = None,
              at_most: float | None = None, below: float | None = None) -> Any:
        """A finite number (an integer too) with at_least <= value <= at_most and value < below."""
        value = self._value(key, default)
        if value is default:
            return value
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        ok = ok and (at_least is None or value >= at_least) and (at_most is None or value <= at_most) and \
            (below is None or value < below)
        if not ok:
            bounds = [f">= {at_least}" if at_least is not None else "", f"<= {at_most}" if at_most is not None else "",
                      f"< {below}" if below is not None else ""]
            raise self._bad(key, " ".join(["a finite number", *[b for b in bounds if b]]), value)
        return float(value)

    def bool(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._value(key, default)
        if value is not default and not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def str(self, key: str, default: Any = REQUIRED, *, choices: Iterable[str] | None = None) -> Any:
        value = self._value(key, default)
        if value is default:
            return value
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        if choices is not None and value not in choices:
            raise _refused(f"{self.path}: {key} {value!r} is not supported (qkv has {', '.join(choices)})")
        return value

    def dict(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._value(key, default)
        if value is not default and not isinstance(value, dict):
            raise self._bad(key, "an object", value)
        return value

    def list(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._value(key, default)
        if value is not default and not isinstance(value, list):
            raise self._bad(key, "a list", value)
        return value

    def says(self, *keys: str) -> str:
        """``config.json's hidden_size = 64, num_attention_heads = 4`` (for a message naming the fields)."""
        shown = ", ".join(f"{k} = {json.dumps(self.data.get(k))}" for k in keys)
        return f"{self.path.name}'s {shown}" if keys else self.path.name

    def refuse(self, what: str):
        """Raise :class:`~qkv.importers.ImportRefused` ``"<path>: what"`` (an option qkv cannot convert)."""
        raise _refused(f"{self.path}: {what}")

    def error(self, what: str):
        """Raise :class:`FolderError` ``"<path>: what"`` (a malformed file)."""
        raise FolderError(f"{self.path}: {what}")


def read_config(path: str | Path) -> Config:
    """The JSON object at ``path`` (a config.json) as a :class:`Config`."""
    return Config(read_json(path), path)


# --- weights ------------------------------------------------------------------------------------------

class Weights(Mapping):
    """The folder's tensors by name (as stored: nothing is checked until :meth:`take`)."""

    def __init__(self, tensors: dict[str, Any], files: dict[str, Path], config: Config | None) -> None:
        self._tensors, self.files, self.config = tensors, files, config

    def __getitem__(self, name: str):
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def renamed(self, rename) -> "Weights":
        """The same tensors under ``rename(name)`` (a converter's prefix or legacy names)."""
        tensors, files = {}, {}
        for k, v in self._tensors.items():
            new = rename(k)
            tensors[new], files[new] = v, self.files[k]
        return Weights(tensors, files, self.config)

    def file_of(self, name: str) -> Path:
        return self.files.get(name) or next(iter(self.files.values()), Path("the weights"))

    def take(self, name: str, shape: Iterable[int | None] | None = None, fields: Iterable[str] = (),
             default: Any = REQUIRED) -> torch.Tensor:
        """The tensor ``name`` as float32, refused unless it is there (or ``default`` is given),
        floating point, finite and of ``shape``. ``fields``: the config.json fields the shape comes
        from, named when it does not fit."""
        fields = tuple(fields)
        if name not in self._tensors:
            if default is not REQUIRED:
                return default
            where = ", ".join(sorted({p.name for p in self.files.values()})) or "the weights"
            because = f" (which {self.config.says(*fields)} needs)" if fields and self.config else ""
            raise FolderError(f"{self.config.path.parent if self.config else where}: the weights ({where}) have no "
                              f"tensor {name!r}{because}")
        t = self._tensors[name]
        file = self.file_of(name)
        if not isinstance(t, torch.Tensor):
            raise FolderError(f"{file}: {name!r} is not a tensor ({type(t).__name__})")
        if not t.dtype.is_floating_point:
            raise FolderError(f"{file}: tensor {name!r} is {str(t.dtype).removeprefix('torch.')}: model weights "
                              "must be floating point")
        t = t.float()
        if shape is not None:
            shape = tuple(shape)
            if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
                want = " x ".join("?" if s is None else str(s) for s in shape) or "a scalar"
                have = " x ".join(map(str, t.shape)) or "a scalar"
                because = self.config.says(*fields) if fields and self.config else "the config"
                raise FolderError(f"{file}: tensor {name!r} is {have}, but {because} makes it {want}")
        if not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            what = [f"{n} {kind} value{'s' * (n != 1)}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n]
            raise FolderError(f"{file}: tensor {name!r} has {' and '.join(what)}: model weights must be finite")
        return t

    def layer_count(self, pattern: str) -> int:
        """1 + the largest layer index in the names matching ``pattern`` (a regex whose first group is
        the index); 0 without any."""
        found = [int(m.group(1)) for n in self._tensors if (m := re.match(pattern, n))]
        return max(found) + 1 if found else 0

    def check_layers(self, pattern: str, n: int, field: str) -> None:
        """Refuse weights whose layer count (:meth:`layer_count` of ``pattern``) is not config.json's
        ``field`` = n."""
        have = self.layer_count(pattern)
        if have != n:
            where = ", ".join(sorted({p.name for p in self.files.values()}))
            says = self.config.says(field) if self.config else f"{field} = {n}"
            raise FolderError(f"{self.config.path.parent if self.config else where}: the weights ({where}) hold "
                              f"{have} layer{'s' * (have != 1)}, but {says}")

    def check_rows(self, name: str, rows: int, what: str) -> None:
        """Refuse the tensor ``name`` unless it has ``rows`` rows (``what``: where that number comes from,
        e.g. "tokenizer.json has 200 tokens")."""
        t = self._tensors.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] != rows:
            raise FolderError(f"{self.file_of(name)}: tensor {name!r} has {t.shape[0]} rows, but {what}")


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FolderError(f"{path}: not a file" if path.exists() else f"{path}: not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors' own error types, OSError, MemoryError
        raise FolderError(f"{path}: not a readable safetensors file ({_reason(e)})") from None


def _pickle_refusal(path: Path, e: BaseException) -> FolderError:
    """Why torch.load(weights_only=True) refused ``path``, in qkv's words (torch's own advice to load
    the file unsafely is not passed on)."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"[Uu]nsupported (operand \S+)", text)
    if "weights_only" in text or "WeightsUnpickler" in text or found:
        what = f" (it asks for {found.group(1)})" if found else ""
        return FolderError(f"{path}: refused: this pickle holds more than tensors{what}; a pickle can run code "
                           "when it is read, so qkv reads only tensors from it (save the model as "
                           "model.safetensors to be sure)")
    return FolderError(f"{path}: not a readable PyTorch state dict ({_reason(e)})")


def _load_pickle(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FolderError(f"{path}: not a file" if path.exists() else f"{path}: not found")
    if path.stat().st_size == 0:
        raise FolderError(f"{path}: empty file (not a PyTorch state dict)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch errors of every kind (a RecursionError too)
        raise _pickle_refusal(path, e) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise FolderError(f"{path}: expected a state dict (tensor names to tensors), got {type(data).__name__}")
    return data


def _sharded(index: Path, suffix: str, load) -> tuple[dict, dict]:
    folder = index.parent
    data = read_json(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FolderError(f"{index}: weight_map must be an object of tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(suffix) or Path(shard).name != shard \
                or shard.startswith("."):
            raise FolderError(f"{index}: weight_map[{name!r}] must name a {suffix} file of the folder, got "
                              f"{json.dumps(shard)[:60]}")
    tensors, files = {}, {}
    for shard in sorted(set(weight_map.values())):
        for k, v in load(folder / shard).items():
            tensors[k], files[k] = v, folder / shard
    for name, shard in weight_map.items():
        if files.get(name) != folder / shard:
            raise FolderError(f"{index}: weight_map puts {name!r} in {shard}, which does not hold it")
    return tensors, files


def read_weights(folder: str | Path, config: Config | None = None) -> Weights:
    """The folder's tensors: model.safetensors, else model.safetensors.index.json (sharded), else
    pytorch_model.bin (read with ``weights_only``: tensors, never pickled code), else its index.
    ``config`` names the fields in :meth:`Weights.take`'s messages."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    pt, pt_index = folder / "pytorch_model.bin", folder / "pytorch_model.bin.index.json"
    if single.exists():
        tensors = _load_safetensors(single)
        files = {k: single for k in tensors}
    elif index.exists():
        tensors, files = _sharded(index, ".safetensors", _load_safetensors)
    elif pt.exists():
        tensors = _load_pickle(pt)
        files = {k: pt for k in tensors}
    elif pt_index.exists():
        tensors, files = _sharded(pt_index, ".bin", _load_pickle)
    else:
        raise FolderError(f"{folder}: no weights (model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin)")
    if not tensors:
        raise FolderError(f"{next(iter(set(files.values())), single if single.exists() else pt)}: holds no tensors")
    return Weights(tensors, files, config)


# --- tokenizer.json -----------------------------------------------------------------------------------

def read_tokenizer_json(path: str | Path) -> bytes:
    """The bytes of a tokenizer.json that the tokenizers package reads (an object with a ``model``)."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data.get("model"), dict):
        raise FolderError(f"{path}: has no tokenizer 'model' object (not a Hugging Face tokenizer.json)")
    raw = path.read_bytes()
    try:
        import tokenizers
    except ImportError:
        raise QkvError("this model's tokenizer is a Hugging Face tokenizer.json: install the 'tokenizers' package "
                       '(pip install -c constraints.txt -e ".[pretrained]")') from None
    try:
        tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise FolderError(f"{path}: not a Hugging Face tokenizer ({_reason(e)})") from None
    return raw


# --- the converted model ------------------------------------------------------------------------------

def load_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], config: Config | None = None,
               strict: bool = True, allow_missing: Iterable[str] = ()) -> None:
    """``model.load_state_dict(state)``; a missing, extra or misshapen tensor is refused by name (the
    converter took every tensor with its shape, so this is a converter's own slip, named as such)."""
    own = model.state_dict()
    where = config.path if config else "the weights"
    for k, v in state.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise FolderError(f"{where}: the converted tensor {k!r} is {tuple(v.shape)}, qkv's model of this config "
                              f"needs {tuple(own[k].shape)}")
    missing = sorted(set(own) - set(state) - set(allow_missing))
    extra = sorted(set(state) - set(own))
    if strict and (missing or extra):
        raise QkvError(f"internal: the import does not fill qkv's model of {where} (missing {missing[:5]}, "
                       f"unexpected {extra[:5]})")
    model.load_state_dict(dict(state), strict=False)


__all__ = ["Config", "FolderError", "REQUIRED", "Weights", "load_state", "parse_json", "read_config", "read_json",
           "read_tokenizer_json", "read_weights"]
