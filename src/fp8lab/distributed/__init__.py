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
"""
