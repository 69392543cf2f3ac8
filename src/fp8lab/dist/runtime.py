"""The process-group runtime a training job needs under torchrun (no home-made process pool).

`init_from_env` joins the group torchrun describes (``WORLD_SIZE``/``RANK``/``MASTER_*``) with a
bounded timeout, so a rank that dies makes the others fail within that time instead of hanging
(torchrun's agent also tears the job down and names the failed rank). `check_jobs` refuses
parallel recipe jobs under torchrun (recipes run one after another there). `agree_any` makes a
guard decision (rollback, stop) the same on every rank. `gather_scaling_states` collects every
rank's delayed-scaling state for a rank-0 consolidated checkpoint. `is_distributed`, `rank` and
`world_size` are fp8lab's one place that asks torch.distributed where this process stands.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DistContext",
    "agree_any",
    "check_global_batch",
    "check_jobs",
    "gather_scaling_states",
    "init_from_env",
    "is_distributed",
    "leave_group",
    "rank",
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


def init_from_env(backend: str | None = None, timeout_s: float = 120.0) -> DistContext | None:
    """Join torchrun's process group (gloo on CPU, nccl with CUDA) or return None when not
    under torchrun. Collectives that wait longer than ``timeout_s`` raise (a dead rank)."""
    if not under_torchrun():
        return None
    if not is_distributed():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=float(timeout_s))
        torch.distributed.init_process_group(backend, timeout=timeout)
    return DistContext(rank=rank(), world=world_size())


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
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    d.all_reduce(t, op=d.ReduceOp.MAX, group=group)
    return bool(t[0])


def gather_scaling_states(model: torch.nn.Module) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Every rank's delayed-scaling ``state_dict`` by state name, in rank order (plain tensors,
    loadable with ``weights_only=True``). Collective; without torch.distributed: this process's."""
    # imported here so that this module needs nothing of fp8lab: dist.amax (installed while
    # fp8lab.nn is being imported) reads rank and world size from it
    from fp8lab.nn.state import delayed_states

    mine = {k: ds.state_dict() for k, ds in delayed_states(model).items()}
    if not is_distributed():
        return [mine]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, mine)
    return out
