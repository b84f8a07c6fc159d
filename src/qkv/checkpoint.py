"""Checkpoints: one directory per checkpoint, written atomically, loaded without running code.

Layout of a checkpoint directory::

    config.json         the caller's config dict + "format": 1 + "qkv_version"
    model.safetensors   the model's state dict; a tensor shared by several names (tied
                        embedding / output weights) is stored once, the other names are
                        recorded as aliases in the file's metadata ("qkv.aliases")
    trainer_state.pt    optional: step, epoch, optimizer state, RNG states (torch.save of
                        tensors and plain Python values; read with torch.load(weights_only=True))
    ...                 whatever ``write_extra`` writes (tokenizer model files)
    manifest.json       size and sha256 of every other file; written last

A save goes to a temporary directory beside the target and is renamed into place only when
complete, so an interrupted save never leaves a half-written checkpoint: the directory either
has a manifest that matches its files, or it is the previous checkpoint, untouched.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from qkv.errors import CheckpointError
from qkv.files import sha256_file

FORMAT = 1
CONFIG, MODEL, TRAINER_STATE, MANIFEST = "config.json", "model.safetensors", "trainer_state.pt", "manifest.json"
_RESERVED = (CONFIG, MODEL, TRAINER_STATE, MANIFEST)
_ALIASES_KEY = "qkv.aliases"
_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass
class Checkpoint:
    """A checkpoint read back from disk (tensors on CPU)."""

    path: Path
    config: dict[str, Any]  # as given to save_checkpoint (without "format" / "qkv_version")
    state_dict: dict[str, torch.Tensor]  # complete: tied names point to the same tensor
    trainer_state: dict[str, Any] | None = None
    qkv_version: str = "unknown"
    files: tuple[str, ...] = ()  # what its manifest lists: files beside these are not part of it


def _qkv_version() -> str:
    try:
        from qkv import __version__  # type: ignore[attr-defined]

        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("qkv")
        except PackageNotFoundError:
            return "unknown"


# --- saving ----------------------------------------------------------------------------------------

def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    config: dict[str, Any],
    write_extra: Callable[[Path], None] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at ``path`` atomically and return its path.

    ``write_extra(dir)`` may add files (e.g. the tokenizer models) to the directory being
    written; names it must not use: config.json, model.safetensors, trainer_state.pt,
    manifest.json. ``trainer_state`` may hold tensors and plain Python values (dicts, lists,
    tuples, str, int, float, bool, None); anything else is refused here, because
    ``torch.load(weights_only=True)`` could not read it back. An existing checkpoint at ``path``
    is replaced only once the new one is complete.
    """
    path = Path(path)
    if path.exists() and not (path / MANIFEST).is_file():
        if not path.is_dir() or any(path.iterdir()):
            raise CheckpointError(f"refusing to replace {path}: it exists and is not a qkv checkpoint")
    if trainer_state is not None:
        _check_loadable(trainer_state, "trainer_state")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_saves(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    try:
        _chmod_default(tmp, directory=True)  # mkdtemp's 0700 would make the checkpoint private
        if write_extra is not None:
            write_extra(tmp)
            clashes = [name for name in _RESERVED if (tmp / name).exists()]
            if clashes:
                raise CheckpointError(f"write_extra wrote reserved checkpoint file(s): {', '.join(clashes)}")
        meta = {**config, "format": FORMAT, "qkv_version": _qkv_version()}
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tensors, aliases = _dedupe(model.state_dict())
        save_file(tensors, str(tmp / MODEL), metadata={_ALIASES_KEY: json.dumps(aliases)})
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"format": FORMAT, "files": {p.relative_to(tmp).as_posix(): _describe(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        for p in [*files, tmp / MANIFEST]:
            _chmod_default(p)
            _fsync(p)
        fsync_dir(tmp)
        fault_point(f"written:{path.name}")
        _swap_into_place(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError, SafetensorError)):  # a full disk, a read-only mount, ...
            raise CheckpointError(_write_failure(path, e)) from e
        raise
    return path


def remove_stale_saves(path: Path) -> None:
    """What saves of ``path`` by processes that are gone (killed outright: ``kill -9``, a power cut) left
    beside it: their temporaries ``.NAME.tmp-PID-XXXXXXXX`` are removed; where one was killed between
    the two renames of :func:`_swap_into_place` (no ``path``, the previous copy moved aside), the swap is
    finished if the new copy is whole, else the previous copy is put back. A live process's are left alone."""
    from qkv.files import pid_alive, remove_stale_temps

    pattern = re.escape(f".{path.name}.tmp-") + r"(?P<pid>\d+)-\w+(?P<old>\.old)?"
    try:
        entries = sorted(path.parent.iterdir())
    except OSError:
        return
    for old in entries:
        m = re.fullmatch(pattern, old.name)
        if m and m["old"] and not path.exists() and not pid_alive(int(m["pid"])):
            new = old.with_name(old.name[:-len(".old")])
            os.replace(new if new.is_dir() and is_complete(new) else old, path)
            fsync_dir(path.parent)
    remove_stale_temps(path.parent, pattern)


def _write_failure(path: Path, e: BaseException) -> str:
    """Why a checkpoint could not be written, in words: a full disk is said so (safetensors and torch
    report it in their own words, or not at all), and what is left in place."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    code = getattr(e, "errno", None)
    if code == errno.ENOSPC or "No space left" in str(e) or (free is not None and free < (1 << 20)):
        reason = "no space left on device" + (f" ({free:,} bytes free)" if free is not None else "")
    elif isinstance(e, OSError):
        reason = e.strerror or str(e)
    else:
        reason = str(e)
    kept = f"the previous {path.name} is unchanged" if (path / MANIFEST).is_file() else "nothing was written there"
    return f"cannot write the checkpoint {path}: {reason}; {kept}"


def _dedupe(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor (safetensors refuses shared memory); map the others to it."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}  # alias name -> stored name
    first_name: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, t in state_dict.items():
        t = t.detach()
        storage = (t.device, t.untyped_storage().data_ptr())
        key = (*storage, t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() > 0 and key in first_name:  # the very same tensor under another name (tying)
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        # A view overlapping another stored tensor gets its own copy.
        tensors[name] = t.to("cpu", copy=storage in storages).contiguous()
        storages.add(storage)
    return tensors, aliases


def _check_loadable(obj: Any, where: str) -> None:
    """Refuse values that torch.load(weights_only=True) would not read back."""
    if obj is None or type(obj) in (str, int, float, bool) or isinstance(obj, (torch.Tensor, torch.dtype)):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: key {k!r} has type {type(k).__name__}; use str or int keys")
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} has type {type(obj).__name__}, which torch.load(weights_only=True) cannot read back; "
        "store tensors, numbers, strings, lists, tuples and dicts only"
    )


def _describe(p: Path) -> dict[str, Any]:
    return {"size": p.stat().st_size, "sha256": sha256_file(p)}


def _fsync(p: Path) -> None:
    with p.open("rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(d: str | os.PathLike) -> None:
    """Make the renames and deletions in directory ``d`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _chmod_default(p: Path, directory: bool = False) -> None:
    """The mode a plain ``mkdir`` / ``open`` would give: 0777 / 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(p, (0o777 if directory else 0o666) & ~mask)


def _swap_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted last.

    A crash between the two renames leaves ``tmp`` (complete) and ``tmp.old`` (the previous copy)
    and no ``path``: :func:`qkv.training.rundir.recover` finishes the swap on the next start.
    """
    if not path.exists():
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return
    old = tmp.with_name(tmp.name + ".old")  # unique, as tmp is
    os.replace(path, old)
    fault_point(f"swap:{path.name}")
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)  # put the previous checkpoint back
        raise
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint whose files all match its manifest."""
    try:
        _verify(Path(path))
    except CheckpointError:
        return False
    return True


# --- fault injection, for the crash tests ------------------------------------------------------------

FAULT_ENV = "QKV_FAULT"  # "POINT@N": the N-th time this process reaches POINT, it kills itself (SIGKILL)
_fault_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """A place where a crash is tested (``written:NAME``: a save of NAME written whole in its temporary,
    not yet renamed; ``swap:last``: between the two renames of a save of ``last/``; the trainer's
    ``saved:start`` (last/ at step 0), ``saved:best``, ``saved:step``, ``saved:last``; ``export:NAME``: an
    export to NAME written whole in its temporary). Does nothing unless ``QKV_FAULT``
    names it: the tests kill a training process exactly there and check that it resumes exactly."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, n = spec.rpartition("@")
    if point != name:
        return
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] == int(n):
        os.kill(os.getpid(), signal.SIGKILL)


# --- loading ---------------------------------------------------------------------------------------

def read_checkpoint(path: str | os.PathLike, need_trainer_state: bool = False) -> Checkpoint:
    """Verify the manifest of the checkpoint at ``path``, then read its config and weights.

    ``need_trainer_state=True`` also reads trainer_state.pt (for resuming) and fails if it is
    absent; otherwise it is not read and ``trainer_state`` is None. Raises CheckpointError,
    naming the path and the file, for anything missing, corrupt or unreadable.
    """
    path = Path(path)
    files = tuple(_verify(path))
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint {path}: cannot parse {CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: {CONFIG} is not a JSON object")
    fmt = config.pop("format", None)
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: unsupported checkpoint format {fmt!r} (this qkv reads format {FORMAT})")
    version = str(config.pop("qkv_version", "unknown"))
    state_dict = _read_weights(path)
    trainer_state = None
    if need_trainer_state:
        if not (path / TRAINER_STATE).is_file():
            raise CheckpointError(f"{path} has no {TRAINER_STATE} (saved without trainer state): cannot resume from it")
        try:
            trainer_state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors come in many types
            raise CheckpointError(f"corrupt checkpoint {path}: cannot read {TRAINER_STATE}: {e}") from None
    return Checkpoint(path, config, state_dict, trainer_state, version, files)


def listed_files(path: str | os.PathLike) -> list[str]:
    """The files of the checkpoint at ``path``, as its manifest lists them (after checking each
    against its size and checksum); whatever else lies in the directory is not part of it."""
    return _verify(Path(path))


def read_settings(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's config.json as a dict, without reading (or verifying) its weights: for
    deciding what to do with a checkpoint before loading it. A missing or unreadable file is a
    CheckpointError naming it."""
    path = Path(path)
    try:
        raw = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(_no_manifest(path) if path.is_dir() else f"checkpoint not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint {path}: cannot read {CONFIG}: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: {CONFIG} is not a JSON object")
    return raw


def read_config(ckpt: Checkpoint | str | os.PathLike, section: str):
    """The ``section`` of a checkpoint's config.json as its config class: "model" ->
    :class:`~qkv.config.ModelConfig`, "train" -> ``TrainConfig``, "decode" -> ``DecodeConfig``
    (not yet validated). ``ckpt``: a loaded :class:`Checkpoint`, or a checkpoint directory (only
    its config.json is read). Every reader of a checkpoint's settings goes through here, so a
    section that is missing, not a JSON object, or has unknown or mistyped fields is a
    CheckpointError naming the file and the section."""
    from qkv.config import DecodeConfig, ModelConfig, TrainConfig, from_dict
    from qkv.errors import QkvError

    cls = {"model": ModelConfig, "train": TrainConfig, "decode": DecodeConfig}[section]
    path, config = (ckpt.path, ckpt.config) if isinstance(ckpt, Checkpoint) else (Path(ckpt), read_settings(ckpt))
    source = str(path / CONFIG)
    raw = config.get(section)
    if raw is None:
        raise CheckpointError(f"corrupt checkpoint {path}: {CONFIG} has no '{section}' section")
    if not isinstance(raw, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: the '{section}' section of {CONFIG} must be a JSON "
                              f"object of settings, got {type(raw).__name__} {str(raw)[:40]}")
    try:
        return from_dict(cls, raw, f"{source} [{section}]")
    except QkvError as e:
        raise CheckpointError(str(e)) from None


def _verify(path: Path) -> list[str]:
    """Check every file the manifest lists (present, size, sha256); return their names."""
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(_no_manifest(path))
    try:
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"corrupt checkpoint {path}: cannot parse {MANIFEST}: {e!r}") from None
    listed = {name for name, _, _ in entries}
    for required in (CONFIG, MODEL):
        if required not in listed:
            raise CheckpointError(f"corrupt checkpoint {path}: {MANIFEST} does not list {required}")
    for name, size, sha256 in entries:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"corrupt checkpoint {path}: {MANIFEST} lists a path outside it: {name}")
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"incomplete checkpoint {path}: {name} is missing")
        if f.stat().st_size != size or sha256_file(f) != sha256:
            raise CheckpointError(f"corrupt checkpoint {path}: {name} does not match its checksum")
    return [name for name, _, _ in entries]


def _no_manifest(path: Path) -> str:
    """Why ``path`` (a directory without a manifest) is no checkpoint: a run directory (the --out of
    training) points to its checkpoints; anything else is a checkpoint whose save was cut short."""
    subdirs = [path / "best", path / "last", *list_checkpoints(path)[::-1]]
    if not any(d.is_dir() for d in subdirs) and not (path / "metrics.jsonl").is_file():
        return f"incomplete checkpoint {path} (no {MANIFEST}): was the save interrupted?"
    found = [d for d in subdirs if (d / MANIFEST).is_file()]
    if not found:
        return f"{path} is a run directory that holds no checkpoint yet (no complete best/, last/ or step_N/)"
    return f"{path} is a run directory, not a checkpoint: give one of its checkpoints, e.g. {found[0]}"


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path / MODEL), framework="pt", device="cpu") as f:
            state_dict = {name: f.get_tensor(name) for name in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    except Exception as e:  # header, dtype and JSON errors of a damaged file
        raise CheckpointError(f"corrupt checkpoint {path}: cannot read {MODEL}: {e}") from None
    for alias, name in aliases.items():
        if name not in state_dict:
            raise CheckpointError(f"corrupt checkpoint {path}: {MODEL} ties {alias} to a missing tensor {name}")
        state_dict[alias] = state_dict[name]
    check_finite(state_dict, f"{path}: {MODEL}")
    return state_dict


def check_finite(state_dict: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights that are not all finite, naming the first such tensor: NaN or inf weights make
    every output NaN, which decoding turns into nonsense or an error far from its cause (training
    never saves them; a file edited, damaged or made elsewhere may hold them)."""
    for name, t in state_dict.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            kinds = " and ".join(k for k, m in (("NaN", torch.isnan(t)), ("inf", torch.isinf(t))) if bool(m.any()))
            raise CheckpointError(f"{where}: the tensor {name} holds {bad} non-finite value(s) ({kinds}) of "
                                  f"{t.numel()}: these weights cannot be used")


def load_into(model: torch.nn.Module, checkpoint_or_path: Checkpoint | str | os.PathLike) -> Checkpoint:
    """Load a checkpoint's weights into ``model`` strictly; return the Checkpoint.

    Missing or unexpected parameter names and shape mismatches are a CheckpointError that
    names them (a checkpoint of another architecture or size), before anything is copied.
    """
    ckpt = checkpoint_or_path if isinstance(checkpoint_or_path, Checkpoint) else read_checkpoint(checkpoint_or_path)
    expected = model.state_dict()
    problems = []
    missing = [k for k in expected if k not in ckpt.state_dict]
    unexpected = [k for k in ckpt.state_dict if k not in expected]
    shapes = [
        f"{k} {tuple(ckpt.state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in ckpt.state_dict and ckpt.state_dict[k].shape != v.shape
    ]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
        if names:
            more = f" and {len(names) - 10} more" if len(names) > 10 else ""
            problems.append(f"{what}: {', '.join(names[:10])}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit this model; " + "; ".join(problems))
    model.load_state_dict(ckpt.state_dict, strict=True)
    return ckpt


# --- run directories -------------------------------------------------------------------------------

def step_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` goes: ``run_dir/step_000100``."""
    return Path(run_dir) / f"step_{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The ``step_N`` checkpoint directories in ``run_dir``, sorted by step (oldest first)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]
