"""``qkv train`` as a library call: read the data a command line names (or take the embedded
default task), check it against a resumed run, and train."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from qkv.checkpoint import read_settings
from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.errors import QkvError
from qkv.tasks import DataPaths, get_task
from qkv.tasks.translate import ParallelData
from qkv.training import distributed
from qkv.training.trainer import TrainResult, train

EMBEDDED = "toy/train"  # the training data name recorded for the embedded default task


def trained_on(last: Path) -> str | None:
    """What the run whose commit point is ``last`` was trained on, if recorded."""
    data = read_settings(last).get("data")
    return data.get("train") if isinstance(data, dict) else None


def check_paths(paths: DataPaths) -> None:
    """Pairs of options that go together, before anything is read."""
    if bool(paths.src_train) != bool(paths.tgt_train):
        raise QkvError("give both --src-train and --tgt-train (or neither, for the embedded default task)")
    if bool(paths.src_valid) != bool(paths.tgt_valid):
        raise QkvError("give both --src-valid and --tgt-valid (or neither)")
    if paths.valid and not paths.train:
        raise QkvError("--valid needs --train")
    fraction = paths.valid_fraction or 0.0
    if not 0 <= fraction < 1:  # nan and inf fail this too
        raise QkvError(f"--valid-fraction must be in [0, 1) (0: none held out), got {fraction}")
    if paths.data and (paths.src_train or paths.src_valid or paths.train or paths.valid):
        raise QkvError("--data DIR holds the training and validation data (from qkv preprocess): give it "
                       "without --src-train/--tgt-train/--src-valid/--tgt-valid/--train/--valid")


def has_data(paths: DataPaths) -> bool:
    return bool(paths.src_train or paths.train or paths.data)


def check_resume_data(out: Path, paths: DataPaths, model_cfg: ModelConfig) -> None:
    """A resumed run reads the files it was started on, or the embedded task if it was trained on that."""
    saved = trained_on(out / "last")  # None: a checkpoint from before the data was recorded
    if saved not in (None, EMBEDDED) and not has_data(paths):
        parallel = get_task(model_cfg.task).data_kind == "parallel"
        raise QkvError(f"{out} was trained on {saved}: give the same "
                       f"{'--data (or --src-train and --tgt-train)' if parallel else '--train'} to resume it")
    if saved == EMBEDDED and has_data(paths):
        raise QkvError(f"{out} was trained on the embedded default task: resume it without --src-train")


def run_training(model_cfg: ModelConfig, train_cfg: TrainConfig, decode_cfg: DecodeConfig, paths: DataPaths,
                 out: Path, resume: bool, log: Callable[[str], None], tensorboard: str | None = None) -> TrainResult:
    """Train on the files of ``paths`` (or the embedded default task when none are given) into ``out``;
    ``tensorboard``: a directory for TensorBoard event files of the scalars in ``out/metrics.jsonl``."""
    task = get_task(model_cfg.task)
    if resume:
        check_resume_data(out, paths, model_cfg)
    elif not has_data(paths) and task.data_kind != "parallel":
        raise QkvError(f"--task {task.name} needs data: --train FILE (and --valid FILE); the embedded default task "
                       "is translation (translate or prefix_lm)")
    if not (resume or train_cfg.init_from):  # else the architecture is a checkpoint's
        task.check_positions(model_cfg, train_cfg)  # before any data are read
    if has_data(paths):
        if task.data_kind == "parallel" and paths.train:
            raise QkvError(f"--task {task.name} reads parallel files: --src-train/--tgt-train (and --src-valid/"
                           f"--tgt-valid); --train/--valid are for one-sided tasks (classify, mlm, lm)")
        if paths.data:
            if task.data_kind != "parallel":
                raise QkvError(f"--data (a directory from qkv preprocess) holds parallel text; --task {task.name} "
                               "reads --train/--valid")
            if train_cfg.tokenizer_from and not resume:
                raise QkvError("--data brings its own tokenizer (the ids are in its vocabulary): give "
                               "--tokenizer-from to qkv preprocess instead of qkv train")
            # a resumed run trusts the files it checked when it started: their sizes only, no checksums.
            # Under torchrun rank 0 alone reads the files for their checksums, the other ranks check the
            # sizes: none of them trains before rank 0 has checked (the process group, then a barrier,
            # wait for it), and a mismatch stops rank 0, then torchrun stops the others.
            paths = replace(paths, verify_data=not resume and distributed.env_rank() == 0)
        train_data, valid_data = task.read_data(replace(paths, clean_html=train_cfg.clean_html), log)
    else:
        log("no data given: training on the embedded default task, English number words -> German number words")
        splits = toy.default_splits()
        train_data, valid_data = (  # one word a number: BLEU means nothing, exact match is the metric
            ParallelData([s for s, _ in splits[split]], [t for _, t in splits[split]], name=name, metric="exact",
                         repeats=True)
            for split, name in (("train", EMBEDDED), ("valid", "toy/valid")))
    return train(model_cfg, train_cfg, decode_cfg, train_data, valid_data, out, resume=resume, log=log,
                 tensorboard=tensorboard)


__all__ = ["run_training", "check_paths", "check_resume_data", "trained_on"]
