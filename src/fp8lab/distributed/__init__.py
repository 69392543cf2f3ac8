"""L6: torch.distributed glue and the numerics of distributed FP8.

* `fp8lab.distributed.comm`: low-precision gradient all-reduce (``fp32|bf16|fp8|fp8-msamp``) simulated
  for N ranks in one process (pure functions; ``fp8lab comm-sim``).
* `fp8lab.distributed.amax`: amax reduction groups (``--amax-group world|none``) on a model's
  delayed-scaling states, their batched all-reduce (one per step), the per-rank scale spread.
* `fp8lab.distributed.fsdp`: FP8 all-gather of sharded weights as uint8 codes plus scales, as a
  function and inside FSDP2's ``fully_shard`` (``--fsdp``, ``--fp8-allgather``).
* `fp8lab.distributed.ddp`: `DataParallel`, what the training lab runs under torchrun (DDP or FSDP2,
  global-batch numerics, ``--grad-comm`` hooks, per-step metrics, consolidated checkpoints).
* `fp8lab.distributed.runtime`: joining torchrun's group, guard agreement, leaving the group.

Tensor and sequence parallelism are out of scope (see docs/distributed.md).

`fp8lab.distributed.set_amax_reduction()` (from `amax`, loaded on first use) turns on the amax
all-reduce of delayed scaling across the ranks; importing fp8lab never does.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # lazy: the pure submodules (comm) do not pull in torch.nn and the recipes
    if name == "set_amax_reduction":
        from fp8lab.distributed.amax import set_amax_reduction

        return set_amax_reduction
    raise AttributeError(f"module 'fp8lab.distributed' has no attribute {name!r}")
