"""The training loop, written once for every architecture and task (section 5).

What is task-specific comes from a :class:`qkv.tasks.base.Task` (chosen by ``ModelConfig.task``,
interface in :mod:`qkv.tasks`): reading the data, the tokenizer, encoding and collating a split,
the loss of a batch, extra validation metrics and which of them picks ``best/``. For translation:

* teacher forcing: the decoder reads the target shifted right (BOS + y) and predicts y + EOS;
* label-smoothed cross-entropy over non-padding target tokens (:mod:`qkv.losses`);

Everything else is here, the same for every task:

* Adam(β1=0.9, β2=0.98, ε=1e-9) with the warmup schedule, or a constant / inverse-sqrt rate
  (``schedule``, :mod:`qkv.training.schedule`); or SGD with Nesterov momentum (``optimizer = "nag"``,
  fairseq 0.9's default optimizer, for runs that follow fairseq 0.9 commands without ``--optimizer``);
* gradient clipping, gradient accumulation (``update_freq``);
* length-bucketed batches under a token budget (:mod:`qkv.data.batching`);
* the device (``device``: CPU or CUDA, fused Adam on CUDA), mixed precision (``amp``: bf16, or fp16
  with a gradient scaler) and ``torch.compile`` (``compile``: the forward and the loss as one graph,
  on padded shapes); on CUDA an update that never waits for the device, its figures read back every
  50 updates (:mod:`qkv.training.step`);
* data parallelism under ``torchrun`` (:mod:`qkv.training.distributed`): an update takes
  ``update_freq x world_size`` batches of the one seeded batch order, rank r trains on every
  world_size-th of them, and the loss is normalised by the update's global number of target
  tokens, so N processes compute the update of one process with ``update_freq x N``;
* periodic validation: loss, perplexity, and the task's metrics (BLEU of greedy output on a sample
  for translation, accuracy and macro-F1 for classification);
* checkpoints ``last/`` and ``best/`` (best by the task's ``best_metric``: the lowest validation
  loss for translation), written atomically, and ``--resume``
  that continues exactly where a run stopped: weights, optimizer, step, position in the epoch's
  batch order and the RNG state are all restored;
* nothing lost on a crash: the run directory is locked for the run (:mod:`qkv.training.rundir`);
  ``best/`` and ``step_N/`` are written before ``last/``, the run's commit point, so a kill at any
  moment resumes to the weights of the uninterrupted run; Ctrl-C and SIGTERM stop at the next update
  boundary (a second one stops at once); an update with a non-finite loss or gradient norm is
  skipped, ``nonfinite_limit`` of them in a row stop the run (exit status 3), and non-finite weights
  are never saved;
* a progress bar (or, without a terminal, a line every 50 updates) with loss, learning rate, tokens/s,
  the time trained and an estimate of the time left (:mod:`qkv.training.progress`); every record
  appended to ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from qkv.config import DEFAULT_LR, DecodeConfig, ModelConfig, TrainConfig, per_process_batch, to_dict
from qkv.data.binarized import is_corpus, tokenizer_of
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import ConfigError, QkvError, TrainingDiverged
from qkv.files import os_error_reason
from qkv.models import build_model
from qkv.tasks import get_task
from qkv.tasks.base import Task, checkpoint_tokenizers, init_model_config, init_positions, init_weights
from qkv.tasks.translate import EncodedSplit, ParallelData, encode_split  # noqa: F401  (public here too)
from qkv.training import distributed
from qkv.checkpoint import (MANIFEST, fault_point, list_checkpoints, load_into, read_checkpoint, read_settings,
                            save_checkpoint, step_path)
from qkv.training.distributed import DistInfo
from qkv.training.progress import clock_fields
from qkv.training.rundir import RunLock, holds_checkpoints, missing_last_message, recover, truncate_metrics
from qkv.training.schedule import cooldown, learning_rate
from qkv.training import step as step_mod
from qkv.training.step import READ_EVERY, grad_norm, loss_function, pad_batch, supports_found_inf, sync_free_update


# the metrics.jsonl field of the training rate, by what the task's batches count (Task.unit)
RATE_FIELDS = {"tok": "tokens_per_s", "ex": "examples_per_s"}


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    valid: dict = field(default_factory=dict)  # the last validation record (empty on ranks other than 0)
    is_main: bool = True  # False on the ranks > 0 of a distributed run (which write nothing)


def _quiet(msg: str) -> None:
    pass


def _to_cpu(obj):
    """A copy of a (nested) state dict with every tensor on the CPU: checkpoints load on any device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def build_optimizer(params, train_cfg: TrainConfig, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer named by ``train_cfg.optimizer``; its rate is set before every update.

    * ``adam``: Adam(β1, β2, ε) as the paper trains (with ``fused``, one kernel for all parameters:
      the trainer fuses it on CUDA, and wherever the update is sync-free, :mod:`qkv.training.step`).
    * ``nag``: SGD with Nesterov momentum μ (``momentum``), fairseq 0.9's default optimizer. fairseq's
      NAG keeps its buffer with the rate folded in, b ← μ·(lr/lr_prev)·b − lr·g, and steps
      θ ← θ + μ²·(lr/lr_prev)·b_prev − (1+μ)·lr·g; with B = −b/lr that is exactly torch's
      ``SGD(nesterov=True)``: B ← μB + g, θ ← θ − lr·(g + μB), also when the rate changes between
      updates. (Its weight decay differs: torch adds ``weight_decay·θ`` to the gradient, fairseq
      shrinks θ by ``1 − lr·weight_decay``; the published runs used none.)
    """
    if train_cfg.optimizer == "nag":
        return torch.optim.SGD(params, lr=0.0, momentum=train_cfg.momentum, nesterov=True,
                               weight_decay=train_cfg.weight_decay)
    return torch.optim.Adam(
        params,
        lr=0.0,
        betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
        eps=train_cfg.adam_eps,
        weight_decay=train_cfg.weight_decay,
        **({"fused": True} if fused else {}),  # one kernel for all parameters
    )


def _rank_seed(seed: int, rank: int) -> int:
    """Rank r > 0 draws its dropout masks from its own stream (rank 0 keeps the single-process one)."""
    return seed + 1_000_003 * rank


def _log_stderr(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


class Trainer:
    """Owns the model, the optimizer and the loop; the public entry point is :func:`train`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        decode_cfg: DecodeConfig,
        tokenizers: TokenizerPair,
        train_split,
        valid_split,
        out_dir: Path,
        log: Callable[[str], None] = _log_stderr,
        data_name: str = "data",
        device: torch.device | str = "cpu",
        dist_info: DistInfo | None = None,
        task: Task | None = None,
        sync_free: bool | None = None,
    ):
        """``train_split``/``valid_split``: what ``task.encode`` returned (see :mod:`qkv.tasks`).

        ``sync_free``: updates that never wait for the device, their figures read back every
        :data:`~qkv.training.step.READ_EVERY` updates (:mod:`qkv.training.step`); default: on CUDA. Used
        on one process with Adam and without fp16 (whose gradient scaler reads its overflow check)."""
        self.train_cfg, self.decode_cfg = train_cfg, decode_cfg
        self.task = task or get_task(model_cfg.task)
        self.model_cfg = self.task.model_config(model_cfg, tokenizers).validate()
        self.task.check_positions(self.model_cfg, train_cfg)
        self.tokenizers = tokenizers
        self.train_split, self.valid_split = train_split, valid_split
        self.out_dir, self.log = out_dir, log
        self.device = torch.device(device)
        self.dist = dist_info or DistInfo()
        torch.manual_seed(train_cfg.seed)
        # Built on the CPU from the seed, then moved: the same initial weights on every device.
        self.model = build_model(self.model_cfg).to(self.device)  # the plain module: saved, validated
        if self.dist.rank > 0:
            torch.manual_seed(_rank_seed(train_cfg.seed, self.dist.rank))
        on_cuda = self.device.type == "cuda"
        if sync_free is None:
            sync_free = self.device.type in step_mod.SYNC_FREE_DEVICES
        self.sync_free = sync_free and not self.dist.distributed \
            and train_cfg.amp != "fp16" and train_cfg.optimizer == "adam"
        self.optimizer = build_optimizer(self.model.parameters(), train_cfg, fused=on_cuda or self.sync_free)
        self.sync_free = self.sync_free and supports_found_inf(self.optimizer)
        self._pending = None  # a sync-free run's device-side counters (see _read_back)
        # fp16 gradients underflow without loss scaling; bf16 has float32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda") if train_cfg.amp == "fp16" else None
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train_cfg.amp)
        # What the training forward runs through: DDP (which all-reduces the gradients in
        # backward) around the model, then torch.compile around that, as PyTorch recommends.
        self.ddp: DistributedDataParallel | None = None
        module: torch.nn.Module = self.model
        if self.dist.distributed:
            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if on_cuda else None)
            module = self.ddp
        # One process compiles the forward and the loss whole (fullgraph), on padded shapes (qkv.training.step);
        # under DDP the module is compiled (DDP's bucketing breaks the graph between all-reduces).
        self.pad_shapes = train_cfg.compile and self.ddp is None
        self.train_module = torch.compile(module) if train_cfg.compile and self.ddp is not None else module
        self.train_loss = loss_function(self.task, self.train_module, train_cfg, self.device, self.amp_dtype,
                                        compile=self.pad_shapes)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of the current epoch already consumed
        # the best value so far of the task's selection metric, stored as "lower is better"
        self.best_score = math.inf
        self.bad_evals = 0  # validations in a row since the last new best (for patience)
        self.lr_shrinks = 0  # times patience ran out and the rate was multiplied by lr_shrink
        self.nonfinite = 0  # updates in a row skipped for a non-finite loss or gradient norm
        self.elapsed = 0.0  # seconds of training of this run, over every resume
        self.metrics_path = out_dir / "metrics.jsonl"
        self.data_name = data_name  # what the run trains on (recorded in the checkpoint's config)
        self.data_fingerprint = ""  # and a digest of its content, checked on --resume
        self.saved_last = -1  # the step last/ holds (-1: none written by this process)
        self.stop_flag: _StopFlag | None = None  # set by Ctrl-C / SIGTERM while run() is active
        self.tensorboard = None  # a SummaryWriter (rank 0, with --tensorboard): the scalars of metrics.jsonl

    # --- state ---------------------------------------------------------------------------------------

    def config_dict(self) -> dict:
        data = {"train": self.data_name, **({"fingerprint": self.data_fingerprint} if self.data_fingerprint else {})}
        return {"model": to_dict(self.model_cfg), "train": to_dict(self.train_cfg), "decode": to_dict(self.decode_cfg),
                "data": data, **self.task.state()}

    def _rng_state(self) -> list[torch.Tensor]:
        """This process's random state: the CPU generator, and the GPU's when training on one."""
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    def gather_rng(self) -> list[list[torch.Tensor]] | None:
        """Every rank's random state (a collective: all ranks call it); None for a single process."""
        if not self.dist.distributed:
            return None
        per_kind = [distributed.all_gather_bytes(t) for t in self._rng_state()]  # [kind][rank]
        return [list(states) for states in zip(*per_kind)]  # [rank][kind]

    def trainer_state(self, rank_rng: list[list[torch.Tensor]] | None = None) -> dict:
        """Everything besides the weights that resuming needs; tensors on the CPU."""
        own = self._rng_state()
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best_metric": self.task.best_metric,
            "best_score": self.best_score,
            "bad_evals": self.bad_evals,
            "lr_shrinks": self.lr_shrinks,
            "nonfinite": self.nonfinite,
            "elapsed": self.elapsed,
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "torch_rng": own[0],
            "world_size": self.dist.world_size,
        }
        if len(own) > 1:
            state["cuda_rng"] = own[1]
        if rank_rng is not None:
            state["rank_rng"] = rank_rng  # [rank][cpu, cuda?]: each rank resumes its own dropout stream
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def save(self, name: str, rank_rng: list[list[torch.Tensor]] | None = None) -> Path:
        """Write checkpoint ``name``; refuse (exit status 3) if any weight is not finite."""
        path = self.out_dir / name
        finite = torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()
        if not bool(finite):
            kept = f"{self.out_dir / 'last'} holds step {self.saved_last}" if self.saved_last >= 0 else \
                f"the checkpoints in {self.out_dir} are those of earlier steps"
            raise TrainingDiverged(f"step {self.step}: the weights are not finite, so {path} was not written ({kept}); "
                                   "lower the learning rate (lr, lr_scale) or raise warmup_steps")
        save_checkpoint(path, self.model, self.config_dict(), write_extra=self.tokenizers.save,
                        trainer_state=self.trainer_state(rank_rng))
        if name == "last":
            self.saved_last = self.step
        return path

    def save_numbered(self, rank_rng: list[list[torch.Tensor]] | None = None) -> None:
        """The ``step_NNNNNN/`` checkpoint of this step (for averaging), when ``keep_last`` asks for them."""
        if self.train_cfg.keep_last > 0:
            self.save(step_path(self.out_dir, self.step).name, rank_rng)
            fault_point("saved:step")

    def prune_numbered(self) -> None:
        """Keep the newest ``keep_last`` ``step_N/`` checkpoints (after last/ is committed)."""
        keep = self.train_cfg.keep_last
        if keep > 0:
            for old in list_checkpoints(self.out_dir)[:-keep]:
                shutil.rmtree(old)

    def restore(self, path: Path) -> None:
        """Continue from the checkpoint at ``path`` (every rank reads it), on whatever device this run uses."""
        ckpt = read_checkpoint(path, need_trainer_state=True)
        if ckpt.trainer_state is None:
            raise QkvError(f"{path}: checkpoint has no trainer_state.pt, so training cannot resume from it")
        load_into(self.model, ckpt)
        st = ckpt.trainer_state
        # The saved param groups also name the Adam implementation (fused on CUDA); keep this run's,
        # so that a run saved on a GPU resumes on a CPU and the other way round.
        impl = {k: v for k, v in self.optimizer.param_groups[0].items()
                if k in ("fused", "foreach", "capturable", "differentiable")}
        opt_state = st["optimizer"]
        opt_state = {**opt_state, "param_groups": [{**g, **impl} for g in opt_state["param_groups"]]}
        self.optimizer.load_state_dict(opt_state)
        if self.scaler is not None and "grad_scaler" in st:
            self.scaler.load_state_dict(st["grad_scaler"])
        self.step, self.epoch, self.batch_in_epoch = int(st["step"]), int(st["epoch"]), int(st["batch_in_epoch"])
        self.best_score = float(st["best_score"] if "best_score" in st else st["best_valid_loss"])
        self.elapsed = float(st["elapsed"])
        self.bad_evals = int(st.get("bad_evals", 0))  # older checkpoints: counting starts again here
        self.lr_shrinks = int(st.get("lr_shrinks", 0))
        self.nonfinite = int(st.get("nonfinite", 0))
        self._pending = None
        self.saved_last = self.step if path.name == "last" else -1
        self._check_update_size(path, int(ckpt.config.get("train", {}).get("update_freq", 1)),
                                int(st.get("world_size", 1)))
        rank_rng = st.get("rank_rng")
        if rank_rng is not None and len(rank_rng) == self.dist.world_size:
            states = list(rank_rng[self.dist.rank])
        elif self.dist.rank == 0:
            states = [st["torch_rng"]] + ([st["cuda_rng"]] if "cuda_rng" in st else [])
        else:  # resumed with another number of processes: a fresh stream of this rank's own
            torch.manual_seed(_rank_seed(self.train_cfg.seed, self.dist.rank) + self.step)
            states = []
        if states:
            torch.set_rng_state(states[0])
        if len(states) > 1 and self.device.type == "cuda":
            torch.cuda.set_rng_state(states[1], self.device)

    def _check_update_size(self, path: Path, saved_freq: int, saved_world: int) -> None:
        """An update takes update_freq x processes batches. --update-freq may change on --resume only to keep
        that size (with another number of processes); a run resumed on other processes without it is told
        the value that would."""
        freq, world = self.train_cfg.update_freq, self.dist.world_size
        size, saved_size = freq * world, saved_freq * saved_world
        keep = f"--update-freq {saved_size // world}" if saved_size % world == 0 else None
        if self.train_cfg.update_tokens:  # the batches are the share of update_tokens: the update keeps its size
            if (freq, world) != (saved_freq, saved_world):
                self.log(f"note: {path} was written by a run of {saved_world} process(es) x update_freq {saved_freq}; "
                         f"this one has {world} x {freq}: update_tokens {self.train_cfg.update_tokens:,} is shared "
                         f"out as {self.train_cfg.max_tokens:,} tokens a batch")
            return
        if freq != saved_freq and size != saved_size:
            raise QkvError(f"--update-freq {freq} with {world} process(es) makes an update of {size} batches where "
                           f"{path} took {saved_size} ({saved_freq} x {saved_world} process(es)): on --resume "
                           "--update-freq may change only to keep the update's size"
                           + (f" (give {keep})" if keep else " (no whole --update-freq does with this many processes)"))
        if saved_world != world:
            self.log(f"note: {path} was written by a run of {saved_world} process(es), this one has {world}: an "
                     f"update now takes {freq} x {world} batches (was {saved_freq} x {saved_world})"
                     + ("" if size == saved_size else f"; {keep} keeps its size" if keep else ""))

    def record(self, entry: dict) -> None:
        if not self.dist.is_main:
            return
        entry = {**entry, "time": round(time.time(), 3)}  # when (Unix seconds): curves against wall time
        try:
            with self.metrics_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
        except OSError as e:
            raise QkvError(f"cannot write {self.metrics_path}: {os_error_reason(e)} (the checkpoints in "
                           f"{self.out_dir} are as the last save left them)") from None
        if self.tensorboard is not None:  # the same scalars, at the same step
            for key, value in entry.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, entry.get("step", self.step))
            self.tensorboard.flush()

    # --- the loop ------------------------------------------------------------------------------------

    def lr(self, step: int) -> float:
        c = self.train_cfg
        return (learning_rate(c.schedule, step, d_model=self.model_cfg.d_model, warmup=c.warmup_steps,
                              scale=c.lr_scale, lr=c.lr, default_lr=DEFAULT_LR) * c.lr_shrink**self.lr_shrinks
                * cooldown(step, c.max_steps, c.cooldown_steps))

    def loss(self, batch, train: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, nll_sum) of ``batch`` (on the device), by the task; ``train``: through the
        training forward (DDP / compiled, under autocast), else the plain model in full precision.
        The task computes the loss from the logits in float32 whatever their dtype."""
        if train:
            return self.train_loss(batch)
        return self.task.loss(self.model, batch, self.train_cfg)

    def _stop_reason(self, started: float) -> str | None:
        c = self.train_cfg
        if self.step >= c.max_steps:
            return f"reached max_steps={c.max_steps}"
        if c.max_epochs and self.epoch >= c.max_epochs:
            return f"reached max_epochs={c.max_epochs}"
        if c.patience and self.bad_evals >= c.patience:  # the same on every rank (synced after validation)
            shrunk = f", after {self.lr_shrinks} learning-rate shrinks" if self.lr_shrinks else ""
            return (f"converged: {self.bad_evals} validations in a row without a new best "
                    f"{self.task.best_metric} (patience={c.patience}{shrunk})")
        if c.max_time:  # clocks differ between processes: stop when any of them says so
            time_up = self.elapsed + (time.perf_counter() - started) >= c.max_time
            if distributed.any_rank(time_up) if self.dist.distributed else time_up:
                return f"reached max_time={c.max_time:g}s"
        return None

    def _groups(self):
        """Yield the batches (index lists) of each update, resuming mid-epoch where the state says.

        An update takes ``update_freq x world_size`` consecutive batches of the epoch's seeded
        order, the same on every rank; the last update of an epoch may take fewer. The position
        advances in :meth:`train_step`, once the update is made.
        """
        c = self.train_cfg
        size = c.update_freq * self.dist.world_size
        while True:
            order = self.train_split.batches(c.max_tokens, shuffle=True, seed=c.seed, epoch=self.epoch)
            while self.batch_in_epoch < len(order):
                yield order[self.batch_in_epoch : self.batch_in_epoch + size]
            self.epoch += 1
            self.batch_in_epoch = 0
            if c.max_epochs and self.epoch >= c.max_epochs:
                return

    def train_step(self, group: list[list[int]]) -> dict:
        """One optimizer update over the batches of ``group``; the loss is normalised per target token.

        Each rank trains on ``group[rank::world_size]``. The gradient of the update is

            sum over the group's batches of grad(loss_sum(batch)) / N,

        N = the group's target tokens (summed over ranks). DDP averages the ranks' gradients,
        so each rank divides by N / world_size: the average of the ranks' sums is the sum
        above, the update of one process with ``update_freq x world_size``. The ranks' gradients
        are all-reduced in the backward of their last batch only (``no_sync`` before it). A rank
        whose share of an epoch's last, short group is empty still joins that all-reduce, with a
        zero-weighted backward of another batch.

        A sync-free trainer (``self.sync_free``) runs :meth:`_sync_free_step` instead, whose figures stay
        on the device until :meth:`_read_back`.
        """
        if self.sync_free:
            return self._sync_free_step(group)
        self.model.train()
        world = self.dist.world_size
        batches = [self.train_split.collate(ix) for ix in group[self.dist.rank :: world]]
        weights = [1.0] * len(batches)
        n_tokens = sum(b.n_tgt_tokens for b in batches)  # counted on the CPU: no device sync
        if self.dist.distributed:
            n_tokens = int(distributed.all_reduce_sum(torch.tensor([n_tokens], dtype=torch.long)).item())
            if not batches:
                batches, weights = [self.train_split.collate(group[0])], [0.0]
        if self.pad_shapes:
            batches = [pad_batch(b) for b in batches]
        denominator = n_tokens / world
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        for i, (batch, weight) in enumerate(zip(batches, weights)):
            batch = batch.to(self.device, non_blocking=True)
            last = i == len(batches) - 1
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                loss, nll = self.loss(batch, train=True)
                objective = loss / denominator if weight else loss * 0.0
                (self.scaler.scale(objective) if self.scaler is not None else objective).backward()
            if weight:
                loss_sum += loss.detach()
                nll_sum += nll.detach()
        sums = distributed.all_reduce_sum(torch.stack([loss_sum, nll_sum])) if self.dist.distributed \
            else torch.stack([loss_sum, nll_sum])
        lr = self.lr(self.step + 1)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
        grad_norm = self._grad_norm()
        loss_total, nll_total = sums.tolist()
        # A non-finite loss or gradient skips the update (the batches are consumed, the step is not
        # counted). Under fp16 the scaler skips overflowing gradients itself and lowers its scale.
        finite = math.isfinite(loss_total) and (self.scaler is not None or math.isfinite(grad_norm))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when the fp16 gradients overflowed
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.batch_in_epoch += len(group)
        if finite:
            self.step += 1
            self.nonfinite = 0
        else:
            self.nonfinite += 1
        return {"loss": loss_total / n_tokens, "nll": nll_total / n_tokens, "lr": lr, "tokens": n_tokens,
                "grad_norm": grad_norm, "skipped": not finite}

    def _grad_norm(self) -> float:
        """The global L2 norm of the gradients, clipped to ``clip_norm`` on the way when that is set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        return float(grad_norm(params, self.train_cfg.clip_norm))

    def _sync_free_step(self, group: list[list[int]]) -> dict:
        """One update (one process) that never waits for the device (:mod:`qkv.training.step`).

        The same update as :meth:`train_step`'s, except for what is known when it returns: the loss,
        the gradient norm and whether the update was skipped stay on the device (``"deferred": True``;
        :meth:`_read_back` reads them), and the step is counted whether or not the device skipped it
        (as the fp16 gradient scaler's skipped updates are): the next read-back reports skipped updates
        and stops a run that has had ``nonfinite_limit`` of them in a row.
        """
        self.model.train()
        if self._pending is None:
            # filled on the device (torch.tensor(x, device=...) would copy from the host and wait)
            self._pending = {"run": torch.full((), self.nonfinite, dtype=torch.long, device=self.device),  # in a row
                             "skipped": torch.zeros((), dtype=torch.long, device=self.device), "from": self.step}
        batches = [self.train_split.collate(ix) for ix in group]
        n_tokens = sum(b.n_tgt_tokens for b in batches)  # counted on the host, before the copy
        if self.pad_shapes:
            batches = [pad_batch(b) for b in batches]
        if self.device.type == "cuda":
            batches = [b.pin_memory() if hasattr(b, "pin_memory") else b for b in batches]
        lr = self.lr(self.step + 1)
        stats = self._device_update(batches, n_tokens, lr)
        self.batch_in_epoch += len(group)
        self.step += 1
        return stats

    def _device_update(self, batches: list, n_tokens: int, lr: float) -> dict:
        """The device's part of a sync-free update: copies, forward and loss, backward, the gradient norm
        and the optimizer's step, with nothing read back (``tests/test_step.py`` makes every read raise)."""
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        for batch in batches:
            loss, nll = self.loss(batch.to(self.device, non_blocking=True), train=True)
            (loss / n_tokens).backward()
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        norm, finite = sync_free_update(self.optimizer, list(self.model.parameters()), loss_sum,
                                        self.train_cfg.clip_norm)
        bad = (~finite).long()
        self._pending["run"] = (self._pending["run"] + 1) * bad  # 0 again after a finite update
        self._pending["skipped"] += bad
        return {"loss": loss_sum / n_tokens, "nll": nll_sum / n_tokens, "lr": lr, "tokens": n_tokens,
                "grad_norm": norm, "skipped": False, "deferred": True}

    def _read_back(self, stats: dict | None = None) -> dict | None:
        """A sync-free run's figures, read from the device (the one host sync of READ_EVERY updates):
        ``stats`` with floats for its tensors; warns about the updates the device skipped since the
        last read and stops a run whose last ``nonfinite_limit`` updates were all skipped."""
        if stats is not None and stats.get("deferred"):
            keys = ("loss", "nll", "grad_norm")
            stats = {**stats, **dict(zip(keys, torch.stack([stats[k].float() for k in keys]).tolist())),
                     "deferred": False}
        if self._pending is None:
            return stats
        run, skipped = (int(v) for v in torch.stack([self._pending["run"], self._pending["skipped"]]).tolist())
        first = self._pending["from"]
        self._pending = None
        self.nonfinite = run
        if skipped:
            limit = self.train_cfg.nonfinite_limit
            self.log(f"warning: steps {first + 1}-{self.step}: {skipped} update(s) with a non-finite loss or "
                     f"gradient norm, skipped ({run} in a row at step {self.step}; training stops at {limit})")
            if run >= limit:
                kept = f"{self.out_dir / 'last'} holds step {self.saved_last}" if self.saved_last >= 0 else \
                    "no checkpoint was written"
                raise TrainingDiverged(f"training diverged: the last {run} updates had a non-finite loss or gradient "
                                       f"norm (nonfinite_limit={limit}) at step {self.step}; nothing non-finite was "
                                       f"saved ({kept}); lower the learning rate (lr, lr_scale) or raise warmup_steps")
        return stats

    @torch.no_grad()
    def validate(self) -> dict:
        """Validation loss and perplexity over the whole split, then the task's metrics (for
        translation: BLEU/exact match of greedy output on a sample)."""
        split = self.valid_split
        assert split is not None
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        n_tokens = 0
        for ix in split.batches(self.train_cfg.max_tokens, shuffle=False, seed=0, epoch=0):
            batch = split.collate(ix)
            n_tokens += batch.n_tgt_tokens
            loss, nll = self.loss(batch.to(self.device, non_blocking=True))
            sums += torch.stack([loss, nll]).double()
        loss_sum, nll_sum = sums.tolist()
        out = {"valid_loss": loss_sum / n_tokens, "valid_nll": nll_sum / n_tokens,
               "valid_ppl": math.exp(min(nll_sum / n_tokens, 50.0))}
        out.update(self.task.metrics(self.model, split, self.tokenizers, self.decode_cfg, self.train_cfg))
        return out

    def _score(self, record: dict) -> float:
        """The task's selection metric as "lower is better"."""
        value = float(record[self.task.best_metric])
        return -value if self.task.best_mode == "max" else value

    def _shrink_on_plateau(self) -> None:
        """Reduce on plateau: when patience has run out and shrinks are left, multiply the rate by
        ``lr_shrink`` and start counting patience again, instead of stopping."""
        c = self.train_cfg
        if c.patience and self.bad_evals >= c.patience and self.lr_shrinks < c.max_lr_shrinks:
            self.lr_shrinks += 1
            self.bad_evals = 0
            self.log(f"step {self.step}: {c.patience} validations without a new best {self.task.best_metric}: "
                     f"learning rate x{c.lr_shrink:g} (shrink {self.lr_shrinks} of {c.max_lr_shrinks}; "
                     f"now {self.lr(max(self.step, 1)):.2e})")

    def _validate_and_save(self, bar: tqdm | None) -> dict:
        """Validate and write checkpoints: on rank 0 alone, once every rank's random state is gathered.

        The order makes every crash point recoverable: the record, then ``best/`` and ``step_N/``,
        then ``last/`` (the commit point: a run resumes from it), then the pruning of old ``step_N/``.
        A kill before ``last/`` is committed resumes from the previous ``last/`` and redoes these
        steps, bit for bit, so ``best/`` is never left behind the ``best_score`` that ``last/`` records.
        """
        self._read_back()  # a sync-free run's skipped updates, before anything is saved
        rank_rng = self.gather_rng()  # a collective: every rank calls this method
        if not self.dist.is_main:
            return {}
        record: dict = {"step": self.step, "epoch": self.epoch}
        improved = True  # without validation data, best/ is the newest checkpoint
        if self.valid_split is not None and len(self.valid_split) > 0:
            v = self.validate()
            samples = v.pop("valid_samples", [])
            record.update(v)
            score = self._score(v)
            improved = score < self.best_score
            if improved:
                self.best_score = score
            self.bad_evals = 0 if improved else self.bad_evals + 1
            msg = (f"step {self.step}: valid loss {v['valid_loss']:.3f}  ppl {v['valid_ppl']:.2f}"
                   + self.task.summary(v)
                   + ("  (best)" if improved else ""))
            self.log(msg)
            for s, h, r in samples[:1]:
                self.log(f"  src: {s}\n  hyp: {h}\n  ref: {r}")
            self._shrink_on_plateau()  # before the checkpoints: last/ resumes with the rate it decided
        self.record(record)
        if improved:
            self.save("best", rank_rng)
            fault_point("saved:best")
        self.save_numbered(rank_rng)
        self.save("last", rank_rng)
        fault_point("saved:last")
        self.prune_numbered()
        return record

    def run(self) -> TrainResult:
        with _stop_on_signals() as flag:
            self.stop_flag = flag
            try:
                return self._run()
            finally:
                self.stop_flag = None

    def _signalled(self) -> bool:
        """Whether Ctrl-C / SIGTERM asked to stop (on any rank: all ranks stop at the same update)."""
        asked = self.stop_flag is not None and self.stop_flag.signum is not None
        return distributed.any_rank(asked) if self.dist.distributed else asked

    def _on_skipped(self, stats: dict) -> None:
        """Warn about an update skipped for a non-finite loss or gradient; stop after too many in a row."""
        limit = self.train_cfg.nonfinite_limit
        what = " and ".join(f"{name} {stats[key]:.4g}" for name, key in (("loss", "loss"), ("gradient norm", "grad_norm"))
                            if not math.isfinite(stats[key]))
        self.log(f"warning: step {self.step + 1}: non-finite {what}: update skipped "
                 f"({self.nonfinite} in a row; training stops at {limit})")
        if self.nonfinite >= limit:
            kept = f"{self.out_dir / 'last'} holds step {self.saved_last}" if self.saved_last >= 0 else \
                "no checkpoint was written"
            raise TrainingDiverged(f"training diverged: {self.nonfinite} updates in a row had a non-finite loss or "
                                   f"gradient norm (nonfinite_limit={limit}) after step {self.step}; nothing "
                                   f"non-finite was saved ({kept}); lower the learning rate (lr, lr_scale) or "
                                   "raise warmup_steps")

    def _run(self) -> TrainResult:
        c = self.train_cfg
        main = self.dist.is_main
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        # the bar's clock is the run's own (over every resume, with max_time): in the postfix, not tqdm's
        bar = tqdm(total=c.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (main and sys.stderr.isatty()), file=sys.stderr,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{rate_fmt}{postfix}]")
        window_tokens, window_start = 0, time.perf_counter()
        last_record: dict = {}
        logged = False
        self._shrink_on_plateau()  # a run resumed with more shrinks allowed than it had when it stopped
        if self.step == 0 and self.saved_last < 0:  # a new run commits its start: a kill before the first
            rank_rng = self.gather_rng()            # validation resumes from here, never starts over a run dir
            if main:
                self.save("last", rank_rng)
                fault_point("saved:start")
        reason = self._stop_reason(started)
        try:
            for group in self._groups() if reason is None else ():
                stats = self.train_step(group)
                if stats.get("deferred") and (self.step % READ_EVERY == 0 or self.step == 1 or not logged
                                              or self.step % c.eval_every == 0 or self.step >= c.max_steps):
                    stats = self._read_back(stats)  # a sync-free run reads its figures back only now
                if stats["skipped"]:
                    self._on_skipped(stats)
                else:
                    window_tokens += stats["tokens"]
                    bar.update(1)
                if not stats["skipped"] and not stats.get("deferred"):
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_start, 1e-9)
                    elapsed = self.elapsed + now - started
                    bar.set_postfix_str(f"loss {stats['loss']:.3f}, lr {stats['lr']:.2e}, {tok_s:,.0f} "
                                        f"{self.task.unit}/s, {clock_fields(self.step, c.max_steps, elapsed, c.max_time)}")
                    if self.step % READ_EVERY == 0 or self.step == 1:
                        self._log_progress(stats, tok_s, bar, elapsed)
                        window_tokens, window_start = 0, now
                    elif not logged and bar.disable and main:  # a resumed run says when it trains again
                        self.log(f"step {self.step}/{c.max_steps}  epoch {self.epoch}  loss {stats['loss']:.3f}  "
                                 "(the first update since resuming)")
                    logged = True
                reason = self._stop_reason(started)
                if reason or (not stats["skipped"] and (self.step % c.eval_every == 0 or self.step == c.first_eval)):
                    self.elapsed += time.perf_counter() - started
                    started = time.perf_counter()
                    last_record = self._validate_and_save(bar)
                    if c.patience:  # rank 0 validated: every rank takes its count, so all stop together
                        self.bad_evals = distributed.from_main(self.bad_evals)
                        self.lr_shrinks = distributed.from_main(self.lr_shrinks)
                        reason = reason or self._stop_reason(started)
                if reason:
                    break
                if self._signalled():  # between two updates: the state is whole, and resumes exactly
                    self.elapsed += time.perf_counter() - started
                    self._save_interrupted()
                    raise KeyboardInterrupt(f"signal {self.stop_flag.signum if self.stop_flag else ''}")
            else:
                if reason is None:
                    reason = f"reached max_epochs={c.max_epochs}"
                    self.elapsed += time.perf_counter() - started
                    last_record = self._validate_and_save(bar)
        except KeyboardInterrupt:
            if main and self.saved_last != self.step:  # a second signal: stopped at once, mid-update
                where = f"{self.out_dir / 'last'} holds step {self.saved_last}" if self.saved_last >= 0 else \
                    "no checkpoint was written"
                self.log(f"interrupted again at step {self.step}: stopped without saving ({where})")
            raise
        finally:
            bar.close()
        distributed.barrier()  # every rank returns once rank 0's checkpoints are written
        kept = " and ".join(str(self.out_dir / n) for n in ("last", "best") if (self.out_dir / n).is_dir())
        self.log(f"stopped: {reason}; checkpoints in {kept}")
        return TrainResult(self.out_dir, self.step, last_record, is_main=main)

    def _log_progress(self, stats: dict, tok_s: float, bar: tqdm, elapsed: float) -> None:
        c = self.train_cfg
        self.record({"step": self.step, "epoch": self.epoch, "train_loss": stats["loss"],
                     "train_nll": stats["nll"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                     RATE_FIELDS.get(self.task.unit, f"{self.task.unit}_per_s"): tok_s})
        if bar.disable and self.dist.is_main:  # no terminal (a log file, CI): the progress as lines
            self.log(f"step {self.step}/{c.max_steps}  epoch {self.epoch}  loss {stats['loss']:.3f}  "
                     f"lr {stats['lr']:.2e}  {tok_s:,.0f} {self.task.unit}/s  "
                     + clock_fields(self.step, c.max_steps, elapsed, c.max_time))

    def _save_interrupted(self) -> None:
        """Commit last/ at this update boundary, after Ctrl-C or SIGTERM (every rank calls it)."""
        self._read_back()
        rank_rng = self.gather_rng()  # a collective: the ranks stopped at the same update
        if self.dist.is_main:
            if self.saved_last == self.step:
                self.log(f"interrupted at step {self.step}: {self.out_dir / 'last'} already holds it "
                         "(resume with --resume)")
            else:
                self.log(f"interrupted at step {self.step}: saving {self.out_dir / 'last'} (resume with --resume)")
                self.save("last", rank_rng)
        distributed.barrier()


class _StopFlag:
    signum: int | None = None


@contextlib.contextmanager
def _stop_on_signals():
    """Ctrl-C and SIGTERM (``kill``, a batch scheduler's preemption) ask training to stop: the loop
    finishes the update under way, commits ``last/`` and raises KeyboardInterrupt, so the run resumes
    exactly. A second signal stops at once (``last/`` then holds the previous commit)."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def request_stop(signum, frame):
        if flag.signum is not None:
            raise KeyboardInterrupt(f"signal {signum}, again")
        flag.signum = signum

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def data_fingerprint(data) -> str:
    """A digest of the training examples (both sides, the labels), recorded with the run so that
    ``--resume`` with other data is refused. Preprocessed data carry their own (the digest of their
    manifest's checksums), so a resumed run reads nothing but the manifest."""
    recorded = getattr(data, "fingerprint", None)
    if recorded:
        return recorded
    h = hashlib.sha256()
    for name in ("src", "tgt", "texts", "labels"):
        lines = getattr(data, name, None)
        if lines is None:
            continue
        h.update(f"{name}\t{len(lines)}\n".encode())
        for line in lines:
            h.update(str(line).encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()[:32]


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    decode_cfg: DecodeConfig,
    train_data,
    valid_data,
    out_dir: str | Path,
    resume: bool = False,
    log: Callable[[str], None] = _log_stderr,
    tensorboard: str | Path | None = None,
) -> TrainResult:
    """Train a model on ``train_data``; validate on ``valid_data``; checkpoints under ``out_dir``.

    The task is ``model_cfg.task``; the data are what its ``read_data`` returns
    (:class:`~qkv.tasks.translate.ParallelData` for translation, :class:`~qkv.tasks.base.TextData`
    for the one-sided tasks).

    With ``resume``, the configs, the tokenizer and the whole training state come from
    ``out_dir/last`` and training continues to the (possibly raised) ``max_steps``; the training
    data must be the data the run was started on.

    ``out_dir`` is locked for the whole run (:class:`~qkv.training.rundir.RunLock`); a save that a
    crash cut short is finished or rolled back first (:func:`~qkv.training.rundir.recover`).

    Started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment), every process calls this
    with the same arguments and they train one model together with DistributedDataParallel
    (see :mod:`qkv.training.distributed`); rank 0 trains the tokenizer (the others load it from
    ``out_dir/tokenizer``), logs, validates and writes every file.

    ``tensorboard``: a directory where rank 0 also writes every scalar of ``metrics.jsonl`` as
    TensorBoard events (``torch.utils.tensorboard``; the ``tensorboard`` package is needed).
    """
    train_cfg.validate()
    decode_cfg.validate()
    model_cfg.validate()
    train_cfg = per_process_batch(train_cfg, distributed.env_world_size())  # update_tokens: each batch's share
    out_dir = Path(out_dir)
    if valid_data is not None and len(valid_data) == 0:
        raise QkvError(f"{valid_data.name}: no validation examples (an empty file?); give validation data, "
                       "or none (then best/ is the newest checkpoint and patience cannot be used)")
    if train_cfg.patience and valid_data is None:
        raise QkvError(f"patience={train_cfg.patience} stops training by the validation results, but no validation "
                       f"data were given (give them, or set patience to 0)")
    if train_cfg.threads:
        torch.set_num_threads(train_cfg.threads)
    task = get_task(model_cfg.task)
    if tensorboard:
        summary_writer_class()  # a clear error now, before any data is read, if tensorboard is missing
    device = distributed.resolve_device(train_cfg.device, train_cfg.amp, distributed.env_local_rank())
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for what runs in float32
    info = distributed.init_from_env(device)
    try:
        with RunLock(out_dir) if info.is_main else contextlib.nullcontext():
            if info.is_main:
                recover(out_dir, log)
            distributed.barrier()
            saved = _saved_config(out_dir / "last") if resume else None
            task.check_data(train_data, valid_data, saved)
            fingerprint = data_fingerprint(train_data)
            _check_same_data(saved, fingerprint, train_data.name, out_dir)
            return _train(model_cfg, train_cfg, decode_cfg, train_data, valid_data, out_dir, resume,
                          log if info.is_main else _quiet, device, info, task, fingerprint,
                          tensorboard if info.is_main else None)
    finally:
        distributed.cleanup(info)


def _check_same_data(saved: dict | None, fingerprint: str, name: str, out_dir: Path) -> None:
    """A resumed run must see the data it was started on (checkpoints from before fingerprints: not checked)."""
    data = (saved or {}).get("data")
    recorded = data.get("fingerprint") if isinstance(data, dict) else None
    if recorded and recorded != fingerprint:
        raise QkvError(f"--resume: the training data {name} differ from the data {out_dir} was trained on "
                       f"({data.get('train', '?')}; content digest {recorded[:12]}, now {fingerprint[:12]}); resume "
                       "with the same files, or start a new run with another --out")


def _saved_config(last: Path) -> dict | None:
    """The config dict of the checkpoint a resumed run continues (None when there is none yet)."""
    try:
        return read_settings(last)
    except QkvError:
        return None


def _train(model_cfg, train_cfg, decode_cfg, train_data, valid_data, out_dir: Path, resume: bool, log,
           device: torch.device, info: DistInfo, task: Task, fingerprint: str = "",
           tensorboard: str | Path | None = None) -> TrainResult:
    last = out_dir / "last"
    if resume:
        if not last.exists():
            raise QkvError(missing_last_message(out_dir))
        tokenizers = checkpoint_tokenizers(last)  # the files its manifest lists, no stray copy beside them
    else:
        if last.exists():
            raise QkvError(f"{out_dir} already holds a run ({last}); pass --resume to continue it or choose another --out")
        if info.is_main and (held := holds_checkpoints(out_dir)):
            raise QkvError(f"{out_dir} holds checkpoints ({', '.join(held)}) of a run that has no last/: starting "
                           f"a new run there would replace them; choose another --out (or delete {out_dir})")
        shared_tokenizer = out_dir / "tokenizer"  # where the other ranks find rank 0's tokenizer
        if train_cfg.tokenizer_from:  # every rank reads the same files
            source = Path(train_cfg.tokenizer_from)
            tokenizers = tokenizer_of(source) if is_corpus(source) else checkpoint_tokenizers(source) \
                if (source / MANIFEST).is_file() else TokenizerPair.from_path(source)
            log(f"reusing the tokenizer of {train_cfg.tokenizer_from} ({tokenizers!r}); "
                f"the tokenizer and vocab_size settings are not used")
        elif info.is_main:
            if getattr(train_data, "tokenizers", None) is not None:  # preprocessed data carry their vocabulary
                log(f"tokenizer: the one of {train_data.name}")
            elif train_cfg.init_from:
                log(f"tokenizer: the one of {train_cfg.init_from} (init_from)")
            else:
                joint = train_cfg.joint_vocab or task.data_kind == "text"
                log(f"training a {train_cfg.tokenizer} tokenizer ({'joint' if joint else 'separate'} "
                    f"vocabulary, up to {train_cfg.vocab_size} pieces) on {len(train_data)} "
                    f"{'pairs' if task.data_kind == 'parallel' else 'texts'}")
            tokenizers = task.train_tokenizers(train_data, train_cfg)
            if info.distributed:
                shutil.rmtree(shared_tokenizer, ignore_errors=True)  # no stale model of an earlier attempt
                tokenizers.save(shared_tokenizer)
        distributed.barrier()
        if not info.is_main and not train_cfg.tokenizer_from:
            tokenizers = TokenizerPair.load(shared_tokenizer)
    if "translate" in task.offers and decode_cfg.beam_size > tokenizers.tgt.vocab_size:  # before the first update
        raise ConfigError(f"invalid config field 'beam_size': {decode_cfg.beam_size} is larger than the target "
                          f"vocabulary ({tokenizers.tgt.vocab_size} tokens), with which validation and the saved "
                          f"model decode; choose at most {tokenizers.tgt.vocab_size}")
    if train_cfg.init_from and not resume:
        model_cfg = init_model_config(model_cfg, train_cfg.init_from, log)
        train_cfg = init_positions(task, model_cfg, train_cfg, train_cfg.init_from, log)
    train_split = task.encode(train_data, tokenizers, train_cfg, log, train=True)
    valid_split = task.encode(valid_data, tokenizers, train_cfg, log, train=False) if valid_data is not None else None
    trainer = Trainer(model_cfg, train_cfg, decode_cfg, tokenizers, train_split, valid_split, out_dir, log,
                      data_name=train_data.name, device=device, dist_info=info, task=task)
    trainer.data_fingerprint = fingerprint
    if tensorboard:
        trainer.tensorboard = summary_writer_class()(log_dir=str(tensorboard))
    if train_cfg.init_from and not resume:
        init_weights(trainer.model, train_cfg.init_from, log, task.state().get("labels"))
    if resume:
        trainer.restore(last)
        # The run continues under the saved settings, except where the user raised a limit.
        log(f"resuming from {last} at step {trainer.step} (epoch {trainer.epoch})")
    if info.is_main:
        dropped = truncate_metrics(trainer.metrics_path, trainer.step)
        if dropped:
            log(f"{trainer.metrics_path}: dropped {dropped} record(s) after step {trainer.step}, written before "
                "the run stopped (they are written again)")
        # step_N/ checkpoints beyond the commit point belong to steps that are trained again; those before
        # it are pruned now, as the save that a crash interrupted would have done
        for ckpt in list_checkpoints(out_dir) if resume else []:
            if int(ckpt.name.split("_")[1]) > trainer.step:
                log(f"removing {ckpt}: written after {last} was last committed (step {trainer.step}); "
                    "it is written again")
                shutil.rmtree(ckpt)
        if resume:
            trainer.prune_numbered()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    unit = "pairs" if task.data_kind == "parallel" else "examples"
    log(f"model: {trainer.model_cfg.arch} ({task.name}), {n_params:,} parameters; "
        f"{len(train_split)} training {unit}, {len(valid_split) if valid_split else 0} validation {unit}")
    c = train_cfg
    log(f"device: {device}" + (f", amp {c.amp}" if c.amp != "none" else "") + (", compiled" if c.compile else "")
        + (f"; {info.world_size} processes ({info.backend}), {c.update_freq} x {info.world_size} batches per update"
           if info.distributed else "")
        + (f"; update_tokens {c.update_tokens:,}: {c.max_tokens:,} tokens a batch (per side, padded) x "
           f"{c.update_freq} x {info.world_size} process(es)" if c.update_tokens else ""))
    try:
        return trainer.run()
    finally:
        if trainer.tensorboard is not None:
            trainer.tensorboard.close()


def summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or a QkvError saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise QkvError("--tensorboard needs the tensorboard package: pip install 'qkv[tensorboard]' "
                       "(or pip install tensorboard)") from None
    return SummaryWriter
