"""The process-group runtime a training job needs under torchrun (no home-made process pool).

`init_from_env` joins the group torchrun describes (``WORLD_SIZE``/``RANK``/``MASTER_*``) with a
bounded timeout, so a rank that dies makes the others fail within that time instead of hanging
(torchrun's agent also tears the job down and names the failed rank). `check_jobs` refuses
parallel recipe jobs under torchrun (recipes run one after another there). `agree_any` makes a
guard decision (rollback, stop) the same on every rank. `gather_scaling_states` collects every
rank's delayed-scaling state for a rank-0 consolidated checkpoint. `is_distributed`, `rank` and
`world_size` are fp8lab's one place that asks torch.distributed where this process stands.

Devices: `resolve_torch_device` turns ``--torch-device`` (``cpu``, ``cuda``, ``cuda:N``, ``auto``)
into a concrete device; under torchrun ``cuda`` and ``auto`` mean this rank's GPU
(``LOCAL_RANK``). `init_from_env` takes that device: with a CUDA device the rank takes it
(``torch.cuda.set_device``) and joins with NCCL, on the CPU with gloo. `collective_device` is
where a tensor handed to a collective must live (NCCL: the rank's GPU; gloo: the CPU).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TORCH_DEVICE_CHOICES",
    "DistContext",
    "agree_any",
    "check_global_batch",
    "check_jobs",
    "collective_device",
    "gather_scaling_states",
    "init_from_env",
    "is_distributed",
    "leave_group",
    "rank",
    "resolve_torch_device",
    "under_torchrun",
    "world_size",
]


def is_distributed() -> bool:
    """Whether a torch.distributed process group is up (any world size, one rank included)."""
    d = torch.distributed
    return d.is_available() and d.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (None: the world); 0 without a process group."""
    return torch.distributed.get_rank(group) if is_distributed() else 0


def world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (None: the world); 1 without a process group."""
    return torch.distributed.get_world_size(group) if is_distributed() else 1


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job: ``rank`` of ``world`` (rank 0 writes files)."""

    rank: int
    world: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """Whether torchrun started this process with more than one rank (``WORLD_SIZE > 1``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _world_from_env() -> int:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


def check_jobs(jobs: int, what: str = "recipes", world: int | None = None) -> None:
    """``--jobs > 1`` under torchrun is an error: the ranks already are the parallelism
    (``what``: the units that run one after another there, for the message). ``world``: the
    world size (default: torchrun's ``WORLD_SIZE``, read before any process group exists)."""
    world = _world_from_env() if world is None else world
    if jobs > 1 and world > 1:
        raise ValueError(
            f"--jobs {jobs} cannot be combined with torchrun (WORLD_SIZE={world}): {what} run "
            "one after another; use --jobs 1"
        )


def check_global_batch(batch_size: int, world: int | None = None) -> None:
    """Under torchrun: ValueError when the global batch (``train.batch_size``) does not split
    evenly over the ranks (``world``, default torchrun's ``WORLD_SIZE``), before any process
    group or training starts."""
    world = _world_from_env() if world is None else world
    if world > 1 and batch_size % world:
        raise ValueError(
            f"train.batch_size={batch_size} (the global batch, split across the ranks) is not "
            f"divisible by the world size {world}: use a multiple of {world}"
        )


#: the values ``--torch-device`` takes (``cuda:N`` for any N too)
TORCH_DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def _local_rank() -> int:
    """torchrun's ``LOCAL_RANK`` (this rank's index on its machine); 0 outside torchrun."""
    value = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={value!r} is not an integer") from None


def resolve_torch_device(
    value: str | torch.device | None = "auto", what: str = "--torch-device"
) -> torch.device:
    """The concrete device ``value`` names: ``cpu``; ``cuda:N``; ``cuda`` (GPU 0, or under
    torchrun this rank's GPU ``LOCAL_RANK``); ``auto`` / None (``cuda`` when CUDA is available,
    else ``cpu``). ``what`` names the setting in error messages.

    Raises:
        ValueError: an unknown value; ``cuda`` without CUDA ("CUDA is not available ..."); a
            GPU index this machine does not have (``cuda:7`` with 1 GPU).
    """
    text = "auto" if value is None else str(value).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    kind, sep, index = text.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise ValueError(f"{what} {value!r}: expected one of {', '.join(TORCH_DEVICE_CHOICES)}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{what} {value}: CUDA is not available on this machine (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); use "
            "--torch-device cpu or auto"
        )
    n = int(index) if sep else (_local_rank() if under_torchrun() else 0)
    count = torch.cuda.device_count()
    if n >= count:
        where = "" if sep else f" (LOCAL_RANK={n})"
        raise ValueError(
            f"{what} {value}{where}: GPU {n} does not exist, this machine has {count} "
            f"GPU{'s' * (count != 1)} (cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", n)


def init_from_env(
    backend: str | None = None, timeout_s: float = 120.0, device: str | torch.device | None = None
) -> DistContext | None:
    """Join torchrun's process group or return None when not under torchrun. ``device``
    (`resolve_torch_device`; None: ``auto``): a CUDA device becomes this rank's GPU
    (``torch.cuda.set_device``) and the backend NCCL; the CPU uses gloo. ``backend`` overrides
    the choice. Collectives that wait longer than ``timeout_s`` raise (a dead rank)."""
    if not under_torchrun():
        return None
    dev = resolve_torch_device(device)
    if not is_distributed():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if backend is None:
            backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=float(timeout_s))
        torch.distributed.init_process_group(backend, timeout=timeout)
    return DistContext(rank=rank(), world=world_size())


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor given to a collective of ``group`` must be: the rank's current GPU under
    NCCL, else the CPU (gloo; also without a process group)."""
    if is_distributed() and torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def leave_group() -> None:
    """Every rank: wait for the others (barrier), then leave the process group. After the ranks'
    shared work (training), what rank 0 does alone -- summaries, cost estimates building fresh
    delayed-scaling layers -- must not issue collectives the other ranks never join."""
    if is_distributed():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def agree_any(flag: bool, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (all-reduce MAX; collective).
    Without torch.distributed: ``flag``."""
    if not is_distributed():
        return bool(flag)
    d = torch.distributed
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(group))
    d.all_reduce(t, op=d.ReduceOp.MAX, group=group)
    return bool(t[0])


def gather_scaling_states(model: torch.nn.Module) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Every rank's delayed-scaling ``state_dict`` by state name, in rank order (plain tensors,
    loadable with ``weights_only=True``). Collective; without torch.distributed: this process's."""
    # imported here so that this module needs nothing of fp8lab: dist.amax (installed while
    # fp8lab.nn is being imported) reads rank and world size from it
    from fp8lab.nn.state import delayed_states

    # CPU copies: what a checkpoint holds, and what all_gather_object pickles on any backend
    mine = {
        k: {f: t.cpu() for f, t in ds.state_dict().items()}
        for k, ds in delayed_states(model).items()
    }
    if not is_distributed():
        return [mine]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, mine)
    return out
