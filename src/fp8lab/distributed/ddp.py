"""`DataParallel`: what a training loop needs to run one model on every torchrun rank.

DDP (PyTorch's DistributedDataParallel) or FSDP2 (``fully_shard``, `fp8lab.distributed.fsdp`) with the
numerics of the global batch (`fp8lab.distributed.data`): contiguous batch shards, each rank's loss =
its token sum / the global token count, gradients summed over ranks (fp32 by default, or the
simulated ``--grad-comm`` wire of `fp8lab.distributed.hooks` under DDP), and the amax group of every
delayed-scaling state set (`fp8lab.distributed.amax`), its reductions batched into one all-reduce per
step at the end of the backward. The loss it reports is the all-reduced global loss, the same
value on every rank, so guard decisions taken from it agree.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8lab.distributed.amax import AMAX_GROUPS, AmaxBatch, batch_amax_reduction, set_amax_group
from fp8lab.distributed.comm import WIRE_BYTES, check_grad_comm
from fp8lab.distributed.data import allreduce_sum_hook, global_token_loss, shard_batch
from fp8lab.distributed.hooks import GradCommHook
from fp8lab.distributed.runtime import is_distributed, rank, world_size

__all__ = ["DataParallel", "check_options", "comm_summary"]


def check_options(
    amax_group: str = "world", grad_comm: str = "fp32", fsdp: bool = False,
    fp8_allgather: bool = False,
) -> None:  # fmt: skip
    """ValueError naming the option when a distributed option or combination is invalid."""
    if amax_group not in AMAX_GROUPS:
        raise ValueError(f"--amax-group {amax_group!r}: expected one of {', '.join(AMAX_GROUPS)}")
    check_grad_comm(grad_comm)
    if fp8_allgather and not fsdp:
        raise ValueError("--fp8-allgather needs --fsdp (it hooks FSDP2's weight all-gather)")
    if fsdp and grad_comm != "fp32":
        raise ValueError(
            f"--grad-comm {grad_comm} simulates DDP's gradient all-reduce; with --fsdp the "
            "gradients are reduce-scattered in fp32: use --grad-comm fp32"
        )


class DataParallel:
    """DDP (or FSDP2 with ``fsdp``) of ``model`` over the default process group (collective to
    construct). ``batch_amax``: one all-reduce per step for every amax (`AmaxBatch`) instead of
    one per delayed-scaling state and update."""

    def __init__(
        self,
        model: torch.nn.Module,
        amax_group: str = "world",
        grad_comm: str = "fp32",
        fsdp: bool = False,
        fp8_allgather: bool = False,
        batch_amax: bool = True,
    ) -> None:
        if not is_distributed():
            raise RuntimeError("DataParallel needs torch.distributed initialized (torchrun)")
        check_options(amax_group, grad_comm, fsdp, fp8_allgather)
        self.rank, self.world = rank(), world_size()
        self.module = model
        self.amax_group, self.fsdp = amax_group, fsdp
        if batch_amax:
            self.amax: AmaxBatch | None = batch_amax_reduction(model, amax_group)
        else:
            self.amax = None
            set_amax_group(model, amax_group)
        self.comm: GradCommHook | None = None
        self.grad_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if fsdp:
            from torch.distributed.fsdp import FSDPModule

            from fp8lab.distributed.fsdp import shard_model

            self.gather_bytes = _allgather_bytes(model, self.world, fp8_allgather)
            self.ddp = shard_model(model, fp8_allgather, amax_group=amax_group)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    # the loss is already global: sum (a plain SUM: gloo has no PREMUL_SUM)
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)
        else:
            self.ddp = torch.nn.parallel.DistributedDataParallel(model)
            if grad_comm == "fp32":
                self.ddp.register_comm_hook(None, allreduce_sum_hook)
            else:
                # the simulated wire averages; the loss is already global: scale the mean by N
                self.comm = GradCommHook(grad_comm, sum_over_ranks=True).register(self.ddp)
        self.grad_comm = grad_comm
        self.sharding = ("fsdp-fp8" if fp8_allgather else "fsdp") if fsdp else "ddp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch (not divisible -> ValueError)."""
        return shard_batch(x, y, self.rank, self.world)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Forward this rank's shard: (loss to backward, the global mean loss -- the same float
        on every rank --, this rank's per-token losses). The backward of the returned loss ends
        with the step's batched amax all-reduce."""
        if self.amax is not None:
            self.amax.flush()  # anything a forward without backward left queued (collective)
        logits, _ = self.ddp(x)
        loss, per_token = global_token_loss(logits, y, y.numel() * self.world)
        if self.amax is not None and loss.requires_grad:
            loss.register_hook(self._flush_after_backward)
        total = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(total)
        return loss, float(total[0]), per_token

    def _flush_after_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # runs when the backward starts; the callback runs when it has finished (as DDP's own)
        torch.autograd.Variable._execution_engine.queue_callback(self.amax.flush)
        return grad

    def barrier(self) -> None:
        torch.distributed.barrier()

    def for_checkpoint(self, opt: Any, save: bool = True) -> tuple[Any, Any]:
        """What a checkpoint saves and loads in place of (model, optimizer).

        DDP replicates the model: the model and ``opt`` themselves. FSDP2 shards parameters and
        optimizer states: views whose ``state_dict()`` holds the full (consolidated) tensors --
        gathered here, collectively, when ``save`` -- and whose ``load_state_dict(full)`` takes
        this rank's rows, so a checkpoint written on N ranks resumes on M."""
        if not self.fsdp:
            return self.module, opt
        return _FullState(self.module, save), _FullState(opt, save, self.module)

    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint keeps of the ranks beyond the consolidated model (which holds rank
        0's scaling state): ``rank_scaling``, every rank's delayed-scaling state by state name,
        in rank order (plain tensors; they differ with ``--amax-group none``). Collective."""
        from fp8lab.distributed.runtime import gather_scaling_states

        return {"rank_scaling": gather_scaling_states(self.module)}

    def load_checkpoint_extra(self, path: Any) -> bool:
        """After a checkpoint's model state loaded (rank 0's scaling state on every rank): this
        rank's own delayed-scaling state from the checkpoint's ``rank_scaling``. A checkpoint
        written on fewer ranks (or by one process) has no entry for the extra ranks: they keep
        rank 0's. Returns whether this rank's entry was loaded."""
        from fp8lab.nn.state import delayed_states

        saved = torch.load(path, map_location="cpu", weights_only=True).get("rank_scaling")
        if not saved or self.rank >= len(saved):
            return False
        mine = saved[self.rank]
        states = delayed_states(self.module)
        if set(mine) != set(states):  # another recipe's states: the model state check refuses
            return False  # such a checkpoint before this point; nothing to restore
        for name, ds in states.items():
            ds.load_state_dict(mine[name])
        return True

    def comm_bytes(self) -> dict[str, float]:
        """Bytes one rank sends per step for the gradients, by precision (ring all-reduce of
        DDP's 25 MiB buckets, `fp8lab.distributed.comm.bytes_per_rank`), counted from the parameter
        count and each precision's wire format."""
        from fp8lab.distributed.comm import bytes_per_rank

        bucket = 25 * 1024 * 1024 // 4
        return {p: bytes_per_rank(self.grad_numel, self.world, p, bucket) for p in WIRE_BYTES}

    def state(self) -> dict[str, Any]:
        """This step's fields for the metrics (call once per step, on every rank: collective
        with ``--amax-group none``): ``ranks``, ``amax_group``, ``grad_comm``, ``sharding``
        (ddp | fsdp | fsdp-fp8), ``grad_numel``, ``grad_comm_bytes`` (what one rank sends for the
        gradients this step, from the tensor sizes and the wire format: DDP's ring all-reduce,
        FSDP's fp32 reduce-scatter), with FSDP ``allgather_bytes`` (what one rank sends to
        all-gather the weights once: fp32, or 1-byte codes plus float32 scales for the Linear
        weights with ``--fp8-allgather``); with a simulated
        ``--grad-comm``: ``grad_comm_rel_error`` (relative L2 error of this step's reduced
        gradients against the fp32 all-reduce), ``grad_comm_messages``, ``grad_comm_underflow``
        and ``grad_comm_overflow`` (partial-sum elements rounded onto the wire / lost to zero /
        saturated); with ``--amax-group none``: ``scale_spread_binades`` (the largest per-state
        spread of the scales over the ranks)."""
        n = self.world
        grad_bytes = (  # FSDP: a fp32 reduce-scatter, (N-1)/N of the gradient per rank
            (n - 1) / n * 4 * self.grad_numel if self.fsdp else self.comm_bytes()[self.grad_comm]
        )
        out: dict[str, Any] = {
            "ranks": self.world, "amax_group": self.amax_group, "grad_comm": self.grad_comm,
            "sharding": self.sharding, "grad_numel": self.grad_numel,
            "grad_comm_bytes": grad_bytes,
        }  # fmt: skip
        if self.fsdp:  # the weights' all-gather, forward (the backward's re-gather not counted)
            out["allgather_bytes"] = self.gather_bytes
        c = self.comm
        if c is not None:  # this step's counters, then start the next step's afresh
            out.update(grad_comm_rel_error=c.rel_error(), grad_comm_messages=c.messages,
                       grad_comm_underflow=c.underflow, grad_comm_overflow=c.overflow,
                       grad_comm_bytes=c.bytes_sent)  # fmt: skip
            c.messages = c.underflow = c.overflow = 0
            c.bytes_sent = c.sq_error = c.sq_ref = 0.0
        if self.amax_group == "none":
            from fp8lab.distributed.amax import scale_spread

            spread = list(scale_spread(self.module).values())
            out["scale_spread_binades"] = max(spread) if spread else 0.0
        return out


def _allgather_bytes(model: torch.nn.Module, world: int, fp8: bool) -> float:
    """Bytes one rank sends to all-gather every parameter once (ring: ``(N-1)/N`` of the
    padded tensor): float32, or with ``fp8`` 1-byte codes plus one float32 per scale block for
    the weights of `fp8lab.nn.Linear` layers with an 8-bit fprop weight spec."""
    from fp8lab.nn import Linear as Fp8Linear
    from fp8lab.scaling.granularity import normalize_granularity, resolve_block, shape_2d

    fp8_weights: dict[int, Any] = {}
    if fp8:
        for m in model.modules():
            spec = m.recipe.spec("fprop", "weight") if isinstance(m, Fp8Linear) else None
            if spec is not None:
                fp8_weights[id(m.weight)] = spec
    total = 0.0
    for p in model.parameters():
        rows = -(-p.shape[0] // world) * world if p.dim() else 1  # FSDP pads to equal shards
        numel = rows * (p.numel() // max(1, p.shape[0] if p.dim() else 1))
        spec = fp8_weights.get(id(p))
        if spec is None:
            total += 4.0 * numel
            continue
        r, c = shape_2d(tuple(p.shape))
        g = normalize_granularity(spec.granularity)
        bm, bk = (r, c) if g == (-1, -1) else resolve_block(g, (r, c))
        total += numel + 4.0 * (-(-r // bm)) * (-(-c // bk))
    return (world - 1) / world * total


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def comm_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's distributed fields from its metrics records (`DataParallel.state`), None for a
    single-process run: ``ranks``, ``amax_group``, ``sharding``, ``grad_comm``,
    ``grad_bytes_per_step`` (mean bytes one rank sent per step at this precision; FSDP: the
    fp32 reduce-scatter), ``allgather_bytes_per_step`` (FSDP's weight all-gather; None for DDP),
    ``grad_bytes_per_step_by_precision`` (every precision, counted from the gradient's element
    count, the ranks and the wire formats: `fp8lab.distributed.comm.bytes_per_rank`, 25 MiB buckets),
    ``grad_comm_rel_error`` (mean over steps; 0 for fp32), ``grad_comm_underflow_pct`` and
    ``grad_comm_overflow_pct`` (% of the partial-sum elements put on the wire; None for fp32),
    ``max_scale_spread_binades`` (``--amax-group none``; 0 with world)."""
    from fp8lab.distributed.comm import GRAD_COMMS, bytes_per_rank

    recs = [r for r in records if "ranks" in r]
    if not recs:
        return None
    last = recs[-1]
    n, world = int(last["grad_numel"]), int(last["ranks"])
    msgs = sum(r.get("grad_comm_messages", 0) for r in recs)
    spreads = [r["scale_spread_binades"] for r in recs if "scale_spread_binades" in r]
    err = _mean([r.get("grad_comm_rel_error") for r in recs])
    return {
        "ranks": world, "amax_group": last["amax_group"],
        "sharding": last.get("sharding", "ddp"), "grad_comm": last["grad_comm"],
        "grad_bytes_per_step": _mean([r["grad_comm_bytes"] for r in recs]),
        "allgather_bytes_per_step": _mean([r.get("allgather_bytes") for r in recs]),
        "grad_bytes_per_step_by_precision": {
            p: bytes_per_rank(n, world, p, 25 * 1024 * 1024 // 4) for p in GRAD_COMMS
        },
        "grad_comm_rel_error": 0.0 if err is None else err,
        "grad_comm_underflow_pct": (100 * sum(r.get("grad_comm_underflow", 0) for r in recs)
                                    / msgs) if msgs else None,
        "grad_comm_overflow_pct": (100 * sum(r.get("grad_comm_overflow", 0) for r in recs)
                                   / msgs) if msgs else None,
        "max_scale_spread_binades": max(spreads) if spreads else 0.0,
    }  # fmt: skip


def _gather_rows(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a dim-0 sharded DTensor (torch.chunk shards; collective)."""
    from fp8lab.distributed.fsdp import local_weight

    world = world_size()
    full_rows = t.shape[0]
    rows = -(-full_rows // world)
    local = local_weight(t).detach()
    pad = torch.zeros((rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
    pad[: local.shape[0]] = local
    parts = [torch.empty_like(pad) for _ in range(world)]
    torch.distributed.all_gather(parts, pad)
    return torch.cat(parts)[:full_rows].clone()


def _full(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its full tensor (collective, in tree order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return _gather_rows(tree)
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_full(v) for v in tree]
    return tree


def _sharded_like(full: Any, like: Any) -> Any:
    """``full`` with each tensor whose counterpart in ``like`` is a DTensor turned into a DTensor
    of this rank's rows (no communication: every rank holds the full checkpoint)."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor) and isinstance(full, torch.Tensor):
        rows = torch.chunk(full, world_size(), dim=0)
        me = rank()
        mine = rows[me] if me < len(rows) else full[full.shape[0] :]
        return DTensor.from_local(
            mine.clone(), like.device_mesh, like.placements, run_check=False,
            shape=full.shape, stride=full.stride(),
        )  # fmt: skip
    if isinstance(full, dict) and isinstance(like, dict):
        return {k: _sharded_like(v, like.get(k)) for k, v in full.items()}
    if isinstance(full, list) and isinstance(like, list) and len(full) == len(like):
        return [_sharded_like(v, w) for v, w in zip(full, like, strict=True)]
    return full


class _FullState:
    """A model or optimizer under FSDP2 seen through full tensors (`DataParallel.for_checkpoint`)."""

    def __init__(self, obj: Any, save: bool, model: torch.nn.Module | None = None) -> None:
        self.obj = obj
        self._full = _full(obj.state_dict()) if save else None

    def state_dict(self) -> Any:
        if self._full is None:
            raise RuntimeError("for_checkpoint(save=False) views only load")
        return self._full

    def load_state_dict(self, state: Any) -> Any:
        like = self.obj.state_dict()
        if "state" in like and "state" in state:  # an optimizer: no state yet -> the params
            params = [p for g in self.obj.param_groups for p in g["params"]]
            like = {**like, "state": {i: {k: params[int(i)] if _same_shape(t, params[int(i)])
                                          else None for k, t in v.items()}
                                      for i, v in state["state"].items()}}  # fmt: skip
        return self.obj.load_state_dict(_sharded_like(state, like))


def _same_shape(t: Any, p: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape)
