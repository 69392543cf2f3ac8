"""`fp8lab.nn.Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run under a recipe.

The whole layer in one file, read top to bottom: the operands (`Operand`, how one is prepared,
kept for the backward and reused or re-tiled), the autograd Function with its three GEMMs, then
the module. Below it: `fp8lab.qtensor.Quantizer` (one per operand: spec, kernels, delayed-scaling
state) and `fp8lab.gemm.matmul` (the accumulator models). The recipe is resolved once per module
and recipe into a `fp8lab.nn.plan.LinearPlan`; nothing is looked up per call.

::

    fprop  y  = Q(x) · Q(W)ᵀ      x [T, I] reduced over I,  W [O, I] reduced over I
    dgrad  dx = Q(dy) · Q(W)      dy [T, O] reduced over O, W reduced over O (first axis)
    wgrad  dW = (Q(x)ᵀ · Q(dy))ᵀ  x and dy reduced over T (first axis)

These are the three GEMMs NVIDIA's developer blog "探索 FP8 训练中 Debug 思路与技巧" bisects one
by one. With no quantized pair a GEMM is one fp32 ``addmm``, so the ``fp32`` recipe is torch's own
linear bit for bit.

Under ``torch.autocast`` (e.g. ``torch.autocast("cpu", dtype=torch.bfloat16)``) the layer does
what Transformer Engine does: the input (and the bias) are cast to the autocast dtype before
quantization, the GEMMs run as emulated (fp32 accumulation of the recipe's operands) and the
output is returned in the autocast dtype; the weight is quantized from its own dtype (the fp32
master weight). ``torch.compile`` treats the layer as opaque (a deliberate graph break: dynamo
cannot trace the numba kernels), so compiled models run it eagerly and compile around it.

Operand observers (`on_operand`): ``fn(layer, gemm, role, source, used)`` for every operand of
every GEMM while registered (``used`` is the QTensor itself when quantized); nothing is paid when
none is registered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint

import fp8lab.nn.context as _context
from fp8lab.gemm.accumulator import Accumulator
from fp8lab.gemm.matmul import matmul
from fp8lab.nn._kernels import round_bf16
from fp8lab.nn.plan import LinearPlan, OperandPlan, Reuse, build_plan
from fp8lab.nn.state import ScalingState
from fp8lab.qtensor import QTensor, QuantSpec
from fp8lab.qtensor.quantizer import POOL, Quantizer
from fp8lab.recipe import Recipe, get_recipe
from fp8lab.scaling.delayed import DelayedScaling, amax_reduction_installed

__all__ = [
    "GatheredWeight",
    "Linear",
    "Operand",
    "OperandHandle",
    "from_forward",
    "gemm",
    "keep_for_backward",
    "linear",
    "on_operand",
    "prepare",
    "round_high_precision",
]

_RECIPE_KEY = "fp8_recipe"
_HP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

OperandObserver = Callable[[str, str, str, torch.Tensor, Any], None]


# =========================================================================== operand observers
class _Observers(threading.local):
    def __init__(self) -> None:
        self.active: list[OperandObserver] = []


_OBSERVERS = _Observers()


class OperandHandle:
    """What `on_operand` returns: ``remove()`` unregisters the observer (idempotent); also a
    context manager that removes it on exit."""

    def __init__(self, fn: OperandObserver) -> None:
        self.fn = fn

    def remove(self) -> None:
        active = _OBSERVERS.active
        if any(f is self.fn for f in active):
            active[:] = [f for f in active if f is not self.fn]

    def __enter__(self) -> OperandHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def on_operand(fn: OperandObserver) -> OperandHandle:
    """Call ``fn(layer, gemm, role, source, used)`` for every GEMM operand of every converted
    Linear on this thread until ``handle.remove()``: ``layer`` the module's name (``"?"`` if
    unnamed), ``gemm`` in fprop/dgrad/wgrad, ``role`` in input/weight/grad_output (FP8 attention,
    `fp8lab.nn.DotProductAttention`: ``gemm`` ``"dpa"``, ``role`` one of TE's Q, K, V, S, O, dO,
    dP, dQKV), ``source``
    the high-precision operand (natural layout), ``used`` what the GEMM consumed (a `QTensor`
    when quantized: read its values and scales instead of quantizing again; else a float32
    tensor). While any observer is registered, operands are freshly allocated (observers may
    keep them)."""
    if not callable(fn):
        raise TypeError(f"on_operand expects a callable, got {type(fn).__name__}")
    _OBSERVERS.active.append(fn)
    return OperandHandle(fn)


def _notify(op: OperandPlan, source: torch.Tensor, used: torch.Tensor | QTensor) -> None:
    for fn in list(_OBSERVERS.active):
        fn(op.layer or "?", op.gemm, op.role, source, used)


# =========================================================================== operands
def round_high_precision(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` rounded to ``precision`` (``fp32``: returned as is), as a float32 tensor.

    Round-to-nearest-even, overflowing to inf like real bf16/fp16 arithmetic, NaN kept: bf16 by a
    one-pass bit kernel (`fp8lab.nn._kernels.round_bf16`), fp16 through torch's conversion.
    """
    if precision == "fp32":
        return x
    if precision == "bf16" and x.dtype == torch.float32:
        return round_bf16(x)
    return x.to(_HP_DTYPES[precision]).to(torch.float32)


@dataclass(frozen=True, slots=True)
class Operand:
    """One GEMM operand: ``used``, what the GEMM consumes (a float32 tensor, possibly rounded to
    bf16/fp16, or a `QTensor`; None when only the source is kept), and ``source``, the
    high-precision tensor it was made from (natural layout; None once no longer needed).
    ``shadow``: a high-precision cell's nominal quantization, kept for a later GEMM
    (`fp8lab.nn.plan.OperandPlan.shadow`)."""

    used: torch.Tensor | QTensor | None
    source: torch.Tensor | None = None
    shadow: QTensor | None = None

    def dense(self) -> torch.Tensor:
        """The float32 tensor the operand stands for: the QTensor's memoised dequantized copy
        (written in the quantization pass where a GEMM needs it; shared with ``t()``)."""
        u = self.used
        return u.dequantize() if isinstance(u, QTensor) else u  # type: ignore[return-value]

    def t(self, spec: QuantSpec | None = None) -> Operand:
        """The transposed operand (2-D); ``spec``: the transposed spec of a quantized one, when
        the caller has it (`Quantizer.transposed`)."""
        u, s = self.used, self.source
        return Operand(
            None if u is None else (u.t(spec) if isinstance(u, QTensor) else u.t()),
            None if s is None else s.t(),
        )


@dataclass(frozen=True, slots=True)
class GatheredWeight:
    """A weight FSDP all-gathered as FP8 codes (`fp8lab.distributed.fsdp`), handed to the Linear's
    forward with `Linear.use_gathered_weight`: ``qtensor`` quantized under ``spec`` with the
    scale of ``delayed`` (the Linear's own state of the fprop weight; None: not delayed). The
    fprop GEMM uses it when its weight quantizer has that spec and that state."""

    spec: QuantSpec
    qtensor: QTensor
    delayed: DelayedScaling | None = None

    def serves(self, q: Quantizer) -> bool:
        return self.spec == q.spec and self.delayed is q.delayed


def _quantize(
    x: torch.Tensor,
    q: Quantizer,
    held: list[torch.Tensor] | None,
    want_dense: bool,
    retile_from: QTensor | None = None,
) -> QTensor:
    """``x`` quantized by ``q`` (or ``retile_from``, whose dequantized tensor ``x`` is, re-tiled
    into ``q``'s blocks) into pooled buffers when ``held`` is given; with ``want_dense`` the
    dequantized copy is written in the same pass (the QTensor's memoised `QTensor.dequantize`)."""
    x = x if x.is_contiguous() else x.contiguous()
    if held is None:
        out = deq = None
    else:
        out = POOL.take(tuple(x.shape), held, x.device)
        deq = POOL.take(tuple(x.shape), held, x.device) if want_dense else None
    if retile_from is None:
        return q.quantize(x, out, deq)
    return q.retile(retile_from, x, out, deq)


def _wants_dense(op: OperandPlan, q: Quantizer, shape: tuple[int, int]) -> bool:
    # = OperandPlan.wants_dense, inline: re-tiling's input, or fp32 accumulation over K-varying
    # scales (that GEMM multiplies the dequantized operands)
    return op.retile_source or (
        op.fp32_accumulate and q.varies_along(shape, 0 if op.first_axis else 1)
    )


def prepare(
    x: torch.Tensor,
    op: OperandPlan,
    held: list[torch.Tensor] | None,
    gathered: GatheredWeight | None = None,
) -> Operand:
    """The operand ``op`` made from the float32 2-D tensor ``x`` (natural layout): rounded to
    the GEMM's high precision, quantized by ``op.quantizer``, or ``x`` itself. ``gathered``: a
    weight FSDP gathered already quantized (used when it serves this quantizer).

    ``held``: take buffers from the pool and append them to this list (the caller returns them
    once the operand is dead); ``None`` allocates (also while operands are observed)."""
    observed = bool(_OBSERVERS.active)
    if observed:
        held = None
    hp = op.high_precision
    q = op.quantizer
    if hp == "bf16" and x.dtype == torch.float32 and held is not None:
        used: torch.Tensor | QTensor = round_bf16(
            x.contiguous(), out=POOL.take(tuple(x.shape), held, x.device)
        )
    elif hp is not None:
        used = round_high_precision(x, hp)
    elif q is None:
        used = x
    elif gathered is not None and gathered.serves(q):
        used = gathered.qtensor
    else:
        used = _quantize(x, q, held, _wants_dense(op, q, x.shape))
    shadow = None
    if op.shadow_quantizer is not None:  # the later GEMM's operand: as if not switched
        shadow = _quantize(x, op.shadow_quantizer, held, want_dense=True)
    operand = Operand(used, x, shadow)
    if observed:
        _notify(op, x, used)
    return operand


def keep_for_backward(operand: Operand, later: OperandPlan) -> Operand:
    """What the forward keeps of ``operand`` for the backward GEMM ``later``: the operand when
    ``later`` reuses, re-tiles or dequantizes it, else only its fp32 source (the source is also
    kept while operands are observed, to report it)."""
    if later.reuse is Reuse.SOURCE:
        return Operand(None, operand.source)
    src = operand.source if _OBSERVERS.active else None
    return Operand(operand.used if operand.shadow is None else operand.shadow, src)


def from_forward(kept: Operand, op: OperandPlan, held: list[torch.Tensor] | None = None) -> Operand:
    """The operand ``op`` of a backward GEMM from what `keep_for_backward` kept (new buffers
    from the pool when ``held`` is given, see `prepare`)."""
    if op.reuse is Reuse.SOURCE:
        return prepare(kept.source, op, held)  # type: ignore[arg-type]
    observed = bool(_OBSERVERS.active)
    if observed:
        held = None
    operand = kept
    if op.reuse is Reuse.RETILE:
        q: QTensor = kept.used  # type: ignore[assignment]
        quantizer: Quantizer = op.quantizer  # type: ignore[assignment]
        want = _wants_dense(op, quantizer, q.shape)
        # a delayed (per-tensor) target quantizes the dequantized values afresh (its state
        # observes them); block targets re-tile the quantized tensor
        retile_from = None if quantizer.delayed is not None else q
        q2 = _quantize(kept.dense(), quantizer, held, want, retile_from=retile_from)
        operand = Operand(q2, kept.source)
    elif op.reuse is Reuse.DEQUANTIZE:  # the saved copy's values, rounded to the GEMM's
        # precision when it runs in one (fp32: as they are)
        operand = Operand(round_high_precision(kept.dense(), op.high_precision), kept.source)  # type: ignore[arg-type]
    if observed:
        _notify(op, kept.source if kept.source is not None else kept.dense(), operand.used)  # type: ignore[arg-type]
    return operand


def gemm(
    acc: Accumulator, a: Operand, b: Operand, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b (+ bias)``; a: [M, K], b: [K, N]. Two quantized operands go through
    `fp8lab.gemm.matmul.matmul` under ``acc`` (resolved for their formats; scales and bias in
    its epilogue); otherwise one fp32 ``addmm``/``mm`` of the dense operands (torch's own linear
    for the ``fp32`` recipe)."""
    qa, qb = a.used, b.used
    if isinstance(qa, QTensor) and isinstance(qb, QTensor):
        return matmul(qa, qb, acc, bias)
    if bias is not None:
        return torch.addmm(bias, a.dense(), b.dense())
    return a.dense() @ b.dense()


def _t_spec(op: OperandPlan) -> QuantSpec | None:
    return None if op.quantizer is None else op.quantizer.transposed().spec


# =========================================================================== the three GEMMs
def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    # low-precision tensors (model.to(bfloat16)) are computed on in float32; autograd casts the
    # float32 gradients back to the inputs' dtypes
    return t if t is None or t.dtype == torch.float32 else t.float()


_OPERAND_FIELDS = tuple(f.name for f in dataclasses.fields(Operand))


def _save_kept(ctx: Any, *kept: Operand | None) -> None:
    """Keep ``kept`` for the backward through ``ctx.save_for_backward``: every tensor, a
    QTensor's too (`QTensor.to_tensors`), is a saved tensor, so saved-tensor hooks see them and
    activation checkpointing frees them; ctx holds only the plain data to rebuild them."""
    tensors: list[torch.Tensor | None] = []
    layout: list[list[tuple[int, Any]] | None] = []
    for op in kept:
        if op is None:
            layout.append(None)
            continue
        fields: list[tuple[int, Any]] = []
        for name in _OPERAND_FIELDS:
            v = getattr(op, name)
            if isinstance(v, QTensor):
                ts, rest = v.to_tensors()
                fields.append((len(tensors), (len(ts), rest)))
                tensors.extend(ts)
            elif v is None or isinstance(v, torch.Tensor):
                fields.append((len(tensors), None))
                tensors.append(v)
            else:  # plain data
                fields.append((-1, v))
        layout.append(fields)
    ctx.save_for_backward(*tensors)
    ctx.kept_layout = layout


def _saved_kept(ctx: Any) -> list[Operand | None]:
    """The operands `_save_kept` kept, rebuilt from ``ctx.saved_tensors``."""
    saved = ctx.saved_tensors
    out: list[Operand | None] = []
    for fields in ctx.kept_layout:
        if fields is None:
            out.append(None)
            continue
        values = []
        for i, how in fields:
            if i < 0:
                values.append(how)
            elif how is None:
                values.append(saved[i])
            else:
                n, rest = how
                values.append(QTensor.from_tensors(saved[i : i + n], rest))
        out.append(Operand(*values))
    return out


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, state: ScalingState | None, keep: bool,
                gathered: GatheredWeight | None = None):  # type: ignore[override]  # fmt: skip
        if not torch.is_autocast_enabled(x.device.type):  # (entering autocast costs ~6 us)
            return _LinearFunction._forward(ctx, x, weight, bias, plan, state, keep, gathered)
        with torch.autocast(x.device.type, enabled=False):
            return _LinearFunction._forward(ctx, x, weight, bias, plan, state, keep, gathered)

    @staticmethod
    def _forward(ctx, x, weight, bias, plan, state, keep, gathered):
        x2 = _float32(x.reshape(-1, x.shape[-1]))
        weight, bias = _float32(weight), _float32(bias)
        # pooled buffers of the forward's operands; none under saved-tensor hooks (activation
        # checkpointing, offload): the hooks decide how long the kept tensors live
        held: list[torch.Tensor] | None = None if _saved_tensor_hooks() else []

        # ---- fprop: y = Q(x) · Q(W)ᵀ (+ b)
        fprop = plan.fprop
        x_op = prepare(x2, fprop.operands[0], held)
        w_op = prepare(weight, fprop.operands[1], held, gathered)
        y = gemm(fprop.accumulator, x_op, w_op.t(_t_spec(fprop.operands[1])), bias)

        ctx.plan, ctx.state = plan, state
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        if keep:  # every kept tensor is a saved tensor; pooled buffers live until backward ends
            _save_kept(
                ctx,
                keep_for_backward(w_op, plan.dgrad.operands[1]),
                keep_for_backward(x_op, plan.wgrad.operands[1]),
            )
            ctx.held = held or []
        else:  # no backward will run: the operands die here
            x_op = w_op = None
            POOL.give(held or [])
            ctx.held = []
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if x.dtype == torch.float32 else y.to(x.dtype)  # drop-in: output in x's dtype

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        if not torch.is_autocast_enabled(dy.device.type):
            return _LinearFunction._backward(ctx, dy)
        with torch.autocast(dy.device.type, enabled=False):
            return _LinearFunction._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        plan: LinearPlan = ctx.plan
        ctx.w_kept, ctx.x_kept = _saved_kept(ctx)
        dy2 = _float32(dy.reshape(-1, dy.shape[-1]))
        dx = dw = db = None
        dy_op: Operand | None = None
        held: list[torch.Tensor] = []  # pooled buffers of the backward's operands

        # ---- dgrad: dx = Q(dy) · Q(W)
        if ctx.needs_input_grad[0]:
            dgrad = plan.dgrad
            dy_op = prepare(dy2, dgrad.operands[0], held)
            w_op = from_forward(ctx.w_kept, dgrad.operands[1], held)
            dx = gemm(dgrad.accumulator, dy_op, w_op).reshape(ctx.x_shape)
            dx = dx if ctx.x_dtype == torch.float32 else dx.to(ctx.x_dtype)
            w_op = None

        # ---- wgrad: dW = (Q(x)ᵀ · Q(dy))ᵀ, the product and layout of torch's linear backward
        if ctx.needs_input_grad[1]:
            wgrad = plan.wgrad
            g_plan, x_plan = wgrad.operands  # GEMM_OPERANDS order: (grad_output, input)
            if dy_op is not None:
                dy_w = from_forward(keep_for_backward(dy_op, g_plan), g_plan, held)
            else:
                dy_w = prepare(dy2, g_plan, held)
            x_op = from_forward(ctx.x_kept, x_plan, held)
            dw = gemm(wgrad.accumulator, x_op.t(_t_spec(x_plan)), dy_w).t()
            x_op = dy_w = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)

        # every operand is dead now (outputs and gradients are fresh tensors): recycle buffers
        dy_op = ctx.w_kept = ctx.x_kept = None
        POOL.give(held)
        POOL.give(ctx.held)
        state = ctx.state
        if state is not None:  # TE: the gradient role's scales update now (the loop here, not
            # a ScalingState method: the per-step path stays in this file)
            for ds in state.backward:
                ds.update()
        return dx, dw, db, None, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    state: ScalingState | None = None,
    gathered: GatheredWeight | None = None,
) -> torch.Tensor:
    """``y = x Wᵀ + b`` under ``plan`` (`fp8lab.nn.plan.build_plan`); x ``[..., in]`` ->
    ``[..., out]``, in x's dtype (the autocast dtype under ``torch.autocast``). ``state``: its
    gradient role updates at the end of the backward. ``gathered``: see `GatheredWeight`."""
    device = x.device.type
    if torch.is_autocast_enabled(device):  # TE: cast before quantization, output in this dtype
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    return _LinearFunction.apply(x, weight, bias, plan, state, keep, gathered)


# =========================================================================== activation recompute
# torch.utils.checkpoint runs a checkpointed block's forward twice: first without keeping its
# activations (reentrant: under no_grad; non-reentrant: under saved-tensor hooks that drop them),
# then again inside the backward to recompute them. Transformer Engine marks the two phases in
# its own checkpoint (``in_fp8_activation_recompute_phase``) and replays the recompute under
# the scaling state the first forward used (``copy_forward_fp8_meta_tensors_for_recompute``,
# ``get_old_fp8_meta_tensors_for_recompute``, ``restore_fp8_meta_tensors``). fp8lab does the
# same under torch's own checkpoint, so a checkpointed model trains bit for bit as without.

_REENTRANT_FORWARD = _ReentrantCheckpoint.forward.__code__


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant checkpoint, offload, user hooks)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _in_backward() -> bool:
    """Whether a backward pass is running: a forward with grad enabled there is a checkpoint
    recomputing (either mode; torch's non-reentrant checkpoint asks the same graph-task id)."""
    return torch._C._current_graph_task_id() != -1


def _reentrant_checkpoint() -> Any:
    """The ctx of the reentrant ``torch.utils.checkpoint`` whose no_grad forward is running
    (found on the call stack: only asked for a training module's no_grad forward), or None."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is _REENTRANT_FORWARD:
            return f.f_locals.get("ctx")
        f = f.f_back
    return None


@dataclass(eq=False)
class _Replay:
    """What a recompute of one checkpointed forward repeats: the plan (the recipe it ran under,
    an `fp8lab.nn.autocast` one included) and its `ScalingState`, the forward roles' states
    before it (`ScalingState.snapshot_forward`), torch's CPU generator state when the forward
    rounds stochastically (its one draw per cast comes from that generator), and whether
    operands were observed (the kept operands then include their sources)."""

    plan: LinearPlan
    state: ScalingState
    snapshot: list[dict[str, torch.Tensor]]
    rng: torch.Tensor | None
    observed: bool


def _draws_random(plan: LinearPlan) -> bool:
    return any(
        s is not None and s.rounding == "stochastic"
        for op in plan.fprop.operands
        for s in (op.spec, op.shadow)
    )


def _silent(*args: object) -> None:
    """The observer a recompute runs under when the first forward was observed: the kept
    operands have the same layout, and nobody sees an operand twice."""


@contextlib.contextmanager
def _replaying(rec: _Replay) -> Iterator[None]:
    """A recompute of ``rec``'s forward: its scaling states, random bits and operand layout;
    observers are not called again."""
    observers = _OBSERVERS.active
    _OBSERVERS.active = [_silent] if rec.observed else []
    try:
        with rec.state.replaying(rec.snapshot):
            if rec.rng is None or torch.equal(torch.get_rng_state(), rec.rng):
                yield  # (torch's checkpoint restored the generator already: preserve_rng_state)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(rec.rng)
                    yield
    finally:
        _OBSERVERS.active = observers


# =========================================================================== the module
def _warn_unreduced_amax() -> None:
    """Delayed scaling under torch.distributed reduces amaxes only once
    `fp8lab.distributed.set_amax_reduction()` was called (explicitly, never by an import; the
    scaling layer never communicates): say so if it was not, since ranks with local amaxes drift
    apart silently."""
    d = torch.distributed
    if d.is_available() and d.is_initialized() and not amax_reduction_installed():
        warnings.warn(
            "fp8lab: delayed scaling under torch.distributed without an amax reduction: call "
            "fp8lab.distributed.set_amax_reduction() (or fp8lab.distributed.set_amax_group(model, "
            "'world')) so the amaxes are all-reduced over the ranks as Transformer Engine does",
            RuntimeWarning,
            stacklevel=4,
        )


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with simulated low-precision GEMMs.

    Same constructor (plus ``recipe`` and ``name``), same initialisation and the same
    ``weight``/``bias`` state_dict keys; the state_dict also holds ``fp8_recipe`` (the recipe's
    numerics as a uint8 JSON tensor) and, for delayed scaling, ``fp8_<role>_<field>`` tensors
    (``scale``, ``amax_history``, ``step``, ``initialized``, ``fmt_max``). Loading a state saved
    under another recipe raises; a checkpoint of a plain ``torch.nn.Linear`` loads (the scaling
    state then starts fresh). The scaling state is written to / read from the state_dict as plain
    tensors but is not a registered buffer, so ``model.to(torch.bfloat16)`` cannot cast it; it
    follows the module's device (``model.to("cuda")``, ``model.cpu()``).

    Delayed scaling timing (TE): forward roles' amaxes max-accumulate over the forwards inside an
    outermost :func:`fp8lab.nn.autocast` and update at its exit; outside ``autocast`` they update
    after each forward; ``grad_output`` updates at the end of this module's backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        recipe: Recipe | str = "te-current",
        name: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.name = name
        self._init_recipe(get_recipe(recipe))

    @classmethod
    def from_linear(
        cls, lin: torch.nn.Linear, recipe: Recipe | str, name: str | None = None
    ) -> Linear:
        """Wrap an existing ``torch.nn.Linear``, sharing its Parameter objects."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new.name = name
        new.train(lin.training)
        new._init_recipe(get_recipe(recipe))
        return new

    @classmethod
    def from_conv1d(
        cls, conv: torch.nn.Module, recipe: Recipe | str, name: str | None = None
    ) -> Linear:
        """Wrap a ``transformers`` ``Conv1D`` (``y = x @ W + b``, weight stored [in, out]),
        sharing its Parameter objects: ``weight_layout = "in_out"``, so the weight keeps its
        shape, its state_dict entry and any optimizer built before the conversion; the GEMMs
        see its transpose [out, in], as TE's and torch's linear do."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = (int(n) for n in conv.weight.shape)
        new.weight = conv.weight
        new.bias = conv.bias
        new.weight_layout = "in_out"
        new.__dict__["_replaced"] = conv  # given back by to_linear (not a submodule)
        new.name = name
        new.train(conv.training)
        new._init_recipe(get_recipe(recipe))
        return new

    #: how ``weight`` is stored: ``"out_in"`` (torch.nn.Linear) or ``"in_out"`` (a Conv1D's)
    weight_layout = "out_in"
    #: the weight FSDP gathered already quantized (`use_gathered_weight`)
    _gathered: GatheredWeight | None = None

    def to_linear(self) -> torch.nn.Module:
        """A plain ``torch.nn.Linear`` sharing this module's Parameter objects (no scaling state;
        forward hooks are not carried over); for an ``"in_out"`` layer, the ``Conv1D`` it
        replaced, holding this module's Parameters."""
        if self.weight_layout == "in_out":
            conv = self.__dict__["_replaced"]
            conv.weight, conv.bias = self.weight, self.bias
            conv.train(self.training)
            return conv
        lin = torch.nn.Linear.__new__(torch.nn.Linear)
        torch.nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight = self.weight
        lin.bias = self.bias
        lin.train(self.training)
        return lin

    # ------------------------------------------------------------------ recipe and state
    def _init_recipe(self, recipe: Recipe) -> None:
        # a recipe with [[layer]] rules: this layer's resolution, and which rules matched
        self.layer_rules = recipe.layer_rules_for(self.name or "")
        self.recipe = recipe.for_layer(self.name or "")
        self._state = ScalingState(self.recipe, self.weight.device)
        self._other_states: dict[str, ScalingState] = {}  # autocast(recipe) overrides
        self._plans: dict[str, LinearPlan] = {}
        self._own_plan: tuple[LinearPlan, ScalingState] | None = None  # self.recipe's
        # forwards a checkpoint may recompute, oldest first (weak: the autograd graph keeps
        # each alive, so a forward whose graph is gone leaves nothing behind)
        self._replays: deque[weakref.ref[_Replay]] = deque()

    def set_recipe(self, recipe: Recipe | str, keep_state: bool = False) -> None:
        """Switch to another recipe (per-layer rules resolved for this module's name).

        Delayed-scaling state restarts, or with ``keep_state`` the histories and scales whose
        state keys (`fp8lab.nn.state.state_key`) and history lengths both recipes share are
        carried over (copies): a step replayed under a counterfactual recipe (one cell in high
        precision) then quantizes every other operand exactly as the original did."""
        old = self._state.by_key
        self._init_recipe(get_recipe(recipe))
        if keep_state:
            for key, ds in self._state.by_key.items():
                if key in old and old[key].history_len == ds.history_len:
                    ds.load_state_dict({k: v.clone() for k, v in old[key].state_dict().items()})

    @property
    def scaling_states(self) -> dict[str, DelayedScaling]:
        """The delayed-scaling objects of this module's recipe, by state key."""
        return dict(self._state.by_key)

    def _state_for(self, recipe: Recipe) -> ScalingState:
        if recipe is self.recipe or recipe == self.recipe:
            return self._state
        fp = recipe.fingerprint()
        if fp not in self._other_states:
            self._other_states[fp] = ScalingState(recipe, self.weight.device)
        return self._other_states[fp]

    def _plan(self, recipe: Recipe) -> tuple[LinearPlan, ScalingState]:
        state = self._state_for(recipe)
        fp = recipe.fingerprint()
        plan = self._plans.get(fp)
        if plan is None or plan.name != self.name:
            plan = self._plans[fp] = build_plan(recipe, state, self.name)
            if state.by_key:
                _warn_unreduced_amax()
        return plan, state

    def __getstate__(self) -> dict[str, Any]:
        # plans hold bound state objects: rebuild them after copy.deepcopy / pickle
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_plans"] = {}
        state["_own_plan"] = None
        state["_replays"] = deque()
        return state

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:  # type: ignore[override]
        # .to(device) / .cuda() / .cpu(): the scaling state follows the weight's device, never
        # its dtype (float32 by design)
        super()._apply(fn, recurse)
        for st in (self._state, *self._other_states.values()):
            st.to(self.weight.device)
        return self

    def update_forward(self) -> None:
        """Update the forward roles' delayed scaling (every recipe this module has run)."""
        for st in (self._state, *self._other_states.values()):
            for ds in st.forward:
                ds.update()

    def discard_forward(self) -> None:
        """Forget the forward roles' staged amaxes (no update)."""
        for st in (self._state, *self._other_states.values()):
            st.discard_forward()

    def _remember(self, plan: LinearPlan, state: ScalingState) -> _Replay:
        """Note a forward that activation checkpointing will recompute (before it runs)."""
        rec = _Replay(
            plan,
            state,
            state.snapshot_forward(),
            torch.get_rng_state() if _draws_random(plan) else None,
            bool(_OBSERVERS.active),
        )
        q = self._replays
        while q and q[0]() is None:  # forwards whose graph is gone (no backward came)
            q.popleft()
        q.append(weakref.ref(rec))
        return rec

    def _next_replay(self) -> _Replay | None:
        """The oldest remembered forward still alive (TE's order: first in, first recomputed)."""
        q = self._replays
        while q:
            rec = q.popleft()()
            if rec is not None:
                return rec
        return None

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name or 'Linear'}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        if not x.is_floating_point():
            raise TypeError(f"{self.name or 'Linear'}: input must be floating point, got {x.dtype}")
        if _context._STATE.stack:  # under fp8lab.nn.autocast: its recipe, if it names one
            recipe = _context.active_recipe(self.recipe).for_layer(self.name or "")
            plan, state = self._plan(recipe)
        else:  # this module's own recipe, resolved once
            own = self._own_plan
            if own is None or own[0].name != self.name:
                own = self._own_plan = self._plan(self.recipe)
            plan, state = own
        w = self.weight if self.weight_layout == "out_in" else self.weight.t()
        grad = torch.is_grad_enabled()
        if grad and _in_backward():  # a checkpoint recomputing this forward
            again = self._next_replay()
            if again is not None:  # (gathered weights may be gone: quantized here, alike)
                with _replaying(again):
                    return linear(x, w, self.bias, again.plan, again.state)
        rec = reentrant = None
        if grad:
            if _saved_tensor_hooks():  # a non-reentrant checkpoint's first forward, maybe
                rec = self._remember(plan, state)
        elif self.training:
            reentrant = _reentrant_checkpoint()
            if reentrant is not None:  # its backward recomputes this forward with grad
                rec = self._remember(plan, state)
                reentrant.__dict__.setdefault("fp8lab_replays", []).append(rec)
        y = linear(x, w, self.bias, plan, state, self._gathered)
        if rec is not None and reentrant is None:
            if y.grad_fn is None:
                self._replays.pop()  # nothing kept for a backward: never recomputed
            else:
                y.grad_fn.fp8lab_replay = rec  # lives as long as this forward's graph
        if state.by_key:  # TE timing of the forward roles' delayed-scaling update
            if _context._STATE.stack:
                _context.defer_forward_update(self)  # once, at the outermost autocast exit
            elif grad or reentrant is not None:  # a training forward, checkpointed or not
                self.update_forward()
            else:
                self.discard_forward()  # evaluation must not move the scales
        return y

    @property
    def gathered_weight(self) -> GatheredWeight | None:
        """The weight FSDP gathered already quantized, if any (`use_gathered_weight`)."""
        return self._gathered

    def use_gathered_weight(self, gathered: GatheredWeight | None) -> None:
        """The weight's quantized form for the next forwards, already made by FSDP's FP8
        all-gather (`fp8lab.distributed.fsdp`); None drops it (FSDP frees it at the reshard)."""
        if gathered is not None and not isinstance(gathered, GatheredWeight):
            raise TypeError(f"expected a GatheredWeight, got {type(gathered).__name__}")
        self._gathered = gathered

    def extra_repr(self) -> str:
        layout = "" if self.weight_layout == "out_in" else ", weight_layout='in_out'"
        return f"{super().extra_repr()}, recipe={self.recipe.name!r}{layout}"

    # ------------------------------------------------------------------ state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        fp = self.recipe.fingerprint().encode()
        destination[prefix + _RECIPE_KEY] = torch.tensor(list(fp), dtype=torch.uint8)
        for key, ds in self._state.by_key.items():
            for field_name, t in ds.state_dict().items():
                destination[f"{prefix}fp8_{key}_{field_name}"] = t

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        ours = {k for k in state_dict if k.startswith(prefix + "fp8_")}
        rk = prefix + _RECIPE_KEY
        where = self.name or prefix.rstrip(".") or "Linear"
        if rk in state_dict:
            saved = bytes(state_dict[rk].to(torch.uint8).tolist()).decode()
            if saved != self.recipe.fingerprint():
                raise ValueError(
                    f"{where}: state was saved under another recipe; this module runs "
                    f"{self.recipe.name!r}. Saved recipe numerics: {_short(saved)}"
                )
            for key, ds in self._state.by_key.items():
                fields = ds.state_dict()
                need = [f"{prefix}fp8_{key}_{f}" for f in fields]
                missing = [k for k in need if k not in state_dict]
                if missing:
                    raise ValueError(f"{where}: mismatched scaling state, missing {missing}")
                new = {f: state_dict[k] for f, k in zip(fields, need, strict=True)}
                hist = torch.as_tensor(new["amax_history"])
                if hist.numel() != ds.history_len:
                    raise ValueError(
                        f"{where}: mismatched scaling state for {key}: amax_history has "
                        f"{hist.numel()} entries, the recipe uses {ds.history_len}"
                    )
                if bool(torch.isnan(hist).any()) or not bool(
                    torch.isfinite(torch.as_tensor(new["scale"])).all()
                ):
                    raise ValueError(
                        f"{where}: NaN in amax history or non-finite scale of {key} in the "
                        "loaded state"
                    )
                ds.load_state_dict(new)
            known = {rk} | {
                f"{prefix}fp8_{key}_{f}"
                for key, ds in self._state.by_key.items()
                for f in ds.state_dict()
            }
            extra = sorted(k for k in ours if k not in known)
            if extra and strict:
                raise ValueError(f"{where}: mismatched scaling state, unexpected {extra}")
        elif ours:
            raise ValueError(f"{where}: scaling state without {_RECIPE_KEY}: {sorted(ours)}")
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]


def _short(fingerprint: str) -> str:
    try:
        d = json.loads(fingerprint)
    except json.JSONDecodeError:
        return fingerprint[:200]
    parts = []
    for role in ("input", "weight", "grad_output"):
        s = d.get(role)
        parts.append(f"{role}={s['format']}/{s['granularity']}" if s else f"{role}=fp32")
    return ", ".join(parts)
