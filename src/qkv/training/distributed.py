"""Process groups for data-parallel training, and the choice of device.

``torchrun --nproc-per-node N -m qkv train ...`` starts N copies of the same command and tells
each, through environment variables, who it is: ``WORLD_SIZE`` (N), ``RANK`` (0..N-1, unique
over all machines) and ``LOCAL_RANK`` (0..n-1 on this machine, which picks its GPU), plus
``MASTER_ADDR`` / ``MASTER_PORT`` for the rendezvous. :func:`init_from_env` reads them and
joins the process group: NCCL when the processes train on GPUs, gloo on CPUs.

Without those variables (or with ``WORLD_SIZE=1``) nothing is initialised and every helper
here is a no-op that behaves as for a single process: :func:`is_main` is True,
:func:`all_reduce_sum` returns its input, :func:`barrier` returns at once. The trainer can
therefore call them unconditionally.

How the trainer uses the group (see :mod:`qkv.training.trainer`): every rank builds the same
seeded batch order; an update takes ``update_freq x world_size`` batches of it, and rank r
trains on every world_size-th of them, starting at r. Rank 0 alone trains the tokenizer,
validates, writes checkpoints, metrics and logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from qkv.errors import ConfigError
from qkv.tasks.base import unwrap  # noqa: F401  (defined with the tasks that call it)

# Rank 0 validates (and decodes a BLEU sample) while the others wait in the next collective:
# allow it more time than the default before a waiting rank gives up.
TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class DistInfo:
    """Who this process is: ``world_size`` processes, this one is ``rank`` (``local_rank`` on its machine)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # "nccl" | "gloo"; None for a single process
    owns_group: bool = False  # True when init_from_env created the group (and cleanup should end it)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when unset)."""
    return _env_int("WORLD_SIZE", 1)


def env_rank() -> int:
    """``RANK`` as set by torchrun (0 for a single process)."""
    return _env_int("RANK", 0) if env_world_size() > 1 else 0


def env_local_rank() -> int:
    """``LOCAL_RANK`` as set by torchrun, which picks this process's GPU (0 for a single process)."""
    return _env_int("LOCAL_RANK", 0) if env_world_size() > 1 else 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer (set by torchrun)") from None


def resolve_device(device: str, amp: str, local_rank: int = 0) -> torch.device:
    """The torch device for TrainConfig's ``device`` ("auto" | "cpu" | "cuda"), checked against ``amp``.

    "auto" is CUDA when available, else the CPU. Under torchrun each process on a machine takes
    the GPU of its ``LOCAL_RANK``. Raises ConfigError, naming the field, for a request this
    machine cannot serve: CUDA without a GPU, fewer GPUs than local processes, fp16 on the CPU,
    bf16 on a GPU without bf16.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"invalid config field 'device': must be auto, cpu or cuda, got {device!r}")
    if amp not in ("none", "bf16", "fp16"):
        raise ConfigError(f"invalid config field 'amp': must be none, bf16 or fp16, got {amp!r}")
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ConfigError("invalid config field 'device': 'cuda' was asked for but torch sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu or --device auto")
    if device == "cpu" or (device == "auto" and not cuda):
        if amp == "fp16":
            raise ConfigError("invalid config field 'amp': fp16 (with its GradScaler) needs a CUDA GPU; "
                              "on the CPU use --amp bf16 or --amp none")
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(f"invalid config field 'device': process LOCAL_RANK={local_rank} needs GPU {local_rank}, "
                          f"but only {n} GPU(s) are visible; start at most {n} processes per machine")
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"invalid config field 'amp': this GPU ({torch.cuda.get_device_name(local_rank)}) "
                          "does not support bf16; use --amp fp16")
    return torch.device("cuda", local_rank)


def init_from_env(device: torch.device) -> DistInfo:
    """Join the process group that torchrun describes in the environment; return who we are.

    With ``WORLD_SIZE`` unset or 1, returns a single-process DistInfo and initialises nothing.
    The backend is NCCL for CUDA devices and gloo for the CPU. A group that is already
    initialised (by the caller) is used as it is and left to the caller to destroy.
    """
    world_size = env_world_size()
    if world_size <= 1:
        return DistInfo()
    if not dist.is_available():
        raise ConfigError(f"WORLD_SIZE={world_size} asks for distributed training, but this torch build "
                          "has no torch.distributed")
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_initialized():
        return DistInfo(dist.get_world_size(), dist.get_rank(), local_rank, dist.get_backend(), owns_group=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return DistInfo(dist.get_world_size(), dist.get_rank(), local_rank, backend, owns_group=True)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main() -> bool:
    """True on rank 0, the process that logs, validates and writes files (and without a group)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait until every rank has arrived here (no-op for a single process)."""
    if _active():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def _comm_device() -> torch.device:
    """Where tensors must live for a collective: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of ``values`` over all ranks (``values`` itself for a single process).

    Works on any device and dtype accepted by the backend; the result has the input's device.
    """
    if not _active():
        return values
    t = values.to(_comm_device()).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.to(values.device)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (e.g. "time is up")."""
    if not _active():
        return flag
    return bool(all_reduce_sum(torch.tensor([1.0 if flag else 0.0])).item() > 0)


def from_main(value: int) -> int:
    """Rank 0's ``value`` on every rank (e.g. a count only rank 0 keeps)."""
    if not _active():
        return value
    return int(all_reduce_sum(torch.tensor([float(value) if is_main() else 0.0])).item())


def all_gather_bytes(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of a uint8 tensor of the same size on all ranks (e.g. an RNG state), on the CPU."""
    if not _active():
        return [t.cpu()]
    src = t.to(_comm_device())
    out = [torch.empty_like(src) for _ in range(dist.get_world_size())]
    dist.all_gather(out, src)
    return [o.cpu() for o in out]


def cleanup(info: DistInfo) -> None:
    """Leave the process group, if :func:`init_from_env` created it."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()
