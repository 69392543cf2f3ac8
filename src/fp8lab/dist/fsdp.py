"""FP8 all-gather of row-sharded weights (FSDP2 layout) as uint8 codes plus scales.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards each parameter along dim 0 (``torch.chunk``:
``ceil(R / world)`` rows per rank, the last shards shorter or empty) and all-gathers it before use.
torchao's float8 FSDP2 path quantizes each shard with the amax of the *whole* weight and
all-gathers float8 data; on CPU gloo refuses ``float8_e4m3fn`` tensors ("Invalid scalar type"),
so here the codes travel as uint8 (`fp8lab.formats.encode` / `decode`) with their float32 scales.

Granularities:

* per-tensor (``"tensor"``): the amax is all-reduced (MAX) first, so every shard uses the scale
  of the unsharded weight and the gathered weight equals the unsharded quantization bit for bit;
* blocks that never cross a shard boundary (``"row"``, ``"mx"``, ``(m, k)`` with the shard's
  row count a multiple of ``m``): each shard quantizes alone, also bit for bit;
* blocks spanning shards (``"col"``, ``"mx_col"``, ``128x128`` over a 100-row shard): refused
  with a ValueError naming the granularity and the shard boundary (padding would change the
  block contents, so it is not done).

Delayed scaling of the weight is not supported here (its scale is state of the module; use a
current-scaling weight spec).
"""

from __future__ import annotations

from typing import Any

import torch

from fp8lab.formats import decode, encode, get_format
from fp8lab.qtensor import QTensor, QuantSpec, quantize
from fp8lab.scaling.granularity import normalize_granularity, resolve_block, shape_2d
from fp8lab.scaling.rules import get_rule

__all__ = ["check_shardable", "fp8_all_gather", "shard_rows"]


def shard_rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP2's shard of ``w`` on ``rank``: ``torch.chunk(w, world, dim=0)[rank]`` (may be empty)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    chunks = torch.chunk(w, world, dim=0)
    return chunks[rank] if rank < len(chunks) else w[w.shape[0] :]


def check_shardable(spec: QuantSpec, shape: tuple[int, ...], world: int) -> None:
    """Raise ValueError if ``spec``'s scale blocks would straddle a dim-0 shard boundary of a
    weight of ``shape`` sharded over ``world`` ranks, or if its scaling cannot be gathered."""
    if spec.is_delayed:
        raise ValueError("FP8 all-gather needs a current-scaling weight spec, not delayed scaling")
    if isinstance(spec.scaling, str) and spec.scaling.strip().lower() == "nvfp4":
        raise ValueError("FP8 all-gather does not handle NVFP4's two-level scales")
    r, c = shape_2d(shape)
    m, k = normalize_granularity(spec.granularity)
    if (m, k) == (-1, -1):
        return  # per-tensor: global amax
    rows = -(-r // world) if world > 0 else r  # rows per shard (torch.chunk)
    bm, _ = resolve_block((m, k), (r, c))
    if m == -1 or (rows % bm and rows < r):
        raise ValueError(
            f"granularity {spec.granularity!r} (blocks of {bm} rows) straddles the shard boundary "
            f"at row {rows} of a {r}-row weight over {world} ranks: use per-tensor, 'row' or "
            f"'mx' scaling, or a block height dividing {rows}"
        )


def _scale_of(spec: QuantSpec, amax: torch.Tensor) -> torch.Tensor:
    rule = spec.scaling if isinstance(spec.scaling, str) else "max"
    return get_rule(rule)(amax, spec.format, margin=spec.margin, epsilon=spec.epsilon)


def fp8_all_gather(
    shard: torch.Tensor, spec: QuantSpec, full_rows: int, group: Any = None
) -> torch.Tensor:
    """Quantize this rank's row shard under ``spec``, all-gather uint8 codes and float32 scales,
    and return the dequantized full weight ``[full_rows, ...]`` (float32, same on every rank).

    Collective over ``group`` (default world); shards follow `shard_rows`. See the module doc
    for which granularities are exact and which are refused (`check_shardable`).
    """
    d = torch.distributed
    world = d.get_world_size(group)
    full_shape = (int(full_rows), *shard.shape[1:])
    check_shardable(spec, full_shape, world)
    fmt = get_format(spec.format)
    if fmt.bits > 8:
        raise ValueError(f"FP8 all-gather moves 8-bit codes; {fmt.name} has {fmt.bits} bits")
    x = shard.detach().float()
    if normalize_granularity(spec.granularity) == (-1, -1):
        amax = x.abs().amax() if x.numel() else torch.zeros(())
        amax = amax.reshape(1).clone()
        d.all_reduce(amax, op=d.ReduceOp.MAX, group=group)
        local = spec.replace(scaling=float(_scale_of(spec, amax[0])))
    else:
        local = spec
    rows = -(-int(full_rows) // world)
    n = x.shape[0]
    q = quantize(x, local) if n else None
    codes = torch.zeros((rows, *shard.shape[1:]), dtype=torch.uint8)  # padded to equal shards
    if q is not None:
        codes[:n] = encode(q.values, fmt)  # exact: values are on the grid
    parts = [torch.empty_like(codes) for _ in range(world)]
    d.all_gather(parts, codes, group=group)
    values = decode(torch.cat(parts)[: int(full_rows)], fmt)
    scales = _gather_scales(q, local, shard.shape, rows, world, group)
    return QTensor(values=values, scales=scales, spec=local).dequantize()


def _gather_scales(
    q: QTensor | None, spec: QuantSpec, shard_shape: Any, rows: int, world: int, group: Any
) -> torch.Tensor:
    """Every shard's per-block dequantization scales, stacked along the block rows."""
    d = torch.distributed
    if normalize_granularity(spec.granularity) == (-1, -1):
        # every rank quantized with the same fixed scale (from the all-reduced amax), so its
        # scale_inv is known here without a second collective, also on an empty shard
        if q is not None:
            return q.scales.reshape(1, 1)
        return torch.reciprocal(torch.full((1, 1), float(spec.scaling), dtype=torch.float32))
    r, c = shape_2d((rows, *shard_shape[1:]))
    m, k = resolve_block(normalize_granularity(spec.granularity), (r, c))
    nr, nc = -(-r // m), -(-c // k)
    mine = torch.zeros((nr, nc), dtype=torch.float32)
    counts = torch.zeros(1, dtype=torch.int64)
    if q is not None:
        mine[: q.scales.shape[0]] = q.scales
        counts[0] = q.scales.shape[0]
    parts = [torch.empty_like(mine) for _ in range(world)]
    d.all_gather(parts, mine, group=group)
    ns = [torch.empty_like(counts) for _ in range(world)]
    d.all_gather(ns, counts, group=group)
    return torch.cat([p[: int(cnt)] for p, cnt in zip(parts, ns, strict=True)])
