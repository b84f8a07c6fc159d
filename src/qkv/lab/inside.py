"""One input through a run's newest checkpoint: its output, every attention map, and for a recurrent
model the norm of the encoder's hidden state at each source position.

The attention maps are :func:`qkv.viz.attention_data`'s (the model's own forward pass, one panel per
kind, layer and head; a recurrent model's alignment matrix as one cross-attention head), so the lab
shows what ``qkv viz attention`` draws.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from qkv.errors import CheckpointError, QkvError


def hidden_norms(translator, text: str) -> dict:
    """A recurrent encoder's hidden states h_s for ``text`` (pieces + EOS) and their norms ‖h_s‖, one
    per source position (both directions together for a bidirectional encoder)."""
    from qkv.data.batching import collate
    from qkv.masks import padding_mask

    model, src_tok = translator.model, translator.tokenizers.src
    ids = src_tok.encode([text])[0]
    src = collate([ids], None).src.to(translator.device)  # (1, S)
    with torch.inference_mode():
        lengths = padding_mask(src)[:, 0, 0].sum(dim=1)  # (1,)
        states, _ = model.encoder(model.src_embed(src), lengths)  # (1, S, H·dirs)
    return {"tokens": [src_tok.id_to_piece(i) for i in src[0].tolist()],
            "norms": states[0].norm(dim=-1).tolist()}


def look(translator, text: str) -> dict:
    """The greedy output for ``text``, the attention maps (``None`` for a model without attention, with
    ``why``) and, for a recurrent model, :func:`hidden_norms`."""
    from qkv.viz import attention_data

    from qkv.lab.lecture import MAX_TOKENS

    if not text.strip():
        raise QkvError("give a non-empty input")
    tokenizers = getattr(translator, "tokenizers", None)
    tok = getattr(tokenizers, "src", None) or getattr(translator, "tokenizer", None)
    if tok is not None:  # before any decoding: a long input is refused at once
        n = len(tok.encode([text])[0]) + 1
        if n > MAX_TOKENS:
            raise QkvError(f"text: the input is {n} tokens; this view takes at most {MAX_TOKENS}")
    model = translator.model
    out: dict = {"arch": model.cfg.arch}
    if getattr(model, "has_attention", True):
        data = attention_data(translator, text)  # the greedy output is its target
        out.update(output=data["target"], attention=data)
    else:
        out.update(output=translator.translate([text], beam_size=1)[0], attention=None,
                   why="this model has no attention: the decoder sees the source only through the encoder's "
                       "last state (attention 'none')")
    if model.cfg.is_recurrent:
        out["hidden"] = hidden_norms(translator, text)
    return out


QUEUE = 4  # requests on one run's checkpoint at once (the one computing and those waiting): more are 429


class Busy(QkvError):
    """A run's checkpoint has :data:`QUEUE` requests already: status 429, with Retry-After."""

    status = 429
    retry_after = 1


def stamp(last: Path) -> tuple:
    """What identifies the checkpoint in ``last``: its manifest's bytes (every file's SHA-256) and each
    file's inode, size and modification time, and the folder's inode. A save renames a new folder into
    place, a copy brings other files (even with the old times), an edit changes a file's size or time:
    each changes the stamp, and the checkpoint is loaded (and its checksums verified) again."""
    manifest = (last / "manifest.json").read_bytes()
    files = []
    for path in sorted(last.iterdir()):
        st = path.stat()
        files.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return last.stat().st_ino, manifest, tuple(files)


class Checkpoints:
    """The newest ``last/`` of each run, loaded again whenever it changed on disk (:func:`stamp`,
    checked before every request), one request at a time on each run's model, at most ``queue`` on a
    run at once (the rest are refused with 429): a run's requests cannot starve another run's, nor a
    flood of them starve the next one on the same run for long."""

    def __init__(self, load=None, queue: int = QUEUE):
        self.load = load
        self.queue = queue
        self.cache: dict[Path, tuple[tuple, object]] = {}
        self.locks: dict[Path, threading.Lock] = {}
        self.waiting: dict[Path, int] = {}
        self.guard = threading.Lock()

    def get(self, run_dir: Path):
        if self.load is None:
            from qkv.frontends import load

            self.load = load
        last = run_dir / "last"
        for attempt in range(3):  # a save renames last/ into place: it may be missing for a moment
            try:
                key = stamp(last)
                cached = self.cache.get(run_dir)
                if cached and cached[0] == key:
                    return cached[1]
                self.cache.pop(run_dir, None)
                model = self.load(last, "cpu")
                if stamp(last) == key:  # not replaced while it loaded
                    self.cache[run_dir] = (key, model)
                return model
            except (FileNotFoundError, NotADirectoryError):
                if attempt == 2:
                    break
            except CheckpointError as e:  # being replaced as it loaded, or damaged: never served from memory
                if attempt == 2:
                    raise QkvError(f"{run_dir.name}: its checkpoint cannot be read: {e}") from None
            time.sleep(0.2)
        raise QkvError(f"{run_dir.name} has no checkpoint yet: the first is written when training starts")

    def forget(self, run_dir: Path) -> None:
        """Drop the run's model (a deleted run)."""
        self.cache.pop(run_dir, None)

    def look(self, run_dir: Path, text: str) -> dict:
        return self.apply(run_dir, look, text)

    def apply(self, run_dir: Path, fn, *args, **kwargs):
        """``fn(model, *args, **kwargs)`` on the run's newest checkpoint, one request at a time per run;
        :class:`Busy` where ``queue`` requests of the run are computing or waiting already."""
        with self.guard:
            if self.waiting.get(run_dir, 0) >= self.queue:
                raise Busy(f"{run_dir.name} has {self.queue} requests in progress already (the lab's bound "
                           f"per run); try again in a moment")
            self.waiting[run_dir] = self.waiting.get(run_dir, 0) + 1
            lock = self.locks.setdefault(run_dir, threading.Lock())
        try:
            with lock:
                return fn(self.get(run_dir), *args, **kwargs)
        finally:
            with self.guard:
                self.waiting[run_dir] -= 1


__all__ = ["look", "hidden_norms", "Checkpoints", "Busy", "QUEUE", "stamp"]
