"""The autograd Function of a linear layer under a recipe: the three GEMMs of seed 001.

::

    fprop  y  = Q(x) · Q(W)ᵀ      x [T, I] reduced over I,  W [O, I] reduced over I
    dgrad  dx = Q(dy) · Q(W)      dy [T, O] reduced over O, W reduced over O (first axis)
    wgrad  dW = Q(dy)ᵀ · Q(x)     dy and x reduced over T (first axis)

Each operand is prepared by :func:`operand` from its (GEMM, role) spec: the GEMM's
high-precision override (operands rounded to fp32/bf16/fp16), else the role spec (or its
per-GEMM override), with the block shape transposed when the GEMM reduces the operand along its
first axis (re-tiling). Two quantized operands are multiplied by `fp8lab.qmatmul` under the
GEMM's accumulator (its fp32 path multiplies K-constant scales onto the product of the grid values,
as the hardware does; with K-varying block scales it is one mm of the dequantized operands, done
here with memoised dequantization). Otherwise the GEMM is one fp32 ``addmm``, so the ``fp32``
recipe is torch's own linear bit for bit.

Reuse: one quantization serves two GEMMs when their specs coincide (per-tensor scaling: x for
fprop and wgrad, W for fprop and dgrad, dy for dgrad and wgrad). When the blocks differ, the
recipe's ``save_for_backward`` decides: ``"quantized"`` re-tiles the forward's quantized tensor
(DeepSeek-V3: dequantize, re-quantize into the new tiles, `fp8lab.retile`); ``"high_precision"``
keeps the fp32 tensor and quantizes it again in backward.

Buffers: operands are written into float32 buffers from a small shared cache keyed by shape
(`clear_buffer_cache`, `buffer_cache_limit`), not fresh allocations (a fresh 32 MB tensor costs
more than the quantization pass that fills it). Where a GEMM will run on the dequantized operand
(fp32 accumulation with scales varying along K, or the source of a re-tiling) the dequantized
copy is written in the same pass as the quantized values. Results are bit for bit those of the
allocating path (tests/nn/test_buffers.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab.gemm import Accumulator, qmatmul
from fp8lab.nn._kernels import round_bf16
from fp8lab.qtensor import QTensor, QuantSpec, quantize, retile
from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe
from fp8lab.scaling.granularity import resolve_block

__all__ = [
    "LinearPlan",
    "attention_matmul",
    "buffer_cache_limit",
    "build_plan",
    "clear_buffer_cache",
    "dense",
    "linear",
    "operand",
    "round_high_precision",
]

_HP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- buffer cache
class _BufferPool:
    """Free float32 buffers by shape, reused across calls and modules.

    A fresh 32 MB tensor costs more than the quantization pass that fills it (page faults on
    first touch: ~21 ms vs ~6 ms here), so operand buffers (quantized values, their dequantized
    copy, bf16-rounded operands) come from here. A forward's buffers are held by the autograd
    context and returned at the end of its backward (or at the end of the forward when no
    backward will run); backward's own buffers are returned when it ends. Buffers never leave
    the Function (outputs and gradients are fresh tensors), and the pool is bypassed while
    operands are being collected, since the collector keeps them. At most ``max_bytes`` of free
    buffers are retained.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.free_bytes = 0
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, ...], held: list[torch.Tensor]) -> torch.Tensor:
        with self.lock:
            lst = self.free.get(shape)
            buf = lst.pop() if lst else None
            if buf is not None:
                self.free_bytes -= 4 * buf.numel()
        if buf is None:
            buf = torch.empty(shape, dtype=torch.float32)
        held.append(buf)
        return buf

    def give(self, held: list[torch.Tensor]) -> None:
        with self.lock:
            for buf in held:
                nbytes = 4 * buf.numel()
                if self.free_bytes + nbytes > self.max_bytes:
                    continue
                self.free.setdefault(tuple(buf.shape), []).append(buf)
                self.free_bytes += nbytes
        held.clear()

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.free_bytes = 0


_POOL = _BufferPool()


def clear_buffer_cache() -> None:
    """Drop the free operand buffers kept by `fp8lab.nn` (see `buffer_cache_limit`)."""
    _POOL.clear()


def buffer_cache_limit(max_bytes: int | None = None) -> int:
    """The limit (bytes) on free operand buffers kept for reuse; set it when ``max_bytes`` is
    given (0 disables reuse). Returns the limit in force. Default 1 GiB."""
    if max_bytes is not None:
        if int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        _POOL.max_bytes = int(max_bytes)
        if _POOL.free_bytes > _POOL.max_bytes:
            _POOL.clear()
    return _POOL.max_bytes


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


@dataclass
class LinearPlan:
    """Resolved, per-call view of a recipe for one module: bound specs per (GEMM, role)."""

    recipe: Recipe
    specs: dict[tuple[str, str], QuantSpec | None]
    high_precision: dict[str, str | None]
    accumulators: dict[str, Accumulator]
    save_quantized: bool
    name: str | None = None
    after_backward: Callable[[], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def build_plan(
    recipe: Recipe,
    states: dict[str, Any],
    name: str | None = None,
    after_backward: Callable[[], None] | None = None,
) -> LinearPlan:
    """Bind ``recipe`` to a module's delayed-scaling ``states`` (see `state_key`)."""
    specs: dict[tuple[str, str], QuantSpec | None] = {}
    for g in GEMMS:
        cfg = recipe.gemm(g)
        for role, first_axis in GEMM_OPERANDS[g]:
            s = None if cfg.high_precision else recipe.spec(g, role)
            if s is not None:
                if s.is_delayed:
                    s = s.replace(scaling=states[state_key(recipe, g, role)])
                if first_axis:
                    s = s.transposed()
            specs[(g, role)] = s
    plan = LinearPlan(
        recipe=recipe,
        specs=specs,
        high_precision={g: recipe.gemm(g).high_precision for g in GEMMS},
        accumulators={g: recipe.gemm(g).accumulator for g in GEMMS},
        save_quantized=recipe.save_for_backward == "quantized",
        name=name,
        after_backward=after_backward,
    )
    # operands that a later GEMM re-tiles from their quantized values: their dequantized copy
    # is written while quantizing (it is the re-tiling's input)
    plan.extra["retile_sources"] = frozenset(
        (src, role) for src, dst, role in _REUSES if _save_mode(plan, src, dst, role) == "retile"
    )
    return plan


def state_key(recipe: Recipe, gemm: str, role: str) -> str:
    """Name of the delayed-scaling state serving (gemm, role): the role, or ``gemm_role`` for an
    override with its own delayed scaling."""
    return role if recipe.gemm(gemm).override(role) is None else f"{gemm}_{role}"


# --------------------------------------------------------------------------- collection hook
class _Collectors(threading.local):
    def __init__(self) -> None:
        self.active: list[Callable[[str, str, str, torch.Tensor, torch.Tensor | None], None]] = []


COLLECTORS = _Collectors()


def _record(
    name: str | None, gemm: str, role: str, hp: torch.Tensor, used: torch.Tensor | None
) -> None:
    for c in COLLECTORS.active:
        c(name or "?", gemm, role, hp, used)


# --------------------------------------------------------------------------- operands
def operand(
    x: torch.Tensor,
    plan: LinearPlan,
    gemm: str,
    role: str,
    scratch: bool = False,
    held: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, QTensor | None]:
    """``(tensor, None)`` for an unquantized operand (fp32 or rounded to the high precision), or
    ``(None, QTensor)`` for a quantized one; ``x`` in its natural layout.

    ``held``: take the result's buffers from the nn buffer cache and append them to this list
    (the caller returns them once the operand is dead); ``None`` allocates. ``scratch=True``
    (without ``held``): the result dies within the caller (backward's gradient), so a bf16
    rounding may go into the plan's reusable buffer instead of a fresh allocation. Neither
    applies while operands are being collected, since the collector keeps them."""
    hp = plan.high_precision[gemm]
    if COLLECTORS.active:
        held, scratch = None, False
    if hp == "bf16" and x.dtype == torch.float32 and (held is not None or scratch):
        if held is not None:
            buf = _POOL.take(tuple(x.shape), held)
        else:
            buf = plan.extra.get("scratch")
            if buf is None or buf.shape != x.shape:
                buf = torch.empty(x.shape, dtype=torch.float32)
                plan.extra["scratch"] = buf
        a, q = round_bf16(x.contiguous(), out=buf), None
    elif hp is not None:
        a, q = round_high_precision(x, hp), None
    else:
        spec = plan.specs[(gemm, role)]
        if spec is None:
            a, q = x, None
        else:
            a, q = None, _quantize(x, spec, held, _wants_dense(plan, gemm, role, x.shape))
    if COLLECTORS.active:
        _record(plan.name, gemm, role, x, dense(a, q))
    return a, q


def _quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    held: list[torch.Tensor] | None,
    want_dense: bool,
    retile_from: QTensor | None = None,
) -> QTensor:
    """Quantize ``x`` (or re-tile ``retile_from``, whose dequantized tensor ``x`` is) into pooled
    buffers when ``held`` is given; with ``want_dense`` the dequantized copy is written in the
    same pass and memoised for `dense`."""
    if held is None:
        out = deq = None
    else:
        shape = tuple(x.shape)
        out = _POOL.take(shape, held)
        deq = _POOL.take(shape, held) if want_dense else None
    if retile_from is None:
        q = quantize(x, spec, out=out, dequantized_out=deq)
    else:
        # the added-error measurement is a diagnostic pass nn does not report: skip it
        q = retile(
            retile_from, spec=spec, measure_error=False, dequantized=x, out=out,
            dequantized_out=deq,
        )  # fmt: skip
    if deq is not None:
        q.meta["_nn_dense"] = [(_layout(q.values), deq)]
    return q


def _wants_dense(plan: LinearPlan, gemm: str, role: str, shape: tuple[int, ...]) -> bool:
    """Will the dequantized operand be needed: an fp32-accumulated GEMM whose scales vary along
    K (it runs on the dequantized operands), or a source of a re-tiling from quantized values."""
    if (gemm, role) in plan.extra.get("retile_sources", ()):
        return True
    if plan.accumulators[gemm].kind != "fp32" or len(shape) != 2:
        return False
    first_axis = dict(GEMM_OPERANDS[gemm])[role]
    spec = plan.specs[(gemm, role)]
    k_axis = 0 if first_axis else 1
    bk = resolve_block(spec.block, (shape[0], shape[1]))[k_axis]
    return bk < shape[k_axis]


def _layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape), t.stride()


def dense(a: torch.Tensor | None, q: QTensor | None) -> torch.Tensor:
    """The float32 tensor an operand stands for (dequantized if quantized).

    The dequantized tensor is memoised in a holder shared by a QTensor and its ``.t()`` copies
    (``QTensor.t()`` copies ``meta`` shallowly, see `_t`), so an operand used by two GEMMs, in
    either orientation, is dequantized once.
    """
    if q is None:
        return a
    holder = q.meta.get("_nn_dense")
    if holder is None:
        holder = q.meta["_nn_dense"] = [None]
    v = q.values
    if holder[0] is not None:
        key, d = holder[0]
        if key == _layout(v):
            return d
        if v.dim() == 2 and key == _layout(v.t()):
            return d.t()
    d = q.dequantize()
    holder[0] = (_layout(v), d)
    return d


Saved = tuple[torch.Tensor | None, QTensor | None, torch.Tensor | None, bool, torch.Tensor | None]


def _from_saved(
    saved: Saved,
    plan: LinearPlan,
    gemm: str,
    role: str,
    held: list[torch.Tensor] | None = None,
):
    """The operand of ``gemm`` rebuilt from what forward saved for ``role`` (new buffers from
    the cache when ``held`` is given, see `operand`)."""
    a, q, src, retile_q, orig = saved  # orig: the fp32 tensor, kept only while collecting
    if COLLECTORS.active:
        held = None
    if retile_q:  # save_for_backward="quantized" with other blocks: re-tile the quantized tensor
        spec = plan.specs[(gemm, role)]
        want = _wants_dense(plan, gemm, role, tuple(q.shape))
        deq = dense(None, q)
        if spec.is_delayed:
            q2 = _quantize(deq, spec, held, want)
        else:
            q2 = _quantize(deq, spec, held, want, retile_from=q)
        if COLLECTORS.active:
            _record(
                plan.name, gemm, role, orig if orig is not None else dense(None, q), dense(None, q2)
            )
        return None, q2
    if src is None:  # the forward's operand is reused as is
        if COLLECTORS.active:
            d = dense(a, q)
            _record(plan.name, gemm, role, orig if orig is not None else d, d)
        return a, q
    return operand(src, plan, gemm, role, held=held)


def _plan_save(
    plan: LinearPlan, x: torch.Tensor, a, q, src_gemm: str, gemm: str, role: str
) -> Saved:
    """What to keep for the backward use of ``role`` in ``gemm``: ``(a, q, source, retile, orig)``.

    Reuse ``(a, q)`` when both GEMMs see the same operand; re-tile ``q`` when
    ``save_for_backward="quantized"`` and only the blocks differ; else keep the fp32 ``source``
    to prepare afresh.
    """
    orig = x if COLLECTORS.active else None
    mode = _save_mode(plan, src_gemm, gemm, role)
    if mode == "reuse_a":
        return a, None, None, False, orig
    if mode == "reuse_x":
        return x, None, None, False, orig
    if mode == "reuse_q":
        return None, q, None, False, orig
    if mode == "retile":
        return None, q, None, True, orig
    return None, None, x, False, orig


def _save_mode(plan: LinearPlan, src_gemm: str, gemm: str, role: str) -> str:
    """How ``role``'s operand of ``src_gemm`` serves ``gemm``: ``reuse_a`` (the same
    high-precision rounding), ``reuse_x`` (fp32 as is), ``reuse_q`` (the same quantization),
    ``retile`` (re-tile the quantized tensor) or ``source`` (prepare afresh from fp32)."""
    hp_src, hp_dst = plan.high_precision[src_gemm], plan.high_precision[gemm]
    s_src, s_dst = plan.specs[(src_gemm, role)], plan.specs[(gemm, role)]
    quantized_src = hp_src is None and s_src is not None
    if hp_dst is not None:
        return "reuse_a" if hp_src == hp_dst else "source"
    if s_dst is None:
        return "reuse_x" if hp_src is None and s_src is None else "source"
    if quantized_src and s_src == s_dst:
        return "reuse_q"
    if plan.save_quantized and quantized_src:
        return "retile"
    return "source"


_REUSES = (
    ("fprop", "dgrad", "weight"),
    ("fprop", "wgrad", "input"),
    ("dgrad", "wgrad", "grad_output"),
)


def _gemm(
    acc: Accumulator,
    a: torch.Tensor | None,
    qa: QTensor | None,
    b: torch.Tensor | None,
    qb: QTensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)``; a: [M, K], b: [K, N]. Two quantized operands go through
    `fp8lab.qmatmul` (its fp32 path multiplies K-constant scales onto the product of the grid
    values, as the hardware does); otherwise one fp32 ``addmm``/``mm``."""
    if qa is not None and qb is not None:
        scale = None
        if acc.kind == "fp32" and qa.scales.shape[1] > 1 and qb.scales.shape[0] > 1:
            # scales vary along K: qmatmul's fp32 path is mm(dequantized, dequantized); do it
            # here with the memoised dequantized operands
            out = torch.mm(dense(None, qa), dense(None, qb))
        elif acc.kind == "fp32" and _per_tensor(qa) and _per_tensor(qb):
            # qmatmul's fp32 path for per-tensor scales, mm(values) * fl32(sa * sb), with the
            # scale and the bias applied in one serial pass instead of two threaded torch ops
            out = torch.mm(qa.values, qb.values)
            scale = (qa.scales.reshape(()) * qb.scales.reshape(())).numpy()
        else:
            out = qmatmul(qa, qb, acc)
        if (scale is not None or bias is not None) and out.numel():
            _epilogue(out, scale, bias)
        return out
    a, b = dense(a, qa), dense(b, qb)
    if bias is not None:
        return torch.addmm(bias, a, b)
    return a @ b


def _per_tensor(q: QTensor) -> bool:
    return q.scales.numel() == 1 and q.global_scale is None and q.values.dtype == torch.float32


@njit(cache=True)
def _scale_bias_rows(o, n, s, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = np.float32(r[j] * s) + b[j]


@njit(cache=True)
def _scale_all(o, s):  # pragma: no cover - numba
    for i in range(o.shape[0]):
        o[i] = o[i] * s


@njit(cache=True)
def _bias_rows(o, n, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = r[j] + b[j]


def _epilogue(out: torch.Tensor, scale: np.ndarray | None, bias: torch.Tensor | None) -> None:
    """In place on a contiguous float32 [M, N] GEMM output: ``out = fl32(out * scale)`` then
    ``fl32(out + bias)``, the same two roundings as ``out.mul_(scale).add_(bias)`` (no FMA),
    in one serial numba pass (torch's threaded elementwise ops stall on a busy 2-core box)."""
    if not out.is_contiguous():
        if scale is not None:
            out.mul_(torch.from_numpy(np.asarray(scale, dtype=np.float32)))
        if bias is not None:
            out.add_(bias)
        return
    o = out.view(-1).numpy()
    n = out.shape[1]
    if bias is not None:
        b = bias.detach().to(torch.float32).contiguous().numpy()
        if scale is None:
            _bias_rows(o, n, b)
        else:
            _scale_bias_rows(o, n, np.float32(scale), b)
    else:
        _scale_all(o, np.float32(scale))


def _t(a: torch.Tensor | None, q: QTensor | None):
    if q is not None:
        q.meta.setdefault("_nn_dense", [None])  # shared with the transposed copy
    return (None if a is None else a.t()), (None if q is None else q.t())


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, keep):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        # low-precision parameters (model.to(bfloat16)) are computed on in float32; autograd
        # casts the float32 gradients back to the parameters' dtype
        if weight.dtype != torch.float32:
            weight = weight.float()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        held: list[torch.Tensor] = []  # cached buffers of the forward's operands
        ax, qx = operand(x2, plan, "fprop", "input", held=held)
        aw, qw = operand(weight, plan, "fprop", "weight", held=held)
        y = _gemm(plan.accumulators["fprop"], ax, qx, *_t(aw, qw), bias)
        ctx.plan = plan
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.x_dtype = x.dtype
        if keep:
            # the backward's operands (not via save_for_backward: QTensors are not tensors);
            # their cached buffers are held by the context until backward ends
            ctx.saved_w = _plan_save(plan, weight, aw, qw, "fprop", "dgrad", "weight")
            ctx.saved_x = _plan_save(plan, x2, ax, qx, "fprop", "wgrad", "input")
            ctx.held = held
        else:  # no backward will run: the operands die here
            ctx.saved_w = ctx.saved_x = None
            ax = qx = aw = qw = None
            _POOL.give(held)
            ctx.held = []
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if x.dtype == torch.float32 else y.to(x.dtype)  # drop-in: output in x's dtype

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        plan: LinearPlan = ctx.plan
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype != torch.float32:
            dy2 = dy2.float()
        dx = dw = db = None
        dgrad_dy = None
        held: list[torch.Tensor] = []  # cached buffers of backward's operands
        if ctx.needs_input_grad[0]:
            ady, qdy = operand(dy2, plan, "dgrad", "grad_output", held=held)
            dgrad_dy = (ady, qdy)
            aw, qw = _from_saved(ctx.saved_w, plan, "dgrad", "weight", held)
            dx = _gemm(plan.accumulators["dgrad"], ady, qdy, aw, qw).reshape(ctx.x_shape)
            dx = dx if ctx.x_dtype == torch.float32 else dx.to(ctx.x_dtype)
            aw = qw = None
        if ctx.needs_input_grad[1]:
            if dgrad_dy is not None:
                saved = _plan_save(plan, dy2, *dgrad_dy, "dgrad", "wgrad", "grad_output")
                ady_w, qdy_w = _from_saved(saved, plan, "wgrad", "grad_output", held)
                saved = None
            else:
                ady_w, qdy_w = operand(dy2, plan, "wgrad", "grad_output", held=held)
            ax, qx = _from_saved(ctx.saved_x, plan, "wgrad", "input", held)
            # (xᵀ · dy)ᵀ: the same product and layout as torch's own linear backward
            dw = _gemm(plan.accumulators["wgrad"], *_t(ax, qx), ady_w, qdy_w).t()
            ax = qx = ady_w = qdy_w = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        dgrad_dy = ady = qdy = None
        ctx.saved_w = ctx.saved_x = None
        # every operand is dead now (outputs and gradients are fresh tensors): recycle buffers
        _POOL.give(held)
        _POOL.give(ctx.held)
        if plan.after_backward is not None:
            plan.after_backward()
        return dx, dw, db, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan
) -> torch.Tensor:
    """``y = x Wᵀ + b`` under ``plan`` (from `build_plan`); x ``[..., in]`` -> ``[..., out]``."""
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    return _LinearFunction.apply(x, weight, bias, plan, keep)


# --------------------------------------------------------------------------- attention
def _stateless(spec: QuantSpec | None) -> QuantSpec | None:
    # attention operands are fresh every call: delayed specs fall back to current scaling
    if spec is not None and spec.is_delayed:
        return spec.replace(scaling="max")
    return spec


class _AttentionMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, fwd_spec, bwd_spec):  # type: ignore[override]
        qa = a if fwd_spec is None else quantize(a, fwd_spec).dequantize()
        qb = b if fwd_spec is None else quantize(b, fwd_spec).dequantize()
        ctx.save_for_backward(qa, qb)
        ctx.bwd_spec = bwd_spec
        return torch.matmul(qa, qb)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        qa, qb = ctx.saved_tensors
        if ctx.bwd_spec is not None:
            g = quantize(g.contiguous(), ctx.bwd_spec).dequantize()
        da = torch.matmul(g, qb.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        db = torch.matmul(qa.transpose(-1, -2), g) if ctx.needs_input_grad[1] else None
        return da, db, None, None


def attention_matmul(
    a: torch.Tensor, b: torch.Tensor, recipe: Recipe | None = None
) -> torch.Tensor:
    """``a @ b`` for attention's two matmuls (``q kᵀ`` and ``p v``), quantized when the recipe
    says so (``recipe.attention``, off by default like TE's ``fp8_dpa``).

    ``recipe=None`` uses the innermost :func:`fp8lab.nn.autocast` recipe (no autocast: plain
    matmul). Operands use the recipe's ``input`` spec and the incoming gradient its
    ``grad_output`` spec, each quantized as a ``[..., last dim]`` tensor with current scaling
    (delayed specs fall back to current scaling: attention operands keep no state).
    """
    if recipe is None:
        from fp8lab.nn.convert import active_recipe

        recipe = active_recipe()
    if recipe is None or not recipe.attention:
        return torch.matmul(a, b)
    return _AttentionMatmul.apply(
        a.contiguous(),
        b.contiguous(),
        _stateless(recipe.input),
        _stateless(recipe.grad_output),
    )
