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

    if not text.strip():
        raise QkvError("give a non-empty input")
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


class Checkpoints:
    """The newest ``last/`` of each run, loaded once per save (keyed by its manifest's time), one
    request at a time on the model (``lock``)."""

    def __init__(self, load=None):
        self.load = load
        self.cache: dict[Path, tuple[int, object]] = {}
        self.lock = threading.Lock()

    def get(self, run_dir: Path):
        if self.load is None:
            from qkv.frontends import load

            self.load = load
        last = run_dir / "last"
        for attempt in range(3):  # a save renames last/ into place: it may be missing for a moment
            try:
                stamp = (last / "manifest.json").stat().st_mtime_ns
                cached = self.cache.get(run_dir)
                if cached and cached[0] == stamp:
                    return cached[1]
                model = self.load(last, "cpu")
                self.cache[run_dir] = (stamp, model)
                return model
            except (FileNotFoundError, CheckpointError):
                if attempt == 2:
                    break
                time.sleep(0.2)
        raise QkvError(f"{run_dir.name} has no checkpoint yet: the first is written when training starts")

    def look(self, run_dir: Path, text: str) -> dict:
        return self.apply(run_dir, look, text)

    def apply(self, run_dir: Path, fn, *args, **kwargs):
        """``fn(model, *args, **kwargs)`` on the run's newest checkpoint, one request at a time."""
        with self.lock:
            return fn(self.get(run_dir), *args, **kwargs)


__all__ = ["look", "hidden_norms", "Checkpoints"]
