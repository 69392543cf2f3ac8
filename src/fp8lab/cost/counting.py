"""Exact per-step counts of one Linear layer's low-precision work, from fp8lab's own execution.

`count_linear_step` runs one forward + backward of an `fp8lab.nn.Linear` under a recipe on a small
proxy problem and records what the autograd Function did to each operand of each GEMM, through
the operand collection hook (`fp8lab.nn.collect_operands`: one call per operand the Function
prepares or takes from the forward) and the re-tiling counter (`fp8lab.qtensor.retile_counts`,
checked against the count). Each observed operand is classified by the module's frozen
`LinearPlan` (the decisions the Function follows) into `Event`s:

* ``round``: the operand is rounded to a GEMM's high precision (bf16/fp16 GEMMs, or a single
  high-precision cell); such a cell is also quantized under its nominal spec when a later GEMM
  takes its operand from it (the plan's ``shadow``: amax/cast events as for any quantization);
* ``amax``: a separate pass over the high-precision tensor for its amax (current per-tensor
  scaling; NVFP4's tensor-level amax). Block scales, and delayed scaling (the amax is taken by
  the cast kernel itself, Transformer Engine's ``atomicMax``), need no separate pass;
* ``cast``: quantization of the high-precision tensor (values + scales written);
* ``transpose``: a quantized operand reused as is by a GEMM that reduces it along its other axis
  (Hopper's FP8 tensor cores take K-major operands only: a physical transposed copy);
* ``retile_from_quantized``: re-tiling from the quantized values (DeepSeek-V3 §3.3);
* ``retile_from_source``: the same tensor quantized again into the other tiles from high
  precision (Transformer Engine's MXFP8/NVFP4 rowwise and columnwise copies);
* ``scale_update``: a delayed-scaling amax-history/scale update (per tensor and step).

GEMMs are recorded with their operand formats, accumulator and promotion FMAs (the FP32
promotions of the tensor-core partial sums every ``promote_every`` elements along K, DeepSeek-V3's
N_C = 128: ``M * N * ceil(K / N_C)``).

Counts are symbolic in the Linear's dimensions (tokens ``T``, ``in`` ``I``, ``out`` ``O``):
`StepCounts.scaled` gives them for any shape. Bytes are priced by `fp8lab.cost.model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe, get_recipe

__all__ = [
    "EVENT_KINDS",
    "ROLE_DIMS",
    "Event",
    "GemmEvent",
    "StepCounts",
    "count_linear_step",
    "scale_bytes",
]

EVENT_KINDS = (
    "round",
    "amax",
    "cast",
    "transpose",
    "retile_from_quantized",
    "retile_from_source",
    "scale_update",
)

#: tensor role -> its natural-layout dims, in the symbols T (tokens), I (in), O (out)
ROLE_DIMS = {"input": ("T", "I"), "weight": ("O", "I"), "grad_output": ("T", "O")}

#: the GEMMs' (M, K, N) in the symbols: fprop y = x W^T, dgrad dx = dy W, wgrad dW^T = x^T dy
GEMM_DIMS = {"fprop": ("T", "I", "O"), "dgrad": ("T", "O", "I"), "wgrad": ("I", "T", "O")}

#: (A, B) operand roles of each GEMM in the (M, K, N) orientation of `GEMM_DIMS`
GEMM_AB = {
    "fprop": ("input", "weight"),
    "dgrad": ("grad_output", "weight"),
    "wgrad": ("input", "grad_output"),
}

#: proxy dimensions of the counted step: distinct, multiples of 128 (every block size divides)
PROXY = {"T": 384, "I": 256, "O": 640}


@dataclass(frozen=True)
class Event:
    """One pass over one tensor. ``fmt``: the element format written (``cast``/``retile_*``/
    ``transpose``) or rounded to (``round``), None for ``amax``/``scale_update``;
    ``granularity``/``scaling``: the spec's block in the tensor's natural layout and its rule
    (``max``, ``mx_rceil``, ``delayed``, ...; None for ``round``); ``dims``: the tensor's dims in
    the symbols T/I/O (natural layout). The spec's extra per-element work, for pricing:
    ``rht`` (TE's 16-point random Hadamard transform before the cast), ``hadamard`` (a
    Hadamard transform over blocks of that many elements, Quartet's), ``four_over_six`` (the
    4over6 candidate-scale choice, ``"mae"``/``"mse"``); defaults: none."""

    kind: str
    role: str
    gemm: str
    fmt: str | None
    granularity: tuple[int, int] | None
    scaling: str | None
    dims: tuple[str, str]
    rht: bool = False
    hadamard: int | None = None
    four_over_six: str | None = None


@dataclass(frozen=True)
class GemmEvent:
    """One GEMM: ``m, k, n`` for the counted shape, operand formats (``bf16``/``fp16``/``fp32``
    for high-precision GEMMs), block granularities (natural layout of each operand: A is
    `GEMM_AB`'s first role, B its second) and rules, the promotion
    interval (None: never promoted into FP32 by software) and the promotion FMAs."""

    gemm: str
    m: int
    k: int
    n: int
    fmt_a: str
    fmt_b: str
    gran_a: tuple[int, int] | None
    gran_b: tuple[int, int] | None
    scaling_a: str | None
    scaling_b: str | None
    promote_every: int | None

    def natural_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of A and B as stored (natural layout, the layout their blocks refer to)."""
        d = dict(zip(GEMM_DIMS[self.gemm], (self.m, self.k, self.n), strict=True))
        a, b = GEMM_AB[self.gemm]
        return (
            (d[ROLE_DIMS[a][0]], d[ROLE_DIMS[a][1]]),
            (d[ROLE_DIMS[b][0]], d[ROLE_DIMS[b][1]]),
        )

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def promotion_fmas(self) -> int:
        if self.promote_every is None:
            return 0
        return self.m * self.n * math.ceil(self.k / self.promote_every)


@dataclass
class StepCounts:
    """Every pass and GEMM of one Linear step (forward + backward) under ``recipe``, for the
    dims ``{"T": tokens, "I": in_features, "O": out_features}``."""

    recipe: str
    dims: dict[str, int]
    events: list[Event] = field(default_factory=list)
    gemms: list[GemmEvent] = field(default_factory=list)
    retiles: dict[str, int] = field(default_factory=dict)

    def shape(self, e: Event) -> tuple[int, int]:
        """The tensor's shape (natural layout) for these dims."""
        return (self.dims[e.dims[0]], self.dims[e.dims[1]])

    def elements(self, e: Event) -> int:
        r, c = self.shape(e)
        return r * c

    def count(self, kind: str, role: str | None = None) -> int:
        """Number of events of ``kind`` (for ``role`` only when given)."""
        return sum(1 for e in self.events if e.kind == kind and (role is None or e.role == role))

    def scaled(self, T: int, I: int, O: int) -> StepCounts:  # noqa: E741
        """The same step for a Linear ``I -> O`` on ``T`` tokens (counts are symbolic)."""
        dims = {"T": T, "I": I, "O": O}
        gemms = []
        for g in self.gemms:
            m, k, n = (dims[s] for s in GEMM_DIMS[g.gemm])
            gemms.append(replace(g, m=m, k=k, n=n))
        return StepCounts(self.recipe, dims, list(self.events), gemms, dict(self.retiles))

    def select(self, keep: list[tuple[str, str]], gemms: tuple[str, ...]) -> StepCounts:
        """Only the events of the listed (gemm, role) pairs and the listed GEMMs."""
        events = [e for e in self.events if (e.gemm, e.role) in keep]
        kept = [g for g in self.gemms if g.gemm in gemms]
        return StepCounts(self.recipe, dict(self.dims), events, kept, dict(self.retiles))

    def scale_bytes(self) -> int:
        """Bytes of the block scales written in the step (see `scale_bytes`)."""
        return sum(
            scale_bytes(e.granularity, e.scaling, self.shape(e))
            for e in self.events
            if e.kind in WRITES_SCALES
        )

    def promotion_fmas(self) -> int:
        return sum(g.promotion_fmas for g in self.gemms)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: passes by kind, by tensor, scale bytes, promotion FMAs, GEMMs."""
        return {
            "recipe": self.recipe,
            "dims": dict(self.dims),
            "passes": {k: self.count(k) for k in EVENT_KINDS},
            "by_tensor": {
                r: {k: self.count(k, r) for k in EVENT_KINDS if self.count(k, r)} for r in ROLE_DIMS
            },
            "scale_bytes": self.scale_bytes(),
            "promotion_fmas": self.promotion_fmas(),
            "gemms": [
                {"gemm": g.gemm, "m": g.m, "k": g.k, "n": g.n, "a": g.fmt_a, "b": g.fmt_b}
                for g in self.gemms
            ],
        }


#: the passes that write quantized values and their scales
WRITES_SCALES = ("cast", "retile_from_quantized", "retile_from_source")


def _blocks(gran: tuple[int, int], shape: tuple[int, int]) -> int:
    r, c = shape
    m, k = gran
    m = r if m == -1 else m
    k = c if k == -1 else k
    return max(-(-r // max(m, 1)), 1) * max(-(-c // max(k, 1)), 1)


def scale_bytes(gran: tuple[int, int] | None, scaling: str | None, shape: tuple[int, int]) -> int:
    """Bytes of the scales of one quantized tensor of ``shape``: E8M0 (1 byte) per MX block,
    E4M3 (1 byte) per NVFP4 block plus the FP32 tensor scale, FP32 (4 bytes) per block
    otherwise (per-tensor: one FP32 ``scale_inv``)."""
    if gran is None:
        return 0
    n = _blocks(gran, shape)
    if scaling is not None and scaling.startswith("mx"):
        return n
    if scaling == "nvfp4":
        return n + 4
    return 4 * n


# --------------------------------------------------------------------------- the counted run
def _spec_info(spec: Any) -> tuple[str, tuple[int, int], str]:
    sc = spec.scaling
    rule = "delayed" if spec.is_delayed else ("fixed" if isinstance(sc, float) else str(sc))
    return spec.format, spec.block, rule


def _needs_amax_pass(spec: Any) -> bool:
    """A separate read of the tensor for its amax: current scaling whose block spans a whole
    axis (per tensor, row or column: the cast cannot start before the amax is known), or NVFP4's
    tensor-level amax (unless a static ``tensor_scale`` is given). Block amaxes are taken in
    registers by the cast kernel; delayed scaling records the amax inside the cast."""
    if spec.is_delayed or isinstance(spec.scaling, float):
        return False
    if spec.scaling == "nvfp4":
        return spec.two_level and getattr(spec, "tensor_scale", None) is None
    return -1 in spec.block


def _classify(plan: Any, gemm: str, role: str, earlier: Any) -> list[tuple[str, Any]]:
    """(kind, spec-or-precision) events of one observed operand under its `OperandPlan`."""
    from fp8lab.nn.plan import Reuse

    op = plan_operand(plan, gemm, role)
    if op.high_precision is not None:
        hp: list[tuple[str, Any]] = []
        if not (op.reuse is Reuse.SAME or op.high_precision == "fp32"):
            hp.append(("round", op.high_precision))
        shadow = getattr(op, "shadow", None)
        if shadow is not None:  # a high-precision cell still quantized for a later GEMM
            hp += _quantize(shadow, earlier)
        return hp
    if op.spec is None:
        return []
    if op.reuse is Reuse.SAME:
        if earlier is not None and earlier.first_axis != op.first_axis:
            return [("transpose", op.spec)]
        return []
    if op.reuse is Reuse.RETILE:
        return [("retile_from_quantized", op.spec)]
    return _quantize(op.spec, earlier)


def _quantize(spec: Any, earlier: Any) -> list[tuple[str, Any]]:
    """A quantization from high precision: its amax pass if it needs one, then a cast (or, when
    the earlier GEMM quantized the same tensor, a second tiling from the source)."""
    quantized_before = earlier is not None and earlier.quantized
    events: list[tuple[str, Any]] = []
    if _needs_amax_pass(spec):
        events.append(("amax", spec))
    events.append(("retile_from_source" if quantized_before else "cast", spec))
    return events


def plan_operand(plan: Any, gemm: str, role: str) -> Any:
    """The `OperandPlan` of ``role`` in ``gemm``."""
    return getattr(plan, gemm)[role]


def count_linear_step(recipe: Recipe | str, dims: dict[str, int] | None = None) -> StepCounts:
    """Run one forward + backward of an `fp8lab.nn.Linear` under ``recipe`` on the proxy shape
    (``dims``, default `PROXY`: T=384, I=256, O=640) and return its `StepCounts`.

    The operands the autograd Function prepares are observed through the operand collection
    hook (in the order it prepares them); each is classified by the module's `LinearPlan`; the
    number of re-tilings from quantized values is checked against
    `fp8lab.qtensor.retile_counts` (RuntimeError if execution and classification disagree).
    """
    import torch

    from fp8lab.nn import Linear, collect_operands
    from fp8lab.nn.plan import build_plan
    from fp8lab.nn.state import ScalingState
    from fp8lab.qtensor import retile_counts

    rec = get_recipe(recipe)
    d = dict(PROXY if dims is None else dims)
    gen = torch.Generator().manual_seed(0)
    lin = Linear(d["I"], d["O"], bias=False, recipe=rec, name="counted")
    _local_updates(lin)
    x = torch.randn(d["T"], d["I"], generator=gen).requires_grad_(True)
    before = retile_counts()
    # the record is a dict: its insertion order is the order the Function prepared operands
    with collect_operands(lin, fn=lambda hp, used: tuple(hp.shape)) as record:
        lin(x).backward(torch.randn(d["T"], d["O"], generator=gen))
    after = retile_counts()
    seen = [(gemm, role, shape) for (_, gemm, role), shape in record.items()]
    plan = build_plan(rec, ScalingState(rec), "counted")
    counts = _build_counts(rec, plan, d, seen)
    counts.retiles = {k: after[k] - before[k] for k in after}
    expected = counts.count("retile_from_quantized")
    if counts.retiles.get("from_quantized", 0) != expected:
        raise RuntimeError(
            f"{rec.name}: {counts.retiles.get('from_quantized')} re-tilings from quantized "
            f"values ran, {expected} classified"
        )
    return counts


class _LocalUpdate:
    """A delayed-scaling state's ``group`` for the counted step: the update uses the local amax
    and never a collective (`DelayedScaling.update` defers to a group with ``defer_update``), so
    counting (a cost estimate on one rank of a distributed job) cannot wait on other ranks."""

    def defer_update(self, ds: Any, fmt: Any) -> None:
        ds.update(fmt, reduced=ds.state.amax_history[0].clone())


def _local_updates(module: Any) -> None:
    from fp8lab.nn.state import delayed_states

    for ds in delayed_states(module).values():
        ds.state.group = _LocalUpdate()


def _event(kind: str, what: Any, op: Any, gemm: str, role: str) -> Event:
    dims = ROLE_DIMS[role]
    if kind == "round":
        return Event(kind, role, gemm, what, None, None, dims)
    fmt, block, rule = _spec_info(what)
    if op.first_axis:  # the spec is in GEMM orientation: its block in the natural layout
        block = (block[1], block[0])
    extra = {
        "rht": bool(getattr(what, "rht", False)),
        "hadamard": getattr(what, "hadamard", None),
        "four_over_six": getattr(what, "four_over_six", None),
    }
    return Event(kind, role, gemm, None if kind == "amax" else fmt, block, rule, dims, **extra)


def _build_counts(rec: Recipe, plan: Any, d: dict[str, int], seen: list) -> StepCounts:
    from fp8lab.nn.plan import CHAINS

    # the earlier GEMM a later (GEMM, role) takes its operand from
    earlier_of = {(dst, role): src for src, dst, role in CHAINS}
    counts = StepCounts(rec.name, d)
    for gemm, role, shape in seen:
        dims = ROLE_DIMS[role]
        if tuple(shape) != (d[dims[0]], d[dims[1]]):
            raise RuntimeError(f"{gemm}/{role}: observed shape {shape}, expected {dims}")
        earlier_gemm = earlier_of.get((gemm, role))
        earlier = plan_operand(plan, earlier_gemm, role) if earlier_gemm else None
        op = plan_operand(plan, gemm, role)
        for kind, what in _classify(plan, gemm, role, earlier):
            counts.events.append(_event(kind, what, op, gemm, role))
    if len(seen) != 6:
        raise RuntimeError(f"{rec.name}: observed {len(seen)} operands, expected 6")
    for role in ROLE_DIMS:  # one amax-history update per delayed-scaled tensor and step
        specs = [plan_operand(plan, g, role).spec for g in GEMMS if _has(g, role)]
        if any(s is not None and s.is_delayed for s in specs):
            counts.events.append(
                Event("scale_update", role, "", None, None, "delayed", ROLE_DIMS[role])
            )
    counts.gemms = [_gemm_event(plan, g, d) for g in GEMMS]
    return counts


def _has(gemm: str, role: str) -> bool:
    return role in (r for r, _ in GEMM_OPERANDS[gemm])


def _gemm_event(plan: Any, g: str, d: dict[str, int]) -> GemmEvent:
    gp = getattr(plan, g)
    a_role, b_role = GEMM_AB[g]
    info = []
    for role in (a_role, b_role):
        op = gp[role]
        if op.high_precision is not None:
            info.append((op.high_precision, None, None))
        elif op.spec is None:
            info.append(("fp32", None, None))
        else:
            fmt, block, rule = _spec_info(op.spec)
            info.append((fmt, block, rule))
    m, k, n = (d[s] for s in GEMM_DIMS[g])
    acc = gp.accumulator
    quantized = info[0][1] is not None and info[1][1] is not None
    promote = acc.promote_every if quantized else None
    return GemmEvent(
        g, m, k, n, info[0][0], info[1][0], info[0][1], info[1][1], info[0][2], info[1][2], promote
    )
