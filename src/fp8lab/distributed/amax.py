"""Amax reduction groups: which ranks share the amax of a delayed-scaled tensor.

Transformer Engine all-reduces each delayed-scaling amax (``reduce_amax=True``) over its
``amax_reduction_group`` before the scale update (TE ``DelayedScaling.reduce_amax``;
``fp8_autocast(fp8_group=...)``). Reducing over the wrong group is silent: Megatron-LM PR #442
fixed a 40B FP8 run that diverged that way. Here the group is runtime state of each
`fp8lab.scaling.delayed.DelayedScalingState` (``state.group``, never saved), set for a whole
model by `set_amax_group`:

``world``  all-reduce MAX over the default process group: every rank quantizes with the same
           scale at every step, bit for bit (`assert_identical_scales` checks it).
``none``   each rank keeps its local amax (a one-rank group per rank): the scales drift apart;
           `scale_spread` measures by how many binades.

Batching (`batch_amax_reduction`, TE's global amax buffer): instead of one all-reduce per state
and update, every update of the step is deferred (`AmaxBatch.defer_update`) and `AmaxBatch.flush`
all-reduces all staged amaxes as one flat float32 buffer, then runs each update with its reduced
amax. A state's new scale is first used in the next step's forward or backward, so with one
forward and one backward per step deferring the updates to the end of the backward changes no
number (tested bit for bit against the unbatched path); a state updated twice before a flush is
updated once with the max of its amaxes (TE's ``fp8_autocast`` semantics). It turns the 30 scalar all-reduces per step of the default GPT (te-delayed) into one.

Explicit, not an import side effect: delayed scaling all-reduces its amaxes only after
`set_amax_reduction` (TE's default reduction, for the whole process) -- called by `set_amax_group`
and `batch_amax_reduction`, which the lab's `DataParallel` runs. So ``import fp8lab`` and
``from fp8lab.nn import Linear`` behave alike; a converted Linear with delayed scaling under an initialised process group
and no reduction warns, naming the call.

Only data parallelism is modelled: with tensor or sequence parallelism one tensor's amax is split
over ranks and ``none`` would be wrong inside a layer; those are out of scope.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8lab.distributed.runtime import is_distributed, rank, world_size
from fp8lab.nn.state import delayed_states
from fp8lab.scaling import delayed as _delayed
from fp8lab.scaling.delayed import DelayedScaling, amax_reduction_installed

AMAX_GROUPS = ("world", "none")

__all__ = [
    "AMAX_GROUPS",
    "AmaxBatch",
    "assert_identical_scales",
    "batch_amax_reduction",
    "delayed_states",
    "gather_scales",
    "reduce_amax",
    "scale_spread",
    "set_amax_group",
    "set_amax_reduction",
]


def reduce_amax(amax: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (MAX) a float32 vector of amaxes over ``group`` (None: the world), in place,
    and return it: the one amax all-reduce of fp8lab (delayed-scaling updates, batched or not;
    FSDP's sharded-weight amaxes). Without a process group: ``amax`` unchanged. Collective."""
    if is_distributed():
        d = torch.distributed
        d.all_reduce(amax, op=d.ReduceOp.MAX, group=group)
    return amax


class _ImmediateReduction:
    """TE's default: each delayed-scaling update all-reduces its staged amax at once over the
    state's process group (``group``: None = the world; `set_amax_group`). Installed into
    `fp8lab.scaling.delayed` by `set_amax_reduction`; active while a process group is up."""

    def defer_update(self, state: DelayedScaling, fmt: Any = None) -> None:
        buf = reduce_amax(state.state.amax_history[0:1].clone(), state.group)
        state.update(fmt, reduced=buf.reshape(()))


def set_amax_reduction(enabled: bool = True) -> bool:
    """Make every delayed-scaling update of this process all-reduce (MAX) its staged amax over
    its state's process group (the world unless `set_amax_group` chose another) while
    torch.distributed is initialised: Transformer Engine's default for ``reduce_amax=True``
    states. Without a process group it changes nothing. ``enabled=False`` keeps every amax
    local. Returns the previous setting.

    Importing fp8lab installs nothing: call this before training under torchrun (the lab does,
    through `set_amax_group` / `batch_amax_reduction` in its `DataParallel`)."""
    old = amax_reduction_installed()
    if enabled:
        d = torch.distributed
        # torch's own check (no fp8lab frame on the per-step path)
        active = d.is_initialized if d.is_available() else (lambda: False)
        _delayed.set_amax_reduction(_ImmediateReduction(), active)
    else:
        _delayed.set_amax_reduction(None, lambda: False)
    return old


def _dist() -> Any:
    if not is_distributed():
        raise RuntimeError("torch.distributed is not initialized (run under torchrun)")
    return torch.distributed


def _own_group() -> Any:
    """A one-rank process group of this rank (every rank creates all of them, as required)."""
    mine = None
    for r in range(world_size()):
        g = torch.distributed.new_group([r])
        if r == rank():
            mine = g
    return mine


def set_amax_group(model: torch.nn.Module, mode: str = "world", group: Any = None) -> int:
    """Set the amax reduction group of every delayed-scaling state of ``model``.

    ``mode`` is ``"world"`` (``group``, default the whole world) or ``"none"`` (local amaxes).
    Collective under torch.distributed for ``"none"`` (new groups): call it on every rank.
    A state whose config has ``reduce_amax=False`` refuses ``"world"`` (it would not reduce).
    Turns the process's amax reduction on (`set_amax_reduction`). Returns the number of states
    set.
    """
    if mode not in AMAX_GROUPS:
        raise ValueError(f"unknown amax group {mode!r}: expected one of {AMAX_GROUPS}")
    states = delayed_states(model)
    if mode == "world":
        off = [k for k, ds in states.items() if not ds.cfg.reduce_amax]
        if off:
            raise ValueError(
                f"--amax-group world needs reduce_amax=True; these states have it off: {off[:3]}"
            )
        target = group
    else:
        target = _own_group() if is_distributed() else None
    for ds in states.values():
        ds.group = target
    set_amax_reduction(True)
    return len(states)


class AmaxBatch:
    """The deferred delayed-scaling updates of one step and their single all-reduce (MAX).

    Set as the ``group`` of every state (`batch_amax_reduction`): `DelayedScaling.update` then
    calls `defer_update` instead of reducing. ``group`` is the process group reduced over (None:
    the world). ``flushes`` counts the all-reduces issued, ``updates`` the updates they served.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.pending: list[tuple[DelayedScaling, Any]] = []
        self.flushes = 0
        self.updates = 0

    def defer_update(self, state: DelayedScaling, fmt: Any = None) -> None:
        """Queue ``state``'s update. A state already queued (a module run twice before the
        flush) stays queued once: its staging slot holds the max of all its amaxes and it is
        updated once, as Transformer Engine does for a module run several times inside one
        ``fp8_autocast`` (its second run already used the old scale either way)."""
        if all(s is not state for s, _ in self.pending):
            self.pending.append((state, fmt))

    def flush(self) -> int:
        """All-reduce (MAX) the staged amax of every queued state in one buffer, then update
        each with its reduced amax; returns how many were updated. Collective: every rank flushes
        at the same point (the same program queues the same states in the same order)."""
        pending, self.pending = self.pending, []
        if not pending:
            return 0
        buf = torch.stack([s.state.amax_history[0].float() for s, _ in pending])
        if is_distributed():
            reduce_amax(buf, self.group)
            self.flushes += 1
        for (s, fmt), red in zip(pending, buf, strict=True):
            s.update(fmt, reduced=red)
        self.updates += len(pending)
        return len(pending)


def batch_amax_reduction(model: torch.nn.Module, mode: str = "world") -> AmaxBatch:
    """`set_amax_group` (``mode``), then route every state's update through one `AmaxBatch`
    (returned: call its `flush` once per step after the backward, on every rank)."""
    set_amax_group(model, mode)
    states = delayed_states(model)
    # every state got the same group (the world's, or this rank's one-rank group)
    batch = AmaxBatch(next(iter(states.values())).group if states else None)
    for ds in states.values():
        ds.group = batch
    return batch


def gather_scales(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """The state names and every rank's current scales: float32 ``[world, states]``
    (all-gather: collective, call it on every rank)."""
    d = _dist()
    states = delayed_states(model)
    names = list(states)
    mine = torch.stack([ds.scale.reshape(()) for ds in states.values()]) if names else None
    if mine is None:
        return names, torch.zeros((world_size(), 0), dtype=torch.float32)
    out = [torch.empty_like(mine) for _ in range(world_size())]
    d.all_gather(out, mine.contiguous())
    return names, torch.stack(out)


def scale_spread(model: torch.nn.Module) -> dict[str, float]:
    """Per state, ``log2(max / min)`` of its scale over the ranks (binades; 0 = identical).
    Collective."""
    names, scales = gather_scales(model)
    out = {}
    for i, name in enumerate(names):
        col = scales[:, i].double()
        lo, hi = float(col.min()), float(col.max())
        out[name] = math.log2(hi / lo) if lo > 0 and math.isfinite(hi) else math.inf
    return out


def assert_identical_scales(model: torch.nn.Module) -> None:
    """Raise AssertionError naming the first state whose scale differs between ranks in any bit.
    Collective."""
    names, scales = gather_scales(model)
    bits = scales.view(torch.int32)
    for i, name in enumerate(names):
        if not torch.all(bits[:, i] == bits[0, i]):
            raise AssertionError(f"scale of {name} differs between ranks: {scales[:, i].tolist()}")
