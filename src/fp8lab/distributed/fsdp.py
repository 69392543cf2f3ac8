"""FP8 all-gather of row-sharded weights (FSDP2 layout) as uint8 codes plus scales.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards each parameter along dim 0 (``torch.chunk``:
``ceil(R / world)`` rows per rank, the last shards shorter or empty) and all-gathers it before use.
torchao's float8 FSDP2 path quantizes each shard with the amax of the *whole* weight and
all-gathers float8 data; on CPU gloo refuses ``float8_e4m3fn`` tensors ("Invalid scalar type"),
so here the codes travel as uint8 (`fp8lab.formats.encode` / `decode`) with their float32 scales.

Granularities:

* per-tensor (``"tensor"``): the amax is all-reduced (MAX) first, so every shard uses the scale
  of the unsharded weight and the gathered weight equals the unsharded quantization bit for bit
  (under `shard_model` every such weight's amax travels in one all-reduce per forward, at the
  root's forward pre-hook: `_WeightAmaxes`);
* blocks that never cross a shard boundary (``"row"``, ``"mx"``, ``(m, k)`` with the shard's
  row count a multiple of ``m``): each shard quantizes alone, also bit for bit;
* blocks spanning shards (``"col"``, ``"mx_col"``, ``128x128`` over a 100-row shard): refused
  with a ValueError naming the granularity and the shard boundary (padding would change the
  block contents, so it is not done).

Delayed scaling (per-tensor, te-delayed): the scale is the weight's `DelayedScaling` state,
computed from its amax history, and every rank holds the same history (``--amax-group world``:
each step's amax is all-reduced MAX before it enters the history), so every shard is quantized
with the unsharded weight's scale without a collective, bit for bit, as torchao's FSDP2 float8
all-gather does under delayed scaling (pytorch-labs/float8_experimental PR #312,
``WeightWithDelayedFloat8CastTensor``). The shard's own amax is what this rank observes; the
all-reduce MAX of the step's amaxes (after quantization, batched with the others by
`fp8lab.distributed.amax.AmaxBatch`) turns it into the whole weight's amax before it enters the
history, so the histories stay identical. Two exceptions need the global amax first: the first
step of ``first_step="current"`` (HiFloat8: current scaling until the first update), which
all-reduces it before quantizing, and ``--amax-group none`` (per-rank histories, so per-rank
scales), which is refused with the FP8 all-gather.

FSDP2 itself (`shard_model`): every weight of a `fp8lab.nn.Linear` becomes a `ShardedWeight`, a
tensor subclass with FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, the hook torchao's float8 training uses), then each block of every
``ModuleList`` and the root are wrapped by ``fully_shard``:

* ``fp8_allgather=True``: before the all-gather each rank quantizes its shard under the Linear's
  fprop weight spec with the global amax (all-reduced MAX for all such weights at once at the
  root's forward, reused by the backward's re-gathers; delayed scaling: with the Linear's
  own `DelayedScaling` scale, no collective, the shard's amax observed by the Linear's forward
  pre-hook, once per forward as the unsharded Linear observes it) and hands FSDP uint8 codes (plus
  float32 block scales for row-aligned blocks on evenly sharded weights); after it the codes are
  decoded into the `QTensor` of the whole weight, which the Linear's fprop consumes as is
  (`fp8lab.nn.Linear.use_gathered_weight` hands it a `fp8lab.nn.GatheredWeight`, taken when
  its fprop weight quantizer has that spec and state) -- bit for bit the unsharded quantization -- while the Parameter holds its
  dequantized values (what the backward re-quantizes when a backward GEMM wants another
  layout, and what the gradient flows to).
* ``fp8_allgather=False``: float32 shards are gathered (exact); the Linear quantizes the
  gathered weight as without FSDP.

Memory: the unsharded weight is freed when FSDP reshards (after the forward for every block,
after the backward for all; the backward re-gathers), as in FSDP2. FSDP frees an unsharded
parameter by resizing its storage to 0, which fails for a storage fp8lab's numba kernels have
read through ``.numpy()`` (that makes a storage non-resizable). So the gathered tensor is a
fresh tensor per all-gather, never FSDP's all-gather output, and FSDP's free of each
`ShardedWeight` parameter also drops it (`_free_with_fsdp`: the unsharded Parameter's data
becomes an empty tensor, its gathered QTensor is dropped; the next all-gather points the same
Parameter at the new tensor). Between steps no full-size weight (float32 or its codes) stays
alive (tested). What autograd keeps for the backward (the forward's QTensor of the weight, or
the weight itself for a backward GEMM that re-quantizes it) lives until the backward, as the
saved FP8 weight does with Transformer Engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fp8lab.distributed.amax import reduce_amax
from fp8lab.distributed.runtime import collective_device, world_size
from fp8lab.formats import decode, encode, get_format
from fp8lab.nn.linear import GatheredWeight
from fp8lab.nn.state import state_key
from fp8lab.qtensor import QTensor, QuantSpec, quantize
from fp8lab.scaling.delayed import DelayedScaling
from fp8lab.scaling.granularity import (
    block_amax,
    normalize_granularity,
    resolve_block,
    shape_2d,
)
from fp8lab.scaling.rules import get_rule

__all__ = [
    "ShardedWeight",
    "check_fp8_allgather_recipe",
    "check_shardable",
    "fp8_all_gather",
    "shard_model",
    "shard_rows",
]


def shard_rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP2's shard of ``w`` on ``rank``: ``torch.chunk(w, world, dim=0)[rank]`` (may be empty)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    chunks = torch.chunk(w, world, dim=0)
    return chunks[rank] if rank < len(chunks) else w[w.shape[0] :]


def check_shardable(spec: QuantSpec, shape: tuple[int, ...], world: int) -> None:
    """Raise ValueError if ``spec``'s scale blocks would straddle a dim-0 shard boundary of a
    weight of ``shape`` sharded over ``world`` ranks, or if its scaling cannot be gathered.
    Delayed scaling is per-tensor: always shardable."""
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


def check_fp8_allgather_recipe(recipe: Any, amax_group: str = "world") -> None:
    """ValueError naming the recipe when its weights cannot be all-gathered as FP8 codes (an
    NVFP4 or wider-than-8-bit fprop weight spec, or a delayed-scaled one whose amax is not
    reduced over the ranks: ``amax_group="none"`` or ``reduce_amax=False``, so the ranks' scales
    differ); a recipe without a quantized weight (fp32, bf16) is fine: its weights are gathered
    in fp32. Shapes are checked later (`check_shardable`, per layer)."""
    spec = None if recipe is None else recipe.spec("fprop", "weight")
    if spec is None:
        return
    name = getattr(recipe, "name", "?")
    if spec.is_delayed:
        _check_delayed_gather(spec, amax_group, f"recipe {name!r}")
    if isinstance(spec.scaling, str) and spec.scaling.strip().lower() == "nvfp4":
        raise ValueError(f"--fp8-allgather: recipe {name!r}: NVFP4's two-level scales are not "
                         "gathered")  # fmt: skip
    if get_format(spec.format).bits > 8:
        raise ValueError(f"--fp8-allgather: recipe {name!r} has {spec.format} weights, not 8-bit")


def _check_delayed_gather(spec: QuantSpec, amax_group: str, what: str) -> None:
    """ValueError naming ``what`` when a delayed-scaled weight's shards would be quantized with
    different scales on different ranks (its amax is not reduced over all of them)."""
    if amax_group != "world":
        raise ValueError(f"--fp8-allgather: {what}: delayed-scaled weights need --amax-group "
                         f"world (with {amax_group} every rank keeps its own amax history, so "
                         "each would quantize its shard with its own scale)")  # fmt: skip
    cfg = getattr(spec.scaling, "cfg", spec.scaling)
    if not cfg.reduce_amax:
        raise ValueError(f"--fp8-allgather: {what}: delayed-scaled weights with "
                         "reduce_amax=False keep an amax history per rank, so each rank would "
                         "quantize its shard with its own scale")  # fmt: skip


def _scale_of(spec: QuantSpec, amax: torch.Tensor) -> torch.Tensor:
    rule = spec.scaling if isinstance(spec.scaling, str) else "max"
    return get_rule(rule)(amax, spec.format, margin=spec.margin, epsilon=spec.epsilon)


def fp8_all_gather(
    shard: torch.Tensor,
    spec: QuantSpec,
    full_rows: int,
    group: Any = None,
    state: DelayedScaling | None = None,
) -> torch.Tensor:
    """Quantize this rank's row shard under ``spec``, all-gather uint8 codes and float32 scales,
    and return the dequantized full weight ``[full_rows, ...]`` (float32, same on every rank).

    Collective over ``group`` (default world); shards follow `shard_rows`. See the module doc
    for which granularities are exact and which are refused (`check_shardable`). Delayed
    scaling: ``state`` (a `DelayedScaling` of ``spec.scaling``'s configuration, as
    ``quantize(x, spec, state=ds)`` takes it) gives the scale and observes this shard's amax
    (its ``update`` all-reduces MAX over the ranks, as every delayed state's does); every
    rank's state must be the same (``--amax-group world``). Without ``state`` a bare
    configuration is step 0 of a throwaway state; a spec bound to a state (deprecated) uses
    that state.
    """
    d = torch.distributed
    world = world_size(group)
    full_shape = (int(full_rows), *shard.shape[1:])
    check_shardable(spec, full_shape, world)
    fmt = get_format(spec.format)
    if fmt.bits > 8:
        raise ValueError(f"FP8 all-gather moves 8-bit codes; {fmt.name} has {fmt.bits} bits")
    rows = -(-int(full_rows) // world)
    if state is not None and not spec.is_delayed:
        raise ValueError(f"state= is for delayed scaling; {spec} is not delayed")
    local, q, codes, amax = _quantize_shard(shard, spec, rows, group, state=state)
    owner = state if state is not None else spec.scaling
    if amax is not None and isinstance(owner, DelayedScaling):
        owner.observe(amax)  # this shard's amax; the update's all-reduce makes it global
    parts = [torch.empty_like(codes) for _ in range(world)]
    d.all_gather(parts, codes, group=group)
    values = decode(torch.cat(parts)[: int(full_rows)], fmt)
    scales = _gather_scales(q, local, shard.shape, rows, world, group, int(full_rows))
    return QTensor(values=values, scales=scales, spec=local).dequantize()


def _quantize_shard(
    shard: torch.Tensor, spec: QuantSpec, rows: int, group: Any,
    global_amax: torch.Tensor | None = None, state: DelayedScaling | None = None,
) -> tuple[QuantSpec, QTensor | None, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Quantize a row shard (per-tensor: with the global amax, one all-reduce MAX over
    ``group`` unless ``global_amax`` already holds it; collective; delayed scaling: with the
    state's scale, no collective except on a ``first_step="current"`` state's first step):
    (the spec used, the QTensor or None for an empty shard, uint8 codes zero-padded to ``rows``
    rows, and for delayed scaling the shard's amax for the state to observe -- nothing is
    observed here -- else None)."""
    fmt = get_format(spec.format)
    x = shard.detach().float()
    observed = None
    if spec.is_delayed:
        local, observed = _delayed_shard_spec(spec, x, group, state)
    elif normalize_granularity(spec.granularity) == (-1, -1):
        if global_amax is None:
            global_amax = reduce_amax(_shard_amax(x).reshape(1).clone(), group)
        local = spec.replace(scaling=float(_scale_of(spec, global_amax.reshape(()))))
    else:
        local = spec
    n = x.shape[0]
    q = quantize(x, local) if n else None
    # padded to equal shards, on the shard's device (NCCL gathers CUDA tensors)
    codes = torch.zeros((rows, *shard.shape[1:]), dtype=torch.uint8, device=shard.device)
    if q is not None:
        codes[:n] = encode(q.values, fmt)  # exact: values are on the grid
    return local, q, codes, observed


def _shard_amax(x: torch.Tensor) -> torch.Tensor:
    """A float32 shard's amax, NaN ignored as the unsharded quantize's amax ignores it (TE;
    `fp8lab.scaling.block_amax`), 0 for an empty shard: a 0-d tensor."""
    if not x.numel():
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return block_amax(x, "tensor").reshape(())


class _WeightAmaxes:
    """The global amaxes of a sharded model's per-tensor current-scaled weights, all-reduced
    in one buffer per forward instead of one all-reduce per gathered weight.

    `refresh` (a forward pre-hook of the root, run before FSDP's own, which starts the
    gathers) takes every member's shard amax and all-reduces them MAX as one float32 vector:
    the step's forward gathers and the backward's re-gathers use it -- the weights do not
    change in between -- as torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does once
    per step after the optimizer step (there an explicit call; here the root's forward, which
    every rank runs). The same amaxes, so the same scales, bit for bit. `get` answers only for
    the shard tensor and version it was computed from; a gather outside a forward after the
    weights changed (or before any forward) all-reduces its own amax as before."""

    def __init__(self, members: list[tuple[Any, Any]], group: Any) -> None:
        self.members = members  # (module, FSDPParam) of each weight, in model order
        self.group = group
        self.cache: dict[int, tuple[Any, int, torch.Tensor]] = {}

    def refresh(self, *args: Any) -> None:
        import weakref

        shards = [fp._sharded_local_tensor._tensor for _, fp in self.members]
        amax = reduce_amax(torch.stack([_shard_amax(x.detach().float()) for x in shards]),
                           self.group)  # fmt: skip
        self.cache = {
            id(m): (weakref.ref(x), x._version, amax[i : i + 1])
            for i, ((m, _), x) in enumerate(zip(self.members, shards, strict=True))
        }

    def get(self, module: Any, shard: torch.Tensor) -> torch.Tensor | None:
        hit = self.cache.get(id(module))
        if hit is None or hit[0]() is not shard or hit[1] != shard._version:
            return None
        return hit[2]


def _delayed_shard_spec(
    spec: QuantSpec, x: torch.Tensor, group: Any, state: DelayedScaling | None = None
) -> tuple[QuantSpec, torch.Tensor]:
    """The fixed-scale spec a delayed-scaled shard is quantized with, and the shard's amax.

    The scale is the state's (`DelayedScaling.scale_for`, as an unsharded quantize takes it; a
    bare `DelayedScalingConfig` is step 0 of a throwaway state), the same on every rank when
    their states are; only a ``first_step="current"`` state before its first update needs the
    whole weight's amax (current scaling), all-reduced MAX over ``group`` first (every rank
    takes that branch together: identical states)."""
    sc = spec.scaling
    ds = state or (
        sc
        if isinstance(sc, DelayedScaling)
        else DelayedScaling.bind(sc, spec.format, device=x.device)  # the shard's device
    )
    amax = _shard_amax(x)
    full = None
    if ds.cfg.first_step == "current" and not ds.initialized:
        full = reduce_amax(amax.reshape(1).clone(), group).reshape(())
    scale = ds.scale_for(full, spec.format)
    return spec.replace(scaling=float(scale)), amax


def _gather_scales(
    q: QTensor | None, spec: QuantSpec, shard_shape: Any, rows: int, world: int, group: Any,
    full_rows: int,
) -> torch.Tensor:  # fmt: skip
    """Every shard's per-block dequantization scales, stacked along the block rows."""
    d = torch.distributed
    device = collective_device(group)
    if normalize_granularity(spec.granularity) == (-1, -1):
        # every rank quantized with the same fixed scale (from the all-reduced amax), so its
        # scale_inv is known here without a second collective, also on an empty shard
        if q is not None:
            return q.scales.reshape(1, 1)
        return torch.reciprocal(
            torch.full((1, 1), float(spec.scaling), dtype=torch.float32, device=device)
        )
    r, c = shape_2d((rows, *shard_shape[1:]))
    m, k = resolve_block(normalize_granularity(spec.granularity), (r, c))
    nr, nc = -(-r // m), -(-c // k)
    mine = torch.zeros((nr, nc), dtype=torch.float32, device=device)
    if q is not None:
        mine[: q.scales.shape[0]] = q.scales
    parts = [torch.empty_like(mine) for _ in range(world)]
    d.all_gather(parts, mine, group=group)
    # shard i has min(rows, full_rows - i*rows) rows (torch.chunk), hence its scale-block rows
    counts = [-(-max(0, min(rows, full_rows - i * rows)) // m) for i in range(world)]
    return torch.cat([p[:cnt] for p, cnt in zip(parts, counts, strict=True)])


# --------------------------------------------------------------------------- FSDP2 extension
_aten = torch.ops.aten
# FSDP pads, slices and copies the local shard: those results stay a ShardedWeight (as torchao)
_KEEP_SUBCLASS = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten.split.Tensor,
    _aten.clone.default, _aten.chunk.default, _aten.narrow.default, _aten.alias.default,
}  # fmt: skip


class ShardedWeight(torch.Tensor):
    """A float32 weight (shard) whose FSDP2 all-gather fp8lab controls (see the module doc).

    ``spec``: the weight's fprop `QuantSpec` to all-gather FP8 codes under, or None to gather
    float32. Every op sees the plain tensor (``_tensor``); FSDP's padding ops keep the subclass.
    """

    _tensor: torch.Tensor
    spec: QuantSpec | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, spec: QuantSpec | None = None) -> ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad,
        )  # fmt: skip

    def __init__(self, tensor: torch.Tensor, spec: QuantSpec | None = None) -> None:
        self._tensor = tensor
        self.spec = spec

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"ShardedWeight({self._tensor!r}, spec={self.spec})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        spec: list[QuantSpec | None] = []

        def unwrap(t: ShardedWeight) -> torch.Tensor:
            spec.append(t.spec)
            return t._tensor

        if func is _aten.detach.default:
            return cls(args[0]._tensor.detach(), args[0].spec)
        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, spec[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self.spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):  # type: ignore[no-untyped-def]
        return ShardedWeight(inner["_tensor"], spec)

    # ---- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard)
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's all-gather inputs (each of the padded shard size when the weight is
        unevenly sharded, as FSDP requires) and the metadata `fsdp_post_all_gather` needs."""
        group, world = mesh.get_group(), mesh.size()
        full_rows = int(outer_size[0])
        rows = -(-full_rows // world)
        if self.spec is None:
            x = self._tensor.detach()
            pad = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
            pad[: x.shape[0]] = x
            return (pad,), (module, None, full_rows)
        spec, ds = _weight_quantization(module, self.spec)
        batch = getattr(module, "_fp8lab_weight_amaxes", None)
        known = None if batch is None else batch.get(module, self._tensor)
        local, q, codes, amax = _quantize_shard(self._tensor, spec, rows, group, known, ds)
        # what the Linear's fprop gets (a GatheredWeight: the spec and state its quantizer
        # has) and (delayed scaling) the state and this shard's amax it observes
        seen = None if amax is None else (ds, amax)
        spec = (spec, ds)
        if normalize_granularity(local.granularity) == (-1, -1):
            inv = (
                q.scales
                if q is not None
                else torch.reciprocal(torch.tensor(local.scaling, device=codes.device))
            )
            return (codes,), (module, local, full_rows, inv.reshape(1, 1).float(), spec, seen)
        if full_rows % world:  # FSDP wants every input of the padded shard size then
            raise ValueError(
                f"FP8 all-gather of {tuple(outer_size)} over {world} ranks: block scales "
                f"({local.granularity!r}) need evenly sharded weights (rows % world == 0)"
            )
        assert q is not None
        return (codes, q.scales.contiguous()), (module, local, full_rows, None, spec, seen)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The unsharded weight (float32) from the gathered codes; its QTensor goes to the
        Linear (`fp8lab.nn.Linear.use_gathered_weight`) for its fprop GEMM."""
        module, local, full_rows = metadata[:3]
        if local is None:
            dense = outputs[0][:full_rows]
            q = None
        else:
            # decode a copy: its kernel reads through .numpy(), which would make the storage of
            # FSDP's all-gather output non-resizable (FSDP frees it by resizing to 0)
            values = decode(outputs[0][:full_rows].clone(), get_format(local.format))
            scales = metadata[3] if metadata[3] is not None else outputs[1].clone()
            q = QTensor(values=values, scales=scales, spec=local)
            dense = q.dequantize()
        module.use_gathered_weight(
            None if q is None else GatheredWeight(metadata[4][0], q, metadata[4][1])
        )
        module._fp8lab_observe = None if q is None else metadata[5]
        # a tensor of its own, never FSDP's all-gather output (FSDP frees that by resizing it)
        dense = dense.clone() if q is None else dense
        if out is not None:  # later all-gathers: the same Parameter, pointed at the new tensor
            out.data = dense  # (its data was dropped when FSDP freed it: `_free_with_fsdp`)
            return None
        return dense, ()


def _free_with_fsdp(fsdp_param: Any) -> None:
    """Make FSDP's free of a `ShardedWeight` parameter's unsharded data (its reshard) also drop
    the unsharded tensor fp8lab gathered into (module doc): the unsharded Parameter's data
    becomes an empty tensor (the tensor dies with its last reference) and the Linear's gathered
    QTensor is dropped. Wraps ``FSDPParam.free_unsharded_param`` of this parameter."""
    orig = fsdp_param.free_unsharded_param
    module = fsdp_param._module_info.module

    def free_unsharded_param() -> None:
        orig()  # FSDP's all-gather outputs
        p = getattr(fsdp_param, "_unsharded_param", None)
        if p is not None and p.numel():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        module.use_gathered_weight(None)
        module._fp8lab_observe = None

    fsdp_param.free_unsharded_param = free_unsharded_param


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects ``fully_shard(module)`` made (FSDP2's internals: checked)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older layouts: one group
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    out = [fp for g in groups for fp in g.fsdp_params]
    for fp in out:
        if not (hasattr(fp, "free_unsharded_param") and hasattr(fp, "_module_info")):
            raise RuntimeError("this torch's FSDP2 has no FSDPParam.free_unsharded_param: "
                               "fp8lab cannot free gathered weights with it")  # fmt: skip
    return out


def _weight_quantization(module: Any, spec: QuantSpec) -> tuple[QuantSpec, DelayedScaling | None]:
    """The fprop weight quantization of the Linear: ``spec`` (the recipe's fprop weight spec)
    and, for delayed scaling, the Linear's own `DelayedScaling` of that operand, whose scale the
    shard is quantized with (the pair its fprop quantizer has: `GatheredWeight.serves`)."""
    if not spec.is_delayed:
        return spec, None
    recipe = module.recipe
    ds = module.scaling_states.get(state_key(recipe, "fprop", "weight"))
    cur = recipe.spec("fprop", "weight")
    if ds is None or cur is None or not cur.is_delayed:
        raise ValueError(
            f"--fp8-allgather: layer {module.name or '?'} was sharded with a delayed-scaled weight "
            f"but its recipe {recipe.name!r} now has {cur} (shard the model again)"
        )
    return cur, ds


def _attach_gathered(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of a Linear under FSDP: a delayed-scaled weight's state observes this
    rank's shard amax (once per forward, as the unsharded Linear observes the weight's amax
    when it quantizes it; a backward re-gather observes nothing, so an update between the
    forward and the backward does not see it)."""
    seen = getattr(module, "_fp8lab_observe", None)
    if seen is not None:
        seen[0].observe(seen[1])


def shard_model(
    model: torch.nn.Module, fp8_allgather: bool = False, mesh: Any = None,
    amax_group: str = "world",
) -> Any:  # fmt: skip
    """Shard ``model`` in place with FSDP2's ``fully_shard`` (each block of every ModuleList,
    then the root) over ``mesh`` (default: a 1-D CPU/CUDA mesh of the world); returns it.

    ``fp8_allgather``: every `fp8lab.nn.Linear` weight is all-gathered as FP8 codes under its
    fprop weight spec (module doc); a weight whose spec cannot be gathered that way raises
    ValueError naming the layer before anything is sharded. ``amax_group``: the delayed-scaling
    amax group the model trains with (`fp8lab.distributed.amax`); a delayed-scaled weight needs
    ``"world"`` (identical histories) to be gathered as FP8. Collective: call on every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from fp8lab.nn import Linear as Fp8Linear

    world = world_size()
    if mesh is None:
        # the mesh follows the model's device (a CPU model on a CUDA machine stays on gloo)
        param = next(model.parameters(), None)
        kind = "cpu" if param is None else param.device.type
        mesh = init_device_mesh(kind, (world,))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    specs: dict[str, QuantSpec | None] = {}
    for name, m in linears:
        spec = m.recipe.spec("fprop", "weight") if fp8_allgather else None
        if spec is not None and m.weight_layout != "out_in":
            raise ValueError(f"--fp8-allgather: {name} stores its weight [in, out] (a "
                             "transformers Conv1D); the FP8 all-gather shards [out, in] rows")  # fmt: skip
        if spec is not None:
            if get_format(spec.format).bits > 8:
                raise ValueError(f"--fp8-allgather: {name} has a {spec.format} weight, not 8-bit")
            if spec.is_delayed:
                _check_delayed_gather(spec, amax_group, f"layer {name}")
            try:
                check_shardable(spec, tuple(m.weight.shape), world)
            except ValueError as exc:
                raise ValueError(f"--fp8-allgather: layer {name}: {exc}") from None
        specs[name] = spec
    for name, m in linears:
        w = m.weight
        m.weight = torch.nn.Parameter(
            ShardedWeight(w.detach(), specs[name]), requires_grad=w.requires_grad
        )
        m.register_forward_pre_hook(_attach_gathered)
    for sub in model.modules():
        if isinstance(sub, torch.nn.ModuleList):
            for block in sub:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    per_tensor = []  # current-scaled per-tensor weights: their amaxes in one all-reduce
    for sub in model.modules():  # FSDP's reshard also frees what fp8lab gathered into
        if isinstance(sub, FSDPModule):
            for fp in _fsdp_params(sub):
                m = fp._module_info.module
                if isinstance(m, Fp8Linear) and fp._module_info.param_name == "weight":
                    _free_with_fsdp(fp)
                    spec = specs.get(_name_of(linears, m))
                    if (spec is not None and not spec.is_delayed
                            and normalize_granularity(spec.granularity) == (-1, -1)):  # fmt: skip
                        per_tensor.append((m, fp))
    if per_tensor:
        batch = _WeightAmaxes(per_tensor, mesh.get_group())
        for m, _ in per_tensor:
            m._fp8lab_weight_amaxes = batch
        # before FSDP's root pre-forward hook (registered by fully_shard), which gathers
        model.register_forward_pre_hook(batch.refresh, prepend=True)
    return model


def _name_of(linears: list[tuple[str, Any]], module: Any) -> str | None:
    return next((n for n, m in linears if m is module), None)


def local_weight(p: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a (DTensor of a) `ShardedWeight`, else ``p``."""
    t = getattr(p, "_local_tensor", p)
    return t._tensor if isinstance(t, ShardedWeight) else t
