"""A DDP communication hook with the wire numerics of `fp8lab.distributed.comm` (``--grad-comm``).

`GradCommHook(precision).register(ddp)` (the state of `grad_comm_hook`) all-gathers each
bucket's float32 gradients (every rank then holds all ``N`` of them) and runs the simulated ring
all-reduce `fp8lab.distributed.comm.ring_allreduce` on them, so every rank gets the same averaged
gradient, bit for bit the one ``comm-sim`` computes for these gradients. The bytes moved by the
all-gather are not what is modelled: the counters report the modelled wire (bytes from message
sizes and formats), plus the error against the fp32 ring all-reduce of the same gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8lab.distributed.comm import check_grad_comm, ring_allreduce
from fp8lab.distributed.runtime import world_size

__all__ = ["GradCommHook", "grad_comm_hook"]


@dataclass
class GradCommHook:
    """DDP comm hook state and callable. Counters accumulate over buckets and steps.

    ``sq_error`` / ``sq_ref``: summed squares of (result - fp32 ring) and of the fp32 ring result,
    so ``sqrt(sq_error / sq_ref)`` is the relative L2 error against the fp32 all-reduce.
    """

    precision: str = "fp32"
    group: Any = None
    #: return the sum over ranks (``mean * N``: exact for a power-of-two N) instead of the mean,
    #: for losses already divided by the global token count (`fp8lab.distributed.data`)
    sum_over_ranks: bool = False
    messages: int = 0
    underflow: int = 0
    overflow: int = 0
    bytes_sent: float = 0.0
    sq_error: float = 0.0
    sq_ref: float = 0.0

    def __post_init__(self) -> None:
        check_grad_comm(self.precision)

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> GradCommHook:
        """Install on ``ddp`` (this object is the hook's state); returns self."""
        ddp.register_comm_hook(self, grad_comm_hook)
        return self

    def reduce(self, bucket: Any) -> torch.futures.Future:
        """All-reduce one DDP bucket with the simulated wire numerics (collective)."""
        d = torch.distributed
        buf = bucket.buffer()
        world = world_size(self.group)
        parts = [torch.empty_like(buf) for _ in range(world)]
        d.all_gather(parts, buf.contiguous(), group=self.group)
        grads = torch.stack(parts).float()
        res = ring_allreduce(grads, self.precision)
        ref = res if self.precision == "fp32" else ring_allreduce(grads, "fp32")
        self.messages += res.messages
        self.underflow += res.underflow
        self.overflow += res.overflow
        self.bytes_sent += res.bytes_per_rank
        self.sq_error += float((res.out.double() - ref.out.double()).square().sum())
        self.sq_ref += float(ref.out.double().square().sum())
        buf.copy_(res.out * world if self.sum_over_ranks else res.out)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def rel_error(self) -> float:
        """Relative L2 error of the communicated gradients against the fp32 all-reduce."""
        return (self.sq_error / self.sq_ref) ** 0.5 if self.sq_ref > 0 else 0.0


def grad_comm_hook(state: GradCommHook, bucket: Any) -> torch.futures.Future:
    """The DDP hook function: ``state.reduce(bucket)``."""
    return state.reduce(bucket)


# DDP checks a hook's annotations as objects (this module's are strings)
grad_comm_hook.__annotations__ = {
    "state": object,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
