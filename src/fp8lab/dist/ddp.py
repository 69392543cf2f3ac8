"""`DataParallel`: what a training loop needs to run one model on every torchrun rank.

DDP (PyTorch's DistributedDataParallel) or FSDP2 (``fully_shard``, `fp8lab.dist.fsdp`) with the
numerics of the global batch (`fp8lab.dist.data`): contiguous batch shards, each rank's loss =
its token sum / the global token count, gradients summed over ranks (fp32 by default, or the
simulated ``--grad-comm`` wire of `fp8lab.dist.hooks` under DDP), and the amax group of every
delayed-scaling state set (`fp8lab.dist.amax`), its reductions batched into one all-reduce per
step at the end of the backward. The loss it reports is the all-reduced global loss, the same
value on every rank, so guard decisions taken from it agree.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8lab.dist.amax import AMAX_GROUPS, AmaxBatch, batch_amax_reduction, set_amax_group
from fp8lab.dist.comm import WIRE_BYTES, check_grad_comm
from fp8lab.dist.data import allreduce_sum_hook, global_token_loss, shard_batch
from fp8lab.dist.hooks import GradCommHook

__all__ = ["DataParallel", "check_options"]


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
        d = torch.distributed
        if not (d.is_available() and d.is_initialized()):
            raise RuntimeError("DataParallel needs torch.distributed initialized (torchrun)")
        check_options(amax_group, grad_comm, fsdp, fp8_allgather)
        self.rank, self.world = d.get_rank(), d.get_world_size()
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

            from fp8lab.dist.fsdp import shard_model

            self.ddp = shard_model(model, fp8_allgather)
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

    def comm_bytes(self) -> dict[str, float]:
        """Bytes one rank sends per step for the gradients, by precision (ring all-reduce of
        DDP's 25 MiB buckets, `fp8lab.dist.comm.bytes_per_rank`), counted from the parameter
        count and each precision's wire format."""
        from fp8lab.dist.comm import bytes_per_rank

        bucket = 25 * 1024 * 1024 // 4
        return {p: bytes_per_rank(self.grad_numel, self.world, p, bucket) for p in WIRE_BYTES}

    def state(self) -> dict[str, Any]:
        """Per-step fields for the metrics: the gradient communication counters (accumulated
        since the start: relative L2 error against the fp32 all-reduce, underflow/overflow of
        partial sums, bytes sent by this rank) and, with ``--amax-group none``, the largest
        per-rank scale spread in binades (collective)."""
        out: dict[str, Any] = {"ranks": self.world, "amax_group": self.amax_group,
                               "grad_comm": self.grad_comm, "fsdp": self.fsdp}  # fmt: skip
        c = self.comm
        if c is not None:
            out.update(grad_comm_rel_error=c.rel_error(), grad_comm_messages=c.messages,
                       grad_comm_underflow=c.underflow, grad_comm_overflow=c.overflow,
                       grad_comm_bytes=c.bytes_sent)  # fmt: skip
        if self.amax_group == "none":
            from fp8lab.dist.amax import scale_spread

            spread = list(scale_spread(self.module).values())
            out["scale_spread_binades"] = max(spread) if spread else 0.0
        return out
