"""``qkv.load``: a checkpoint directory opened as its task's front-end."""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.checkpoint import load_into, read_checkpoint, read_config
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import CheckpointError, QkvError
from qkv.frontends.base import Frontend
from qkv.frontends.encoder import Encoder
from qkv.frontends.language_model import LanguageModel
from qkv.frontends.quantize import CALIBRATION, QUANTIZE_CHOICES, quantize_int8
from qkv.frontends.translator import Translator
from qkv.models import build_model
from qkv.models.transformer import Transformer

FRONTENDS: dict[str, type[Frontend]] = {cls.name: cls for cls in (Translator, Encoder, LanguageModel)}


def inference_device(device: str | torch.device) -> torch.device:
    """``auto``: the GPU when torch sees one, else the CPU; ``cuda`` without a GPU is refused by name."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise QkvError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QkvError(f"--device {device}: torch sees no CUDA GPU here (use --device cpu)")
    return device


def checkpoint_task(path: str | Path) -> str | None:
    """The task of the checkpoint at ``path``, from its config.json alone (None if that cannot be
    read: loading it then says why)."""
    try:
        return read_config(path, "model").task
    except QkvError:
        return None


def check_serves(path: str | Path, command: str) -> None:
    """Refuse, before its weights are read, a checkpoint whose task does not serve ``qkv COMMAND``
    (:attr:`qkv.tasks.base.Task.offers`), naming what it is and what it serves."""
    from qkv.tasks import TASKS, get_task

    try:
        cfg = read_config(path, "model")
    except QkvError:
        return
    task = cfg.task
    if task not in TASKS:
        return
    offered = get_task(task).offers
    if not cfg.mlm_head:  # an encoder imported without its masked-LM head
        offered = offered - {"fill"}
        if command == "fill":
            raise QkvError(f"{path} is an encoder imported without its masked-LM head (BertModel, RobertaModel, ... "
                           "or sentence-transformers): it embeds and searches; fill needs a ...ForMaskedLM "
                           "(BertForMaskedLM, RobertaForMaskedLM, ...)")
    if command in offered:
        return
    kinds = list(dict.fromkeys(get_task(t).kind for t in TASKS if command in get_task(t).offers))
    serves = ", ".join(f"qkv {c}" for c in sorted(offered - {"ensemble"}))
    raise QkvError(f"{path} is a {task!r} model, not {' or '.join(kinds)}: use it with {serves}")


def open_model(path: str | Path, command: str, device: str | torch.device = "cpu", quantize: str | None = None,
               compile: bool = False):
    """:func:`load` for ``qkv COMMAND``: a checkpoint of a task that does not serve it is refused first."""
    check_serves(path, command)
    return load(path, device, quantize, compile)


def frontend_for(task: str) -> type[Frontend]:
    """The front-end class that serves checkpoints of ``task`` (the one the task names)."""
    from qkv.tasks import get_task

    return FRONTENDS[get_task(task).frontend]


def load(path: str | Path, device: str | torch.device = "cpu", quantize: str | None = None, compile: bool = False):
    """Load a checkpoint directory (e.g. ``runs/default/best``) as the front-end its task names: a
    :class:`Translator` (translate, prefix_lm), an :class:`Encoder` (classify, mlm) or a
    :class:`LanguageModel` (lm). ``device``: cpu, cuda, cuda:N or auto (the GPU when torch sees one).

    A Hugging Face model folder (``config.json``, no qkv manifest; see :mod:`qkv.importers`) is converted
    in memory, as ``qkv import`` converts it.

    Only data is read: JSON, safetensors, SentencePiece models; never pickled code.
    ``quantize="int8"``: dynamic int8 quantisation for faster CPU decoding (:func:`quantize_int8`;
    CPU only). ``compile=True``: translation Transformers search with their step compiled
    (:meth:`Translator.compile_decoding`); any other model is refused by name.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise QkvError(f"quantize must be None or 'int8', got {quantize!r}")
    if compile and quantize:
        raise QkvError("compiled decoding (--compile) runs the float model: not with int8 quantisation (--int8)")
    if quantize and str(device) != "cpu":
        raise QkvError(f"quantize='int8' runs on the CPU only, not on device {str(device)!r}")
    device = inference_device(device)
    if is_pretrained_folder(path):  # a Hugging Face folder: converted in memory, as qkv import converts it
        return _load_pretrained(Path(path), device, quantize, compile)
    ckpt = read_checkpoint(Path(path))
    model_cfg, train_cfg, decode_cfg = (read_config(ckpt, s) for s in ("model", "train", "decode"))
    try:
        model_cfg, decode_cfg = model_cfg.validate(), decode_cfg.validate()
    except QkvError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    tokenizers = TokenizerPair.load(Path(path), ckpt.files)
    model = build_model(model_cfg)
    load_into(model, ckpt)
    model.to(device).eval()
    if quantize == "int8":
        int8(model, tokenizers, model_cfg.task)
    frontend = frontend_for(model_cfg.task).from_checkpoint(model, tokenizers, ckpt.config, decode_cfg, train_cfg)
    if compile:
        if not (isinstance(frontend, Translator) and isinstance(model, Transformer)):
            raise QkvError(f"{path}: compiled decoding (--compile) is for translation Transformers; this is "
                           f"a {model_cfg.task!r} model ({model_cfg.arch})")
        frontend.compile_decoding()
    return frontend


def int8(model: torch.nn.Module, tokenizers: TokenizerPair, task: str) -> None:
    """:func:`quantize_int8` in place; an encoder-only Transformer (what ``embed`` runs) calibrated on
    :data:`~qkv.frontends.quantize.CALIBRATION` read by its own tokenizer (per-token int8, smoothed)."""
    calibration = None
    if frontend_for(task) is Encoder and hasattr(model, "encoder_layers") and hasattr(model, "encode"):
        from qkv.tasks.classify import encoder_input

        keep = getattr(model.cfg, "max_positions", 512) - 1
        calibration = encoder_input([row[:keep - 1] for row in tokenizers.src.encode(list(CALIBRATION))])
    quantize_int8(model, calibration=calibration)


def is_pretrained_folder(path: str | Path) -> bool:
    """A Hugging Face model folder, which :func:`load` converts: no qkv manifest, and a sentence-transformers
    modules.json or a config.json of Hugging Face's (``model_type`` or ``architectures``, none of qkv's sections)."""
    import json

    p = Path(path)
    if not p.is_dir() or (p / "manifest.json").exists():
        return False
    if (p / "modules.json").exists():
        return True
    if any((p / name).exists() for name in HF_FILES):
        return True  # files only Hugging Face writes: the importer reads the folder (and names what is wrong in it)
    try:
        config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config) and "model" not in config


HF_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.safetensors.index.json", "tokenizer_config.json",
            "generation_config.json")  # never in a qkv checkpoint


def _load_pretrained(path: Path, device, quantize: str | None, compile: bool):
    from qkv.config import DecodeConfig
    from qkv.importers import convert

    if compile:
        raise QkvError(f"{path}: compiled decoding (--compile) is for translation Transformers; convert the folder "
                       "with qkv import first")
    imported = convert(path)
    model = imported.model.to(device).eval()
    if quantize == "int8":
        int8(model, imported.tokenizers, imported.model_cfg.task)
    decode = imported.extra.get("decode")  # the folder's search settings (a Marian model's generation_config)
    decode_cfg = DecodeConfig(**decode).validate() if decode else DecodeConfig()
    return frontend_for(imported.model_cfg.task).from_checkpoint(model, imported.tokenizers, dict(imported.extra),
                                                                 decode_cfg, imported.train_cfg)


def load_ensemble(paths: list[str | Path], device: str | torch.device = "cpu", quantize: str | None = None) -> Translator:
    """Load several translation checkpoints as one :class:`Translator` that decodes with the
    mean of their next-token distributions (:class:`qkv.decoding.ensemble.Ensemble`; fairseq's
    ``--path a:b``). The members must share the tokenizers (the same SentencePiece models, so the
    same token ids); the decoding settings are the first checkpoint's.
    """
    from qkv.decoding.ensemble import Ensemble

    paths = [Path(p) for p in paths]
    if not paths:
        raise QkvError("an ensemble needs at least one checkpoint")
    for path in paths:
        check_serves(path, "ensemble")
    members = [load(p, device, quantize) for p in paths]
    first = members[0]
    for path, member in zip(paths[1:], members[1:]):
        for side in ("src", "tgt"):
            if getattr(member.tokenizers, side).model_bytes != getattr(first.tokenizers, side).model_bytes:
                raise QkvError(f"{path}: its {side} tokenizer differs from {paths[0]}'s: ensemble members must "
                               "share the vocabulary (train them with the same SentencePiece model: "
                               "qkv train --tokenizer-from FIRST_CHECKPOINT)")
    return Translator(Ensemble([m.model for m in members]).eval(), first.tokenizers, first.decode_cfg, first.train_cfg)


__all__ = ["load", "load_ensemble", "open_model", "check_serves", "checkpoint_task", "frontend_for", "FRONTENDS"]
