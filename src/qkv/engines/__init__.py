"""The engines: qkv's models run by CTranslate2, behind qkv's own front-ends.

    >>> import qkv
    >>> qkv.load("runs/minilm", engine="ctranslate2").embed(["a sentence"])     # ctranslate2.Encoder
    >>> qkv.load("runs/gpt2", engine="ctranslate2").generate("once", 20, 0)     # ctranslate2.Generator
    >>> qkv.load("runs/ende/best", engine="ctranslate2").translate(["..."])     # ctranslate2.Translator

:func:`load` opens a checkpoint as the front-end its task names, run by CTranslate2:

=====================  =========================  =====================================================
task (arch)            front-end                  CTranslate2
=====================  =========================  =====================================================
translate (transf.)    :class:`~qkv.engines.translator.CT2Translator`  ``Translator``, in a worker process
classify, mlm (transf.) :class:`~qkv.engines.encoder.CT2Encoder`   ``Encoder``: the last hidden states;
                                                  pooling and heads in torch
lm (transformer)       :class:`~qkv.engines.generator.CT2LanguageModel`  ``Generator.generate_tokens``
=====================  =========================  =====================================================

A translator runs in a worker process that is supervised (:mod:`qkv.engines.worker`: replaced when it
ends or misses its timeout), and its decoding settings are checked before anything is converted
(:mod:`qkv.engines.options`, without torch). Each checkpoint is converted once by the export's converter (:mod:`qkv.export.ct2`, checked on its
probe sequences) into a cache keyed by its checksums (:mod:`qkv.engines.cache`); ``quantize="int8"``
is CTranslate2's int8 compute type on that float32 conversion. Other models (recurrent ones, a
prefix LM) are refused by name, as is a Hugging Face folder not yet written by ``qkv import``
(the cache is keyed by a checkpoint's manifest).
"""

from __future__ import annotations

from pathlib import Path

from qkv.errors import CheckpointError, QkvError

ENGINES = ("qkv", "ctranslate2")
GENERATORS = {("lm", "transformer")}


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise QkvError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")


def check_convertible(path: Path, model_cfg) -> None:
    """What the converter writes (:func:`qkv.export.check_supported`'s rules, encoders included): refused by name."""
    from qkv.export import CT2_ACTIVATIONS

    if model_cfg.has_final_norm != model_cfg.norm_first:
        raise QkvError(f"{path} has final_norm = {model_cfg.final_norm!r} with norm_first = {model_cfg.norm_first}: "
                       "CTranslate2 runs a final LayerNorm with pre-norm layers only; use --engine qkv")
    if model_cfg.activation not in CT2_ACTIVATIONS:
        raise QkvError(f"{path} has activation = {model_cfg.activation!r}: CTranslate2 runs "
                       f"{', '.join(map(repr, CT2_ACTIVATIONS))} only; use --engine qkv")


def load(path: str | Path, device: str = "cpu", quantize: str | None = None, threads: int = 0, log=None,
         timeout: float | None = None):
    """The checkpoint ``path`` as its task's front-end run by CTranslate2 (see the module) on ``device``
    (cpu, cuda, cuda:N, auto) with ``threads`` intra-op threads (0: CTranslate2's default);
    ``quantize="int8"``: its int8 compute type. ``timeout``: a translator's worker call bound (seconds,
    :func:`qkv.engines.translator.load`); the encoder and the generator run in this process."""
    from qkv.checkpoint import read_config
    from qkv.export import ct2
    from qkv.engines import translator as translation
    from qkv.frontends.loading import is_pretrained_folder
    from qkv.frontends.quantize import QUANTIZE_CHOICES

    log = log or translation.stderr
    translation.require_ctranslate2()
    if quantize not in QUANTIZE_CHOICES:
        raise QkvError(f"quantize must be None or 'int8', got {quantize!r}")
    path = Path(path)
    if is_pretrained_folder(path):
        raise QkvError(f"{path} is a Hugging Face folder: --engine ctranslate2 runs qkv checkpoints (its conversion "
                       f"is cached keyed by their checksums); write one first with qkv import {path} --out DIR")
    model_cfg, train_cfg, decode_cfg = (read_config(path, s) for s in ("model", "train", "decode"))
    try:
        model_cfg, decode_cfg = model_cfg.validate(), decode_cfg.validate()
    except QkvError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    key = (model_cfg.task, model_cfg.arch)
    if model_cfg.task == "translate":
        return translation.load(path, device, quantize, threads, log, timeout)
    if key not in ct2.ENCODERS and key not in GENERATORS:
        kinds = ", ".join(f"{t} ({a})" for t, a in [("translate", "transformer"), *ct2.ENCODERS, *sorted(GENERATORS)])
        raise QkvError(f"{path} is a {model_cfg.task!r} model with arch {model_cfg.arch!r}: --engine ctranslate2 runs "
                       f"these Transformer models: {kinds}; use --engine qkv")
    check_convertible(path, model_cfg)
    where = translation.ct2_device(device)
    from qkv.engines.cache import converted

    directory = converted(path, log)
    if key in ct2.ENCODERS:
        from qkv.engines.encoder import load_encoder

        return load_encoder(path, directory, model_cfg, train_cfg, decode_cfg, where, quantize, threads)
    from qkv.engines.generator import load_language_model

    return load_language_model(path, directory, model_cfg, train_cfg, where, quantize, threads)


__all__ = ["ENGINES", "check_engine", "load"]
