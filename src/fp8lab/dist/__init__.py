"""L6: torch.distributed glue and the numerics of distributed FP8.

* `fp8lab.dist.comm`: low-precision gradient all-reduce (``fp32|bf16|fp8|fp8-msamp``) simulated
  for N ranks in one process (pure functions; ``fp8lab comm-sim``).
* `fp8lab.dist.amax`: amax reduction groups (``--amax-group world|none``) on a model's
  delayed-scaling states, and the per-rank scale spread.
* `fp8lab.dist.fsdp`: FP8 all-gather of sharded weights as uint8 codes plus scales.

Tensor and sequence parallelism are out of scope (see docs/distributed.md).
"""
