"""Collective bytes of one data-parallel training step, from tensor sizes and formats.

Bytes are what **one rank sends per step** (the convention of `fp8lab.distributed.comm.bytes_per_rank`),
for ``N`` ranks, counted per Linear from the recipe's counted step (`count_linear_step`: which
tensors are quantized, in which format and blocks) plus the model's other parameters. The
options are `fp8lab.distributed.ddp.DataParallel`'s (checked by `fp8lab.distributed.ddp.check_options`, the
same messages as ``fp8lab compare``'s flags):

* **gradient reduction** over every gradient element (Linear weights + other parameters):

  - DDP: a ring all-reduce in the ``grad_comm`` precision, `fp8lab.distributed.comm.bytes_per_rank`
    (``2(N-1)/N`` of the data; ``fp32``, ``bf16``, ``fp8`` = E5M2 with a 4-byte scale per
    message, ``fp8-msamp`` = E4M3 with one amax all-reduce per bucket), buckets of
    `DDP_BUCKET_NUMEL` float32 elements (DDP's default ``bucket_cap_mb = 25``);
  - FSDP: a float32 reduce-scatter, ``(N-1)/N`` of the data (fp8lab's FSDP reduce-scatters
    float32; another ``grad_comm`` is refused, as ``fp8lab compare --fsdp`` refuses it).

* **amax all-reduces** (MAX, float32): with ``amax_group="world"`` every delayed-scaled tensor's
  amax is reduced once per step (``scale_update`` events: te-delayed, 3 per Linear); with
  ``batch_amax`` (DataParallel's default, TE's global amax buffer) all of them travel in one
  all-reduce per step, otherwise one all-reduce each; ``"none"`` reduces nothing. Under FSDP
  with ``fp8_allgather``, the weights quantized with per-tensor current scaling need their global
  amax before they are gathered: fp8lab all-reduces all of them in one buffer per step (at the
  root's forward; the backward's re-gathers reuse it). A weight whose column blocks span the
  sharded row axis, or NVFP4's tensor scale (both refused by fp8lab's gather, priced as TE would
  move them), all-reduces its amaxes before every gather. An all-reduce of ``k`` amaxes is
  priced as a ring: ``2(N-1)/N * 4k`` bytes per rank.

* **FSDP weight all-gathers** (``fsdp=True``; FSDP2 reshards after forward, so each weight is
  gathered twice per step): a ring all-gather of ``S`` bytes sends ``(N-1)/N * S`` per rank.
  Without ``fp8_allgather`` the weights travel in the recipe's 16-bit compute precision (bf16, as
  a GPU run with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` gathers them; fp32 for an
  all-fp32 recipe; fp8lab's CPU emulation gathers float32 to stay exact). With ``fp8_allgather``
  a quantized weight travels as codes + scales: the forward gathers the copy fprop uses; the
  backward gathers what dgrad's operand is made from -- the same copy when dgrad transposes or
  re-tiles it (per-tensor, 128x128), its own column-wise copy when it is quantized again from
  high precision (MXFP8: TE moves both layouts; fp8lab gathers the row-wise codes again and
  re-quantizes locally, the same number of bytes). Delayed-scaled weights travel as codes + one
  scale with no all-reduce before the gather (every rank holds the same scale; fp8lab gathers
  them so too). fp8lab refuses NVFP4 weights in its FP8 all-gather; they are priced here as TE
  would move them (codes + scales).
  Other parameters (embeddings, norms, head) travel in the 16-bit precision.

Not counted: the Linears' biases (add them to ``other``), optimizer-state sharding,
tensor/sequence/pipeline parallelism, and time (no interconnect tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8lab.cost.counting import StepCounts, scale_bytes
from fp8lab.distributed.comm import bytes_per_rank
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
    fp8_allgather: bool
    grad_reduce: float
    amax_allreduce: float
    amax_allreduces: int
    fsdp_allgather: float

    @property
    def total(self) -> float:
        return self.grad_reduce + self.amax_allreduce + self.fsdp_allgather

    def to_dict(self) -> dict[str, Any]:
        """``<name>_bytes`` per byte count (``total_bytes`` last) and ``amax_allreduces``."""
        names = ("grad_reduce", "amax_allreduce", "amax_allreduces", "fsdp_allgather", "total")
        return {n if n == "amax_allreduces" else f"{n}_bytes": getattr(self, n) for n in names}


def _copy_bytes(fmt: str, gran: tuple[int, int] | None, rule: str | None, o: int, i: int) -> int:
    """Bytes of one stored copy of an [o, i] weight: elements (+ scales when quantized)."""
    return int(o * i * get_format(fmt).bits / 8) + scale_bytes(gran, rule, (o, i))


def _gather_amaxes(counts: StepCounts, gemm: str, per_tensor: bool = False) -> int:
    """float32 amaxes all-reduced before gathering the weight copy quantized for ``gemm``:
    current scaling whose blocks span the sharded (row, ``O``) axis needs the other shards'
    amaxes (one per block column); NVFP4's FP32 tensor scale one more. Delayed scaling and blocks
    within a shard need none. The per-tensor current-scaled amax, which fp8lab all-reduces once
    per step with every other weight's (module doc), is counted only with ``per_tensor`` (then
    nothing else is)."""
    k = 0
    for e in counts.events:
        if e.kind != "amax" or e.role != "weight" or e.gemm != gemm or e.granularity is None:
            continue
        rows, cols = e.granularity
        if (e.scaling != "nvfp4" and (rows, cols) == (-1, -1)) != per_tensor:
            continue
        if e.scaling == "nvfp4":
            k += 1
        elif rows == -1:
            k += 1 if cols == -1 else -(-counts.dims["I"] // cols)
    return k


def _weight_gathers(counts: StepCounts, hp_bytes: int, fp8: bool) -> list[tuple[int, int]]:
    """(bytes of the copy, amaxes all-reduced first) of the forward and backward gathers."""
    o, i = counts.dims["O"], counts.dims["I"]
    g = {x.gemm: x for x in counts.gemms}
    fp, dg = g["fprop"], g["dgrad"]  # the weight is operand B of both
    if not fp8 or fp.gran_b is None:  # high-precision weights
        return [(o * i * hp_bytes, 0), (o * i * hp_bytes, 0)]
    fwd = (_copy_bytes(fp.fmt_b, fp.gran_b, fp.scaling_b, o, i), _gather_amaxes(counts, "fprop"))
    own = any(
        e.gemm == "dgrad" and e.role == "weight" and e.kind in ("cast", "retile_from_source")
        for e in counts.events
    )
    if dg.gran_b is None:  # dgrad uses the weight unquantized (a high-precision cell)
        bwd = (o * i * hp_bytes, 0)
    elif own:  # quantized again from high precision: its own copy
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


def _allreduce_bytes(n: int, floats: int) -> float:
    """Ring all-reduce of ``floats`` float32 values: ``2(N-1)/N`` of the buffer per rank."""
    return 2.0 * (n - 1) / n * 4 * floats


def collective_bytes(
    recipe: Recipe | str,
    linears: list[tuple[str, int, int]],
    *,
    ranks: int,
    grad_comm: str = "fp32",
    fsdp: bool = False,
    fp8_allgather: bool = False,
    amax_group: str = "world",
    batch_amax: bool = True,
    other: int = 0,
    bucket_numel: int = DDP_BUCKET_NUMEL,
) -> CollectiveBytes:
    """Bytes one rank sends in one step of data-parallel training of ``linears`` (``[(name, in,
    out)]``, a recipe with per-layer rules is applied per name) plus ``other`` parameter
    elements, on ``ranks`` ranks, with `fp8lab.distributed.ddp.DataParallel`'s options (module
    docstring). ``ranks`` = 1: all zeros. ValueError for ranks < 1 or an invalid option or
    combination (`fp8lab.distributed.ddp.check_options`)."""
    from fp8lab.cost.model import _counts, layer_recipe
    from fp8lab.distributed.ddp import check_options

    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    check_options(amax_group, grad_comm, fsdp, fp8_allgather)
    if not isinstance(other, int) or other < 0:
        raise ValueError(f"other must be an integer >= 0, got {other!r}")
    rec = get_recipe(recipe)
    n = ranks
    numel = other
    delayed = 0  # delayed-scaled tensors whose amax is reduced each step
    gather_amaxes: list[int] = []  # one entry per FSDP pre-gather all-reduce: amaxes in it
    batched = 0  # per-tensor current-scaled weights: their amaxes in one all-reduce per step
    gathered = 0.0  # bytes of every copy gathered (before the (N-1)/N)
    counted = []
    for lin, i, o in linears:
        lrec, _ = layer_recipe(rec, lin)
        counts = _counts(lrec).scaled(T=1, I=i, O=o)
        counted.append(counts)
        numel += o * i
        delayed += sum(
            1 for e in counts.events if e.kind == "scale_update" and _delayed_reduced(lrec, e.role)
        )
    all_fp32 = all(g.fmt_a == g.fmt_b == "fp32" for c in counted for g in c.gemms)
    hp_bytes = 4 if all_fp32 else 2
    if fsdp:
        for counts in counted:
            for nbytes, k in _weight_gathers(counts, hp_bytes, fp8_allgather):
                gathered += nbytes
                if k:
                    gather_amaxes.append(k)
            if fp8_allgather:
                batched += _gather_amaxes(counts, "fprop", per_tensor=True)
        gathered += 2 * other * hp_bytes  # forward and backward
    if n == 1:
        return CollectiveBytes(n, grad_comm, fsdp, fp8_allgather, 0.0, 0.0, 0, 0.0)
    if amax_group == "none":
        delayed = 0
    reductions = [delayed] if batch_amax and delayed else [1] * delayed
    reductions += gather_amaxes + ([batched] if batched else [])
    amax = sum((_allreduce_bytes(n, k) for k in reductions), 0.0)
    # FSDP: a float32 reduce-scatter; DDP: the all-reduce on the grad_comm wire
    grad = (n - 1) / n * 4 * numel if fsdp else bytes_per_rank(numel, n, grad_comm, bucket_numel)
    gather = (n - 1) / n * gathered
    return CollectiveBytes(n, grad_comm, fsdp, fp8_allgather, grad, amax, len(reductions), gather)
