"""What ``--engine ctranslate2`` checks before anything slow: the decoding settings CTranslate2
cannot run as qkv does, refused by name (no torch imported here, so that ``qkv translate`` says
what to pass in a moment, before it loads or converts anything)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from qkv.config import DecodeConfig, from_dict
from qkv.errors import ConfigError, QkvError


def check_settings(cfg: DecodeConfig, prefixed: bool = False) -> None:
    """Refuse, by name, decoding settings CTranslate2 cannot run as qkv does."""
    if cfg.beam_size == 1 and cfg.nbest == 1:
        return
    fix = "give --length-norm length --early-stopping, or --beam-size 1, or use --engine qkv"
    if prefixed and cfg.length_penalty:
        raise ConfigError("--target-prefix with a beam search: CTranslate2 divides a hypothesis' log-probability "
                          "by the length of the whole output, prefix included, qkv by the length after the "
                          "prefix; give --beam-size 1 or --length-penalty 0, or use --engine qkv")
    if cfg.length_norm != "length":
        raise ConfigError(f"--length-norm {cfg.length_norm}: CTranslate2's beam search divides by |Y|^α "
                          f"(--length-norm length) and has no other length penalty; {fix}")
    if not cfg.early_stopping:
        raise ConfigError("beam search without --early-stopping: CTranslate2's ends a sentence as soon as beam_size "
                          f"hypotheses have ended (--early-stopping); {fix}")


def saved_decoding(path: Path) -> DecodeConfig | None:
    """The saved decoding settings of the translation Transformer ``path`` (checked), from its
    config.json alone; None for anything else (no such checkpoint, another kind of model, a config
    that does not read), which the full load then names."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model = config["model"]
        if (model.get("task", "translate"), model.get("arch", "transformer")) != ("translate", "transformer"):
            return None
        return from_dict(DecodeConfig, config["decode"], f"{path / 'config.json'} [decode]").validate()
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, QkvError):
        return None


def check_options(path: str | Path, overrides: dict | None = None, prefixed: bool = False) -> DecodeConfig | None:
    """What ``qkv translate --engine ctranslate2`` will decode with (the checkpoint's saved decoding
    settings, ``overrides`` replacing them), checked before anything slow (the conversion): a setting
    CTranslate2 cannot decode as qkv does is refused here, naming the checkpoint's own settings and
    what to pass instead. None where the checkpoint's settings do not read (its load says why)."""
    path = Path(path)
    saved = saved_decoding(path)
    if saved is None:
        return None
    cfg = replace(saved, **(overrides or {})).validate()
    try:
        check_settings(cfg, prefixed)
    except ConfigError as e:
        raise ConfigError(f"{e} ({path} saves beam size {saved.beam_size}, --length-norm {saved.length_norm}, "
                          f"{'--early-stopping' if saved.early_stopping else 'no --early-stopping'})") from None
    return cfg


__all__ = ["check_settings", "check_options"]
