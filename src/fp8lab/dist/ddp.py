"""`DataParallel`: what a training loop needs to run one model on every torchrun rank.

DDP (PyTorch's DistributedDataParallel) with the numerics of the global batch
(`fp8lab.dist.data`): contiguous batch shards, each rank's loss = its token sum / the global
token count, gradients summed over ranks (fp32 by default, or the simulated ``--grad-comm``
wire of `fp8lab.dist.hooks`), and the amax group of every delayed-scaling state set
(`fp8lab.dist.amax`). The loss it reports is the all-reduced global loss, the same value on
every rank, so guard decisions taken from it agree.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8lab.dist.amax import set_amax_group
from fp8lab.dist.data import allreduce_sum_hook, global_token_loss, shard_batch
from fp8lab.dist.hooks import GradCommHook

__all__ = ["DataParallel"]


class DataParallel:
    """DDP of ``model`` over the default process group (collective to construct)."""

    def __init__(self, model: torch.nn.Module, amax_group: str = "world", grad_comm: str = "fp32"):
        d = torch.distributed
        if not (d.is_available() and d.is_initialized()):
            raise RuntimeError("DataParallel needs torch.distributed initialized (torchrun)")
        self.rank, self.world = d.get_rank(), d.get_world_size()
        self.module = model
        self.amax_states = set_amax_group(model, amax_group)
        self.ddp = torch.nn.parallel.DistributedDataParallel(model)
        self.comm: GradCommHook | None = None
        if grad_comm == "fp32":
            self.ddp.register_comm_hook(None, allreduce_sum_hook)
        else:
            # the simulated wire averages; the loss is already global: scale the mean back by N
            self.comm = GradCommHook(grad_comm, sum_over_ranks=True).register(self.ddp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch (not divisible -> ValueError)."""
        return shard_batch(x, y, self.rank, self.world)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Forward this rank's shard: (loss to backward, the global mean loss -- the same float
        on every rank --, this rank's per-token losses)."""
        logits, _ = self.ddp(x)
        loss, per_token = global_token_loss(logits, y, y.numel() * self.world)
        total = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(total)
        return loss, float(total[0]), per_token

    def barrier(self) -> None:
        torch.distributed.barrier()

    def state(self) -> dict[str, Any]:
        """Counters of the gradient communication (empty for fp32)."""
        c = self.comm
        if c is None:
            return {}
        return {"grad_comm": c.precision, "grad_comm_rel_error": c.rel_error(),
                "grad_comm_underflow": c.underflow, "grad_comm_overflow": c.overflow,
                "grad_comm_bytes": c.bytes_sent}  # fmt: skip
