"""The cache of CTranslate2 conversions the engines run: one per checkpoint, keyed by its checksums.

Every model the engines run (translation Transformers, language models and encoders) is converted by
:func:`qkv.export.ct2.write`, the export's converter, checked on its probe sequences (an encoder's last
hidden states against the checkpoint's to 1e-4), into ``CHECKPOINT/ct2-KEY/``, else
``$QKV_CACHE_DIR/ct2/ct2-KEY/`` where the checkpoint's directory cannot be written or a file or link
stands where the conversion would go. A conversion is written into a temporary directory and renamed
into place whole, its marker (:data:`MARKER`: the key and every file's checksum) written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from qkv.checkpoint import TRAINER_STATE, listed_files
from qkv.errors import QkvError
from qkv.files import sha256_file

CACHE_FORMAT = 1  # bump when the conversion changes: older caches are then converted again
MARKER = "qkv_cache.json"  # written last into a conversion: its key and the checksum of every file
PREFIX = "ct2-"
ABANDONED_AFTER_S = 3600.0  # a conversion temporary untouched this long was left by a killed process


Log = Callable[[str], None]


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def require_ctranslate2(what: str = "--engine ctranslate2"):
    """The ctranslate2 package (its translators run in worker processes: :mod:`qkv.engines.worker`)."""
    from qkv.export.optional import require

    return require("ctranslate2", what)


def cache_key(checkpoint: Path) -> str:
    """From the checksums the manifest lists (each file checked against it first; the trainer state,
    which the model does not read, left out), the CTranslate2 version and :data:`CACHE_FORMAT`."""
    listed_files(checkpoint)  # no manifest, or a file that does not match it: refused here, by name
    manifest = json.loads((checkpoint / "manifest.json").read_text(encoding="utf-8"))["files"]
    files = {name: entry["sha256"] for name, entry in sorted(manifest.items()) if name != TRAINER_STATE}
    text = json.dumps({"files": files, "ctranslate2": require_ctranslate2().__version__, "format": CACHE_FORMAT},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def user_cache() -> Path:
    """Where conversions of checkpoints in directories that cannot be written go."""
    root = os.environ.get("QKV_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv"
    return Path(root) / "ct2"


def is_complete(directory: Path, key: str) -> bool:
    """Whether ``directory`` is a whole conversion for ``key``: its marker names the key and every file
    it lists is there with its size and checksum."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
        if marker["key"] != key or "model.bin" not in marker["files"]:
            return False
        return all((directory / name).stat().st_size == e["size"] and sha256_file(directory / name) == e["sha256"]
                   for name, e in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _temporary(parent: Path, key: str) -> Path | None:
    """A new temporary directory in ``parent`` (created if need be), or None where it cannot be written."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{PREFIX}{key}.tmp-", dir=parent))
    except OSError:
        return None


def remove_abandoned_temporaries(parent: Path, older_than_s: float = ABANDONED_AFTER_S) -> None:
    """Remove the temporary directories in ``parent`` of conversions killed before they could clean up
    (SIGKILL, power loss): those untouched for ``older_than_s`` seconds. A conversion takes seconds,
    so a newer one may be another process's, still being written, and is left alone."""
    now = time.time()
    for tmp in parent.glob(f".{PREFIX}*.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > older_than_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def convert(checkpoint: Path, tmp: Path, key: str) -> None:
    """The export's conversion (checked on its probe sequences; encoders included) into the empty
    ``tmp``, and the marker written last."""
    from qkv.export import ct2
    from qkv.export.source import read_source

    src = read_source(checkpoint)
    ct2.check(src)
    ct2.write(src, tmp)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
    (tmp / MARKER).write_text(json.dumps({"key": key, "checkpoint": str(checkpoint), "files": files}, indent=2) + "\n",
                              encoding="utf-8")


def converted(checkpoint: str | Path, log: Log = stderr) -> Path:
    """The CTranslate2 model directory of ``checkpoint``, converted now if no complete one is cached
    (beside the checkpoint, else in :func:`user_cache`)."""
    checkpoint = Path(checkpoint)
    key = cache_key(checkpoint)
    places = [checkpoint / f"{PREFIX}{key}", user_cache() / f"{PREFIX}{key}"]
    for place in places:
        if is_complete(place, key):
            return place
    blocked = False
    for n, place in enumerate(places):
        if place.is_symlink() or (os.path.lexists(place) and not place.is_dir()):  # never removed: not qkv's
            log(f"note: {place} is a file or a link, not a directory qkv wrote: the CTranslate2 conversion "
                f"{'goes to the user cache' if n == 0 else 'cannot go there'}")
            blocked = True
            continue
        tmp = _temporary(place.parent, key)
        if tmp is None:
            continue
        if n and not blocked:
            log(f"note: {checkpoint} cannot be written: its CTranslate2 conversion is cached in {place}")
        try:
            if place.exists() and not is_complete(place, key):  # (complete: another process has just written it)
                log(f"note: {place} is not a complete conversion of this checkpoint: converting again")
                shutil.rmtree(place)
            log(f"converting {checkpoint} for CTranslate2 into {place} (once; later loads reuse it)")
            convert(checkpoint, tmp, key)
            os.replace(tmp, place)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and is_complete(place, key):  # another process renamed its conversion first
                return place
            raise
        for stale in place.parent.glob(f"{PREFIX}*"):  # conversions of this directory's earlier contents
            if n == 0 and stale.name != place.name and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        remove_abandoned_temporaries(place.parent)
        return place
    raise QkvError(f"cannot write a CTranslate2 conversion of {checkpoint} beside it or in {user_cache()} "
                   "(set QKV_CACHE_DIR to a writable directory)")


__all__ = ["converted", "convert", "cache_key", "user_cache", "is_complete", "require_ctranslate2"]
