"""Deployment formats: a trained checkpoint converted for another runtime, each conversion written on
the target's own interface and checked by equal outputs when it is made.

    ctranslate2  CTranslate2's Converter / ModelSpec (qkv.export.ct2): translate -> ctranslate2.Translator;
                 lm, prefix_lm -> ctranslate2.Generator; classify, mlm -> ctranslate2.Encoder (the encoder
                 stack); optional int8 / int8_float32 / float16 weights
    hf           Hugging Face transformers (qkv.export.hf): MarianMTModel + MarianTokenizer +
                 generation_config.json, loadable with from_pretrained and no qkv installed; a checkpoint
                 of ``qkv import`` as the class it came from (qkv.export.hf_families)

    >>> from qkv.export import export
    >>> export("runs/ende/best", "ctranslate2", "exported/ende-ct2", quantization="int8")

Both write the tokenizer (SentencePiece models; an imported model's tokenizer.json), a model card
(README.md) and ``qkv_export.json`` (how to tokenize and decode, what differs from ``qkv translate``, what was checked). The packages are
optional: ``pip install -c constraints.txt -e ".[export]"``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from qkv.errors import QkvError
from qkv.export.formats import FORMATS, QUANTIZATIONS  # noqa: F401  (names only: no torch)
from qkv.files import check_output_dir, remove_stale_temps

# the parts that need torch are imported when first used, so that importing the package (its formats,
# its output checks) takes a moment
LAZY = {"CardInfo": "card", "write_card": "card", "Source": "source", "read_source": "source"}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(f"qkv.export.{LAZY[name]}"), name)
    raise AttributeError(f"module 'qkv.export' has no attribute {name!r}")


def check_out(out: str | Path) -> Path:
    """``--out`` must be a new directory, or an empty one, in a place that takes new files."""
    p = Path(out)
    check_output_dir(p, "--out")
    if p.is_dir() and any(p.iterdir()):
        raise QkvError(f"--out {out} exists and is not empty: give a new directory (an export never overwrites one)")
    return p


# architecture options (qkv.config.ModelConfig) --format hf (MarianMTModel) writes only at the paper's values, and
# the activations it computes (Marian's swish is SiLU: an imported OPUS-MT model exports back); a model with
# another value is refused by name rather than exported wrong
PAPER_OPTIONS = {"activation": "relu", "layer_norm_eps": 1e-5, "scale_embeddings": True, "embedding_norm": False}
EXPORTED_ACTIVATIONS = ("relu", "silu")
# --format ctranslate2 writes any LayerNorm epsilon, scaled or unscaled embeddings, and these activations
# (GELU exact and tanh: an imported GPT-2's)
CT2_ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")


def check_supported(src: Source, fmt: str) -> None:
    from qkv.export import ct2, hf

    {"ctranslate2": ct2.check, "hf": hf.check}[fmt](src)
    if fmt == "hf":
        from qkv.export.hf_families import family_of

        if family_of(src) is not None:  # an imported model's own class: hf.check read its every option back
            return
    cfg = src.model
    if cfg.has_final_norm != cfg.norm_first:
        raise QkvError(f"{src.path} has final_norm = {cfg.final_norm!r} with norm_first = {cfg.norm_first}: "
                       f"--format {fmt} writes a final LayerNorm with pre-norm layers only, none with post-norm ones")
    can = CT2_ACTIVATIONS if fmt == "ctranslate2" else EXPORTED_ACTIVATIONS
    if cfg.activation not in can:
        raise QkvError(f"{src.path} has activation = {cfg.activation!r}: --format {fmt} writes "
                       f"{', '.join(map(repr, can))} only")
    if fmt == "ctranslate2":
        return
    for name, paper in PAPER_OPTIONS.items():
        value = getattr(cfg, name, paper)
        if name != "activation" and value != paper:
            raise QkvError(f"{src.path} has {name} = {value!r}: --format {fmt} writes only the paper's {paper!r}")


def export(checkpoint: str | Path, fmt: str, out: str | Path, quantization: str | None = None,
           card: CardInfo | None = None) -> dict:
    """Convert the checkpoint directory ``checkpoint`` to ``fmt`` into the new directory ``out``,
    written all or nothing (into a temporary directory beside it, renamed into place when complete).
    Returns the export's description (also in ``out/qkv_export.json``)."""
    if fmt not in FORMATS:
        raise QkvError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if quantization is not None and fmt != "ctranslate2":
        raise QkvError(f"--quantization is for --format ctranslate2 (CTranslate2 quantizes weights); --format {fmt} "
                       "writes float32 weights")
    if quantization not in (None, *QUANTIZATIONS):
        raise QkvError(f"--quantization {quantization}: choose one of {', '.join(QUANTIZATIONS)}")
    from qkv.checkpoint import fault_point
    from qkv.export.card import CardInfo, write_card
    from qkv.export.source import read_source

    out = check_out(out)
    src = read_source(checkpoint)
    check_supported(src, fmt)
    card = card or CardInfo()
    if (card.test_src or card.test_ref) and src.task != "translate":
        raise QkvError(f"--src/--ref score a translation model; {src.path} is a {src.task!r} model")
    out.parent.mkdir(parents=True, exist_ok=True)
    # named by pid: what an export killed outright (kill -9) left is removed by the next one to this place
    remove_stale_temps(out.parent, re.escape(f".{out.name}.tmp-") + r"(?P<pid>\d+)-\w+")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        if fmt == "ctranslate2":
            from qkv.export import ct2

            info = ct2.write(src, tmp, quantization)
        else:
            from qkv.export import hf

            info = hf.write(src, tmp)
        info["card"] = write_card(src, fmt, tmp, card, info, location=out)
        (tmp / "qkv_export.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        fault_point(f"export:{out.name}")
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def summary(info: dict, out: str | Path) -> str:
    """One line on what an export wrote and how it was checked; for a CTranslate2 translation model with a
    beam, a second one on how its beam search matches qkv's."""
    check = info.get("verified", {})
    if "max_abs_logit_difference" in check:
        how = f"max |delta logit| {check['max_abs_logit_difference']:.2g}"
    elif "max_abs_state_difference" in check:  # an encoder: its last hidden states
        how = f"max |delta state| {check['max_abs_state_difference']:.2g}"
        how += "" if check.get("checked", True) else f" ({info.get('quantization')} weights: reported, not checked)"
    else:
        how = f"max |delta log p| {check.get('max_abs_log_prob_difference', float('nan')):.2g}"
        how += "" if check.get("checked", True) else f" ({info.get('quantization')} weights: reported, not checked)"
    line = (f"wrote {out} for {info['runtime']} ({info.get('quantization', 'float32')} weights); the exported model "
            f"and the checkpoint agree on {check.get('probe_sequences', 0)} probe sequences: {how}")
    from qkv.export.ct2 import BEAM_NOTE

    if BEAM_NOTE in info.get("decode", {}).get("differences", []):
        line += f"\nnote: {BEAM_NOTE} (README.md says what else differs)"
    return line


__all__ = ["export", "summary", "FORMATS", "QUANTIZATIONS", "CardInfo", "read_source"]
