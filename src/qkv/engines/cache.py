"""The cache of CTranslate2 conversions the engines run: one per checkpoint, keyed by its checksums.

The translation engine's cache (:mod:`qkv.export.engine`) with its key, marker, places and clean-up
(:func:`~qkv.export.engine.cache_key`, :func:`~qkv.export.engine.is_complete`,
:func:`~qkv.export.engine.user_cache`), for every model the engines run: translation Transformers,
language models and encoders (converted by :func:`qkv.export.ct2.write`, the export's converter,
checked on its probe sequences; an encoder's last hidden states against the checkpoint's to 1e-3).
``CHECKPOINT/ct2-KEY/``, else ``$QKV_CACHE_DIR/ct2/ct2-KEY/`` where the checkpoint's directory cannot be
written; a conversion is written into a temporary directory and renamed into place whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from qkv.errors import QkvError
from qkv.export.engine import (MARKER, PREFIX, Log, _temporary, cache_key, is_complete, remove_abandoned_temporaries,
                               stderr, user_cache)
from qkv.files import sha256_file


def convert(checkpoint: Path, tmp: Path, key: str) -> None:
    """The export's conversion (encoders included) into the empty ``tmp``, and the marker written last."""
    from qkv.export import ct2
    from qkv.export.source import read_source

    src = read_source(checkpoint)
    ct2.check(src, encoders=True)
    ct2.write(src, tmp)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
    (tmp / MARKER).write_text(json.dumps({"key": key, "checkpoint": str(checkpoint), "files": files}, indent=2) + "\n",
                              encoding="utf-8")


def converted(checkpoint: str | Path, log: Log = stderr) -> Path:
    """The CTranslate2 model directory of ``checkpoint``, converted now if no complete one is cached
    (beside the checkpoint, else in :func:`~qkv.export.engine.user_cache`)."""
    checkpoint = Path(checkpoint)
    key = cache_key(checkpoint)
    places = [checkpoint / f"{PREFIX}{key}", user_cache() / f"{PREFIX}{key}"]
    for place in places:
        if is_complete(place, key):
            return place
    for n, place in enumerate(places):
        tmp = _temporary(place.parent, key)
        if tmp is None:
            continue
        if n:
            log(f"note: {checkpoint} cannot be written: its CTranslate2 conversion is cached in {place}")
        try:
            if place.exists() and not is_complete(place, key):
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
        if n == 0:
            for stale in place.parent.glob(f"{PREFIX}*"):  # conversions of this directory's earlier contents
                if stale.name != place.name and stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
        remove_abandoned_temporaries(place.parent)
        return place
    raise QkvError(f"cannot write a CTranslate2 conversion of {checkpoint} beside it or in {user_cache()} "
                   "(set QKV_CACHE_DIR to a writable directory)")


__all__ = ["converted", "convert"]
