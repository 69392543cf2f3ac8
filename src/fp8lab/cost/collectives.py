"""Collective bytes of one data-parallel training step, from tensor sizes and formats.

Bytes are what **one rank sends per step** (the convention of `fp8lab.dist.comm.bytes_per_rank`),
for ``N`` ranks, counted per Linear from the recipe's counted step (`count_linear_step`: which
tensors are quantized, in which format and blocks) plus the model's other parameters:

* **gradient reduction** in the ``--grad-comm`` precision (`fp8lab.dist.comm`: ``fp32``,
  ``bf16``, ``fp8`` = E5M2 with a 4-byte scale per message, ``fp8-msamp`` = E4M3 with one amax
  all-reduce per bucket) over every gradient element (Linear weights + other parameters):

  - DDP: a ring all-reduce, `fp8lab.dist.comm.bytes_per_rank` (``2(N-1)/N`` of the data, buckets
    of `DDP_BUCKET_NUMEL` float32 elements, DDP's default ``bucket_cap_mb = 25``);
  - FSDP: a reduce-scatter, half of it: ``(N-1)/N`` of the data, ``fp8`` adds ``N-1`` 4-byte
    scales per bucket and rank, ``fp8-msamp`` its amax all-reduce (``N-1`` messages of 4 bytes).

* **amax all-reduces**: fp8lab's delayed scaling all-reduces (MAX) the float32 amax of each
  delayed-scaled tensor once per step (`DelayedScaling.update` with ``reduce_amax``, the lab's
  ``amax_group = "world"``): one collective per Linear and delayed-scaled tensor (``scale_update``
  events). Under FSDP, a weight quantized with current scaling whose blocks span the sharded row
  axis (per-tensor; NVFP4's tensor scale) all-reduces its shard amaxes before every gather, as
  `fp8lab.dist.fsdp.fp8_all_gather` does: ``k`` float32 amaxes per gather. A scalar cannot be
  chunked over a ring: an all-reduce of ``k`` amaxes is counted as ``N-1`` messages of ``4k``
  bytes per rank (`fp8lab.dist.comm`'s convention for MS-AMP's amax).

* **FSDP all-gathers** (``fsdp=True``; FSDP2 reshards after forward, so each weight is gathered
  twice per step): a ring all-gather of ``S`` bytes sends ``(N-1)/N * S`` per rank. The forward
  gathers the weight as fprop uses it: FP8/FP4 codes plus scales for a quantized weight
  (torchao's float8 FSDP2 path; `fp8lab.dist.fsdp`), bf16 or fp32 for a high-precision one. The
  backward gathers what dgrad's operand is made from: the same copy when dgrad transposes or
  re-tiles it (DeepSeek-V3, Hopper), its own copy when it is quantized again from high precision
  (MXFP8/NVFP4 column-wise copies), or the high-precision weight. Other parameters (embeddings,
  norms, head) are gathered in bf16 (FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16)``),
  in fp32 for a recipe whose GEMMs are all fp32.

Not counted: biases of the Linears (add them to ``other`` when known), optimizer-state
sharding, tensor/sequence/pipeline parallelism, and the time these bytes take (no interconnect
tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8lab.cost.counting import StepCounts, scale_bytes
from fp8lab.dist.comm import WIRE_BYTES, bytes_per_rank, check_grad_comm
from fp8lab.formats import get_format
from fp8lab.recipe import Recipe, get_recipe

__all__ = ["DDP_BUCKET_NUMEL", "CollectiveBytes", "collective_bytes"]

#: DDP's default bucket: bucket_cap_mb = 25 MiB of float32 gradients
DDP_BUCKET_NUMEL = 25 * 2**20 // 4


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one rank sends per step (see the module docstring), and the number of amax
    all-reduces (collectives: latency, not bandwidth)."""

    ranks: int
    grad_comm: str
    fsdp: bool
    grad_reduce: float
    amax_allreduce: float
    amax_allreduces: int
    fsdp_allgather: float

    @property
    def total(self) -> float:
        return self.grad_reduce + self.amax_allreduce + self.fsdp_allgather

    def scaled(self, k: int) -> CollectiveBytes:
        """``k`` copies of these collectives (``k`` identical layers)."""
        return CollectiveBytes(
            self.ranks, self.grad_comm, self.fsdp, k * self.grad_reduce,
            k * self.amax_allreduce, k * self.amax_allreduces, k * self.fsdp_allgather,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "grad_reduce_bytes": self.grad_reduce,
            "amax_allreduce_bytes": self.amax_allreduce,
            "amax_allreduces": self.amax_allreduces,
            "fsdp_allgather_bytes": self.fsdp_allgather,
            "total_bytes": self.total,
        }


def _copy_bytes(fmt: str, gran: tuple[int, int] | None, rule: str | None, o: int, i: int) -> int:
    """Bytes of one stored copy of an [o, i] weight: elements (+ scales when quantized)."""
    return int(o * i * get_format(fmt).bits / 8) + scale_bytes(gran, rule, (o, i))


def _gather_amaxes(counts: StepCounts, gemm: str) -> int:
    """float32 amaxes all-reduced before gathering the weight copy quantized for ``gemm``:
    current scaling whose blocks span the sharded (row, ``O``) axis needs the other shards'
    amaxes (one per block column); NVFP4's FP32 tensor scale one more. Delayed scaling and blocks
    within a shard need none."""
    k = 0
    for e in counts.events:
        if e.kind != "amax" or e.role != "weight" or e.gemm != gemm or e.granularity is None:
            continue
        rows, cols = e.granularity
        if e.scaling == "nvfp4":
            k += 1
        elif rows == -1:
            k += 1 if cols == -1 else -(-counts.dims["I"] // cols)
    return k


def _weight_gathers(counts: StepCounts) -> list[tuple[int, int]]:
    """(bytes of the copy, amaxes all-reduced first) of the forward and backward gathers."""
    o, i = counts.dims["O"], counts.dims["I"]
    g = {x.gemm: x for x in counts.gemms}
    fp, dg = g["fprop"], g["dgrad"]  # the weight is operand B of both
    fwd = (_copy_bytes(fp.fmt_b, fp.gran_b, fp.scaling_b, o, i), _gather_amaxes(counts, "fprop"))
    own = any(
        e.gemm == "dgrad" and e.role == "weight" and e.kind in ("cast", "retile_from_source")
        for e in counts.events
    )
    if own or dg.gran_b is None:  # quantized again from high precision, or used unquantized
        bwd = (
            _copy_bytes(dg.fmt_b, dg.gran_b, dg.scaling_b, o, i),
            _gather_amaxes(counts, "dgrad"),
        )
    else:  # transposed / re-tiled / reused from the forward's copy: gathered as that copy
        bwd = fwd
    return [fwd, bwd]


def _delayed_reduced(recipe: Recipe, role: str) -> bool:
    spec = getattr(recipe, role, None)
    return bool(getattr(getattr(spec, "scaling", None), "reduce_amax", True))


def _reduce_scatter_bytes(numel: int, n: int, precision: str, bucket: int) -> float:
    buckets = -(-numel // bucket) if numel > 0 else 0
    data = (n - 1) / n * numel * WIRE_BYTES[precision]
    extra = {"fp8": (n - 1) * 4.0, "fp8-msamp": (n - 1) * 4.0}.get(precision, 0.0) * buckets
    return data + extra


def collective_bytes(
    recipe: Recipe | str,
    linears: list[tuple[str, int, int]],
    *,
    ranks: int,
    grad_comm: str = "fp32",
    fsdp: bool = False,
    other: int = 0,
    bucket_numel: int = DDP_BUCKET_NUMEL,
) -> CollectiveBytes:
    """Bytes one rank sends in one step of data-parallel training of ``linears`` (``[(name, in,
    out)]``, a recipe with per-layer rules is applied per name) plus ``other`` parameter
    elements, on ``ranks`` ranks (module docstring). ``ranks`` = 1: all zeros. ValueError for
    ranks < 1 or an unknown ``grad_comm``."""
    from fp8lab.cost.model import _counts, layer_recipe

    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    check_grad_comm(grad_comm)
    if not isinstance(other, int) or other < 0:
        raise ValueError(f"other must be an integer >= 0, got {other!r}")
    rec = get_recipe(recipe)
    n = ranks
    numel = other
    amax_k: list[int] = []  # one entry per amax all-reduce: amaxes in it
    gathered = 0.0  # bytes of every copy gathered (before the (N-1)/N)
    all_fp32 = True
    for lin, i, o in linears:
        lrec, _ = layer_recipe(rec, lin)
        counts = _counts(lrec).scaled(T=1, I=i, O=o)
        numel += o * i
        all_fp32 &= all(g.fmt_a == g.fmt_b == "fp32" for g in counts.gemms)
        amax_k += [
            1 for e in counts.events if e.kind == "scale_update" and _delayed_reduced(lrec, e.role)
        ]
        if fsdp:
            for nbytes, k in _weight_gathers(counts):
                gathered += nbytes
                if k:
                    amax_k.append(k)
    if n == 1:
        return CollectiveBytes(n, grad_comm, fsdp, 0.0, 0.0, 0, 0.0)
    if fsdp:
        gathered += 2 * other * (4 if all_fp32 else 2)  # forward and backward
        grad = _reduce_scatter_bytes(numel, n, grad_comm, bucket_numel)
    else:
        grad = bytes_per_rank(numel, n, grad_comm, bucket_numel)
    amax = sum(((n - 1) * 4.0 * k for k in amax_k), 0.0)
    gather = (n - 1) / n * gathered
    return CollectiveBytes(n, grad_comm, fsdp, grad, amax, len(amax_k), gather)
