"""Checkpoint averaging (section 6.1).

"For the base models, we used a single model obtained by averaging the last 5 checkpoints,
which were written at 10-minute intervals. For the big models, we averaged the last 20."

    θ̄ = (1/K) Σ_k θ_k

over checkpoints of one run (same architecture and tokenizer). The result is an ordinary
checkpoint directory (without trainer state: it is for decoding, not for resuming). It never
replaces a checkpoint a run resumes from, nor writes into another run's directory (:func:`check_out`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qkv.data.tokenizer import TokenizerPair
from qkv.errors import CheckpointError
from qkv.models import build_model
from qkv.checkpoint import (TRAINER_STATE, Checkpoint, list_checkpoints, load_into, read_checkpoint,
                            read_config, save_checkpoint)
from qkv.training.rundir import is_run_directory


def average_state_dicts(state_dicts: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """Element-wise mean in float64, cast back to each tensor's dtype. Keys and shapes must agree."""
    if not state_dicts:
        raise CheckpointError("no checkpoints to average")
    first = state_dicts[0]
    for sd, name in zip(state_dicts[1:], names[1:]):
        if sd.keys() != first.keys():
            diff = sorted(set(sd) ^ set(first))[:5]
            raise CheckpointError(f"{name}: parameters differ from {names[0]} ({', '.join(diff)})")
        for k, v in sd.items():
            if v.shape != first[k].shape:
                raise CheckpointError(f"{name}: '{k}' has shape {tuple(v.shape)}, {names[0]} has {tuple(first[k].shape)}")
    out = {}
    for k, v in first.items():
        if v.is_floating_point():
            mean = sum(sd[k].double() for sd in state_dicts) / len(state_dicts)
            out[k] = mean.to(v.dtype)
        else:  # integer buffers (none in our models today): keep the last checkpoint's value
            out[k] = state_dicts[-1][k]
    return out


def resolve_inputs(inputs: list[str | Path], last: int | None) -> list[Path]:
    """Either explicit checkpoint directories, or one run directory and ``last`` = how many of its
    newest ``step_N/`` checkpoints to take."""
    paths = [Path(p) for p in inputs]
    if last is not None:
        if len(paths) != 1:
            raise CheckpointError("--last takes one run directory (with step_N/ checkpoints), not a list")
        found = list_checkpoints(paths[0])
        if len(found) < last:
            raise CheckpointError(too_few_message(paths[0], last, found))
        return found[-last:]
    return paths


def too_few_message(run: Path, last: int, found: list[Path]) -> str:
    """Why ``run`` has fewer than ``last`` step_N/ checkpoints, from its own settings (``run/last``): it keeps
    none or fewer (``keep_last``), or it has not validated that often yet (one every ``eval_every`` updates,
    and one when it stops), and what to do instead."""
    head = f"{run}: asked for the last {last} checkpoints but found {len(found)} step_N/ directories"
    try:
        train = read_config(run / "last", "train")
    except Exception:  # no readable run settings: say what decides the count
        return (f"{head}: a run saves one at each validation (--eval-every) and when it stops, and keeps the newest "
                f"--keep-last of them; train longer or with --keep-last {last}"
                + (f", or average --last {len(found)}" if found else ""))
    k, every = train.keep_last, train.eval_every
    if k == 0:
        return f"{head}: the run keeps none (keep_last 0); train with --keep-last {last} to average {last}"
    if k < last:
        return (f"{head}: the run keeps only the newest {k} (keep_last {k}); train with --keep-last {last}"
                + (f", or average --last {len(found)}" if found else ""))
    newest = int(found[-1].name.split("_")[1]) if found else 0
    need = last * every
    return (f"{head}: the run keeps {k} (keep_last {k}) but saves one only at each validation, every {every} "
            f"updates (eval_every), and when it stops; it has trained {newest:,} of max_steps "
            f"{train.max_steps:,} updates. {last} checkpoints take {need:,} updates (--max-steps {need} or more, or "
            f"a smaller --eval-every)" + (f"; or average --last {len(found)}" if found else ""))


def _run_checkpoint(path: Path) -> bool:
    """Whether ``path`` is named as a run's own checkpoint: ``last``, ``best`` or ``step_N``."""
    return path.name in ("last", "best") or re.fullmatch(r"step_\d+", path.name) is not None


def check_out(inputs: list[str | Path], used: list[Path], out: str | Path, last: int | None) -> None:
    """Refuse an ``out`` that would overwrite what is being averaged: an input, a path inside one
    of the checkpoints, or a checkpoint of the run being averaged (``RUN/last``, ``RUN/best``,
    ``RUN/step_N``), which training and resuming rely on; and an ``out`` that holds a training
    checkpoint (trainer state) or lies in the directory of another run, running or not. A new name
    inside the directory of the run being averaged (``RUN/avg10``), or a previous average, is fine."""
    target = Path(out).resolve()
    runs = {Path(p).resolve() for p in inputs} if last is not None else set()
    runs |= {p.resolve().parent for p in used if _run_checkpoint(p.resolve())}
    if target.parent in runs and _run_checkpoint(target):
        raise CheckpointError(f"--out {out} is a checkpoint of the run being averaged ({target.parent}): "
                              "write the average to a new directory, e.g. RUN/avgN")
    for p in [*map(Path, inputs), *used]:
        r = p.resolve()
        if target == r or (r in target.parents and r not in runs):
            where = "is" if target == r else "is inside"
            raise CheckpointError(f"--out {out} {where} {p}, which is being averaged: "
                                  "write the average to a new directory")
    if (target / TRAINER_STATE).is_file():
        raise CheckpointError(f"--out {out} is a training checkpoint (it holds {TRAINER_STATE}, a run resumes "
                              "from it): write the average to a new directory")
    for d in (target, *target.parents):
        if d not in runs and is_run_directory(d):
            where = "is" if d == target else "is inside"
            raise CheckpointError(f"--out {out} {where} the run directory {d}, which is not being averaged: "
                                  "write the average to a new directory (or inside the averaged run's own)")


def average_checkpoints(inputs: list[str | Path], out: str | Path, last: int | None = None) -> list[Path]:
    """Average the checkpoints and write the result to ``out``; returns the checkpoints used."""
    paths = resolve_inputs(inputs, last)
    check_out(inputs, paths, out, last)
    ckpts = [read_checkpoint(p) for p in paths]
    # compared as ModelConfig, so that a field added by a later version (at its default) is no difference
    model_cfgs = [read_config(c, "model") for c in ckpts]
    for c, cfg in zip(ckpts[1:], model_cfgs[1:]):
        if cfg != model_cfgs[0]:
            raise CheckpointError(f"{c.path}: model config differs from {paths[0]}: not the same architecture")
    averaged = average_state_dicts([c.state_dict for c in ckpts], [str(p) for p in paths])
    model = build_model(model_cfgs[0])
    load_into(model, Checkpoint(paths[0], ckpts[0].config, averaged))
    tokenizers = TokenizerPair.load(paths[-1], ckpts[-1].files)
    config = dict(ckpts[-1].config)
    config["averaged_from"] = [str(p) for p in paths]
    save_checkpoint(Path(out), model, config, write_extra=tokenizers.save)
    return paths
