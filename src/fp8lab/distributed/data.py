"""Data parallelism with the numerics of the global batch.

Each rank takes a contiguous slice of the global batch (`shard_batch`); its loss is its token
sum divided by the *global* token count (`global_token_loss`), and gradients are summed, not
averaged, over ranks (`allreduce_sum_hook` for DDP). So the gradients, and the amaxes of the
gradients flowing back through the quantized layers, are those of the global batch: with
``--amax-group world`` the first step's scales and per-token losses equal a one-rank run on
the same global batch bit for bit (tested); later steps differ only by the order of the fp32
gradient sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8lab.distributed.runtime import world_size

__all__ = ["allreduce_sum_hook", "gather_token_losses", "global_token_loss", "shard_batch"]


def shard_batch(
    x: torch.Tensor, y: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[rank*B/world, (rank+1)*B/world)`` of a global batch ``[B, ...]``.

    A batch size not divisible by ``world`` raises ValueError naming both.
    """
    b = x.shape[0]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if b % world:
        raise ValueError(
            f"global batch size {b} is not divisible by the world size {world}: "
            f"use a multiple of {world}"
        )
    per = b // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def global_token_loss(
    logits: torch.Tensor, targets: torch.Tensor, global_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's token-sum cross-entropy / ``global_tokens``, per-token losses [n]).

    The per-token losses are `F.cross_entropy(..., reduction="none")` of the rank's rows; the
    backward of the returned loss gives each token ``1/global_tokens``, as the mean over the
    global batch does.
    """
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return per_token.sum() / global_tokens, per_token.detach()


def gather_token_losses(per_token: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's per-token losses concatenated in rank order (the global batch's order).
    Collective; equal-size shards (`shard_batch`)."""
    parts = [torch.empty_like(per_token) for _ in range(world_size(group))]
    torch.distributed.all_gather(parts, per_token.contiguous(), group=group)
    return torch.cat(parts)


def allreduce_sum_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """DDP communication hook: all-reduce SUM of the bucket (no division by the world size,
    since each rank's loss is already divided by the global token count)."""
    group = state if state is not None else torch.distributed.group.WORLD
    fut = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations as objects (this module's are strings): give it the real ones
allreduce_sum_hook.__annotations__ = {
    "state": object,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
