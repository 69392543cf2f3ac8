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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8lab.gemm import Accumulator, qmatmul
from fp8lab.nn._kernels import round_bf16
from fp8lab.quantize import QTensor, QuantSpec, quantize, retile
from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe

__all__ = [
    "LinearPlan",
    "attention_matmul",
    "build_plan",
    "dense",
    "linear",
    "operand",
    "round_high_precision",
]

_HP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    return LinearPlan(
        recipe=recipe,
        specs=specs,
        high_precision={g: recipe.gemm(g).high_precision for g in GEMMS},
        accumulators={g: recipe.gemm(g).accumulator for g in GEMMS},
        save_quantized=recipe.save_for_backward == "quantized",
        name=name,
        after_backward=after_backward,
    )


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
    x: torch.Tensor, plan: LinearPlan, gemm: str, role: str, scratch: bool = False
) -> tuple[torch.Tensor | None, QTensor | None]:
    """``(tensor, None)`` for an unquantized operand (fp32 or rounded to the high precision), or
    ``(None, QTensor)`` for a quantized one; ``x`` in its natural layout.

    ``scratch=True``: the result dies within the caller (backward's gradient), so a bf16 rounding
    may go into the plan's reusable buffer instead of a fresh allocation (not while operands are
    being collected, since the collector keeps them)."""
    hp = plan.high_precision[gemm]
    if hp == "bf16" and scratch and not COLLECTORS.active and x.dtype == torch.float32:
        buf = plan.extra.get("scratch")
        if buf is None or buf.shape != x.shape:
            buf = torch.empty(x.shape, dtype=torch.float32)
            plan.extra["scratch"] = buf
        a, q = round_bf16(x.contiguous(), out=buf), None
    elif hp is not None:
        a, q = round_high_precision(x, hp), None
    else:
        spec = plan.specs[(gemm, role)]
        a, q = (x, None) if spec is None else (None, quantize(x, spec))
    if COLLECTORS.active:
        _record(plan.name, gemm, role, x, dense(a, q))
    return a, q


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


def _from_saved(saved: Saved, plan: LinearPlan, gemm: str, role: str):
    """The operand of ``gemm`` rebuilt from what forward saved for ``role``."""
    a, q, src, retile_q, orig = saved  # orig: the fp32 tensor, kept only while collecting
    if retile_q:  # save_for_backward="quantized" with other blocks: re-tile the quantized tensor
        spec = plan.specs[(gemm, role)]
        q2 = quantize(q.dequantize(), spec) if spec.is_delayed else retile(q, spec=spec)
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
    return operand(src, plan, gemm, role)


def _plan_save(
    plan: LinearPlan, x: torch.Tensor, a, q, src_gemm: str, gemm: str, role: str
) -> Saved:
    """What to keep for the backward use of ``role`` in ``gemm``: ``(a, q, source, retile, orig)``.

    Reuse ``(a, q)`` when both GEMMs see the same operand; re-tile ``q`` when
    ``save_for_backward="quantized"`` and only the blocks differ; else keep the fp32 ``source``
    to prepare afresh.
    """
    orig = x if COLLECTORS.active else None
    hp_src, hp_dst = plan.high_precision[src_gemm], plan.high_precision[gemm]
    s_src, s_dst = plan.specs[(src_gemm, role)], plan.specs[(gemm, role)]
    if hp_dst is not None:
        if hp_src == hp_dst:
            return a, None, None, False, orig
        return None, None, x, False, orig
    if s_dst is None:
        if hp_src is None and s_src is None:
            return x, None, None, False, orig
        return None, None, x, False, orig
    if hp_src is None and s_src is not None and s_src == s_dst:
        return None, q, None, False, orig
    if plan.save_quantized and q is not None:
        return None, q, None, True, orig
    return None, None, x, False, orig


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
        if acc.kind == "fp32" and qa.scales.shape[1] > 1 and qb.scales.shape[0] > 1:
            # scales vary along K: qmatmul's fp32 path is mm(dequantized, dequantized); do it
            # here with the memoised dequantized operands
            out = torch.mm(dense(None, qa), dense(None, qb))
        else:
            out = qmatmul(qa, qb, acc)
        return out if bias is None else out.add_(bias)
    a, b = dense(a, qa), dense(b, qb)
    if bias is not None:
        return torch.addmm(bias, a, b)
    return a @ b


def _t(a: torch.Tensor | None, q: QTensor | None):
    if q is not None:
        q.meta.setdefault("_nn_dense", [None])  # shared with the transposed copy
    return (None if a is None else a.t()), (None if q is None else q.t())


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        # low-precision parameters (model.to(bfloat16)) are computed on in float32; autograd
        # casts the float32 gradients back to the parameters' dtype
        if weight.dtype != torch.float32:
            weight = weight.float()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        ax, qx = operand(x2, plan, "fprop", "input")
        aw, qw = operand(weight, plan, "fprop", "weight")
        y = _gemm(plan.accumulators["fprop"], ax, qx, *_t(aw, qw), bias)
        ctx.plan = plan
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        # the backward's operands (not via save_for_backward: QTensors are not tensors)
        ctx.saved_w = _plan_save(plan, weight, aw, qw, "fprop", "dgrad", "weight")
        ctx.saved_x = _plan_save(plan, x2, ax, qx, "fprop", "wgrad", "input")
        ctx.x_dtype = x.dtype
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
        if ctx.needs_input_grad[0]:
            ady, qdy = operand(dy2, plan, "dgrad", "grad_output", scratch=True)
            dgrad_dy = (ady, qdy)
            aw, qw = _from_saved(ctx.saved_w, plan, "dgrad", "weight")
            dx = _gemm(plan.accumulators["dgrad"], ady, qdy, aw, qw).reshape(ctx.x_shape)
            dx = dx if ctx.x_dtype == torch.float32 else dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if dgrad_dy is not None:
                saved = _plan_save(plan, dy2, *dgrad_dy, "dgrad", "wgrad", "grad_output")
                ady_w, qdy_w = _from_saved(saved, plan, "wgrad", "grad_output")
            else:
                ady_w, qdy_w = operand(dy2, plan, "wgrad", "grad_output", scratch=True)
            ax, qx = _from_saved(ctx.saved_x, plan, "wgrad", "input")
            # (xᵀ · dy)ᵀ: the same product and layout as torch's own linear backward
            dw = _gemm(plan.accumulators["wgrad"], *_t(ax, qx), ady_w, qdy_w).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        ctx.saved_w = ctx.saved_x = None
        if plan.after_backward is not None:
            plan.after_backward()
        return dx, dw, db, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan
) -> torch.Tensor:
    """``y = x Wᵀ + b`` under ``plan`` (from `build_plan`); x ``[..., in]`` -> ``[..., out]``."""
    return _LinearFunction.apply(x, weight, bias, plan)


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
