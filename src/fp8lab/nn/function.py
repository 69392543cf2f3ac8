"""The autograd Function of a linear layer under a recipe: its three GEMMs, top to bottom.

::

    fprop  y  = Q(x) · Q(W)ᵀ      x [T, I] reduced over I,  W [O, I] reduced over I
    dgrad  dx = Q(dy) · Q(W)      dy [T, O] reduced over O, W reduced over O (first axis)
    wgrad  dW = (Q(x)ᵀ · Q(dy))ᵀ  x and dy reduced over T (first axis)

These are the three GEMMs that NVIDIA's developer blog "探索 FP8 训练中 Debug 思路与技巧" bisects
one by one. Each operand comes from `fp8lab.nn.operand` under the `LinearPlan` (built once per
module and recipe); the backward takes its weight, input and second gradient operand from the
forward's (reused, re-tiled or prepared afresh: `fp8lab.nn.plan.Reuse`). With no quantized pair
a GEMM is one fp32 ``addmm``, so the ``fp32`` recipe is torch's own linear bit for bit.

Under ``torch.autocast`` `linear` does what Transformer Engine does: ``x`` and the bias are cast
to the autocast dtype first, the output comes back in that dtype; inside the Function autocast is
off (the emulated GEMMs are float32 throughout).
"""

from __future__ import annotations

import torch

from fp8lab.nn.buffers import POOL
from fp8lab.nn.operand import Operand, from_forward, gemm, keep_for_backward, prepare
from fp8lab.nn.plan import LinearPlan
from fp8lab.nn.state import ScalingState

__all__ = ["linear"]


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    # low-precision tensors (model.to(bfloat16)) are computed on in float32; autograd casts the
    # float32 gradients back to the inputs' dtypes
    return t if t is None or t.dtype == torch.float32 else t.float()


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, state: ScalingState | None, keep: bool):  # type: ignore[override]
        if not torch.is_autocast_enabled(x.device.type):  # (entering autocast costs ~6 us)
            return _LinearFunction._forward(ctx, x, weight, bias, plan, state, keep)
        with torch.autocast(x.device.type, enabled=False):
            return _LinearFunction._forward(ctx, x, weight, bias, plan, state, keep)

    @staticmethod
    def _forward(ctx, x, weight, bias, plan, state, keep):
        x2 = _float32(x.reshape(-1, x.shape[-1]))
        weight, bias = _float32(weight), _float32(bias)
        held: list[torch.Tensor] = []  # pooled buffers of the forward's operands

        # ---- fprop: y = Q(x) · Q(W)ᵀ (+ b)
        x_op = prepare(x2, plan.fprop["input"], held)
        w_op = prepare(weight, plan.fprop["weight"], held)
        y = gemm(plan.fprop.accumulator, x_op, w_op.t(), bias)

        ctx.plan, ctx.state = plan, state
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        if keep:  # QTensors are not tensors: kept on ctx; their buffers live until backward ends
            ctx.w_kept = keep_for_backward(w_op, plan.dgrad["weight"])
            ctx.x_kept = keep_for_backward(x_op, plan.wgrad["input"])
            ctx.held = held
        else:  # no backward will run: the operands die here
            ctx.w_kept = ctx.x_kept = None
            x_op = w_op = None
            POOL.give(held)
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
        dy2 = _float32(dy.reshape(-1, dy.shape[-1]))
        dx = dw = db = None
        dy_op: Operand | None = None
        held: list[torch.Tensor] = []  # pooled buffers of the backward's operands

        # ---- dgrad: dx = Q(dy) · Q(W)
        if ctx.needs_input_grad[0]:
            dy_op = prepare(dy2, plan.dgrad["grad_output"], held)
            w_op = from_forward(ctx.w_kept, plan.dgrad["weight"], held)
            dx = gemm(plan.dgrad.accumulator, dy_op, w_op).reshape(ctx.x_shape)
            dx = dx if ctx.x_dtype == torch.float32 else dx.to(ctx.x_dtype)
            w_op = None

        # ---- wgrad: dW = (Q(x)ᵀ · Q(dy))ᵀ, the product and layout of torch's linear backward
        if ctx.needs_input_grad[1]:
            g_plan = plan.wgrad["grad_output"]
            if dy_op is not None:
                dy_w = from_forward(keep_for_backward(dy_op, g_plan), g_plan, held)
            else:
                dy_w = prepare(dy2, g_plan, held)
            x_op = from_forward(ctx.x_kept, plan.wgrad["input"], held)
            dw = gemm(plan.wgrad.accumulator, x_op.t(), dy_w).t()
            x_op = dy_w = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)

        # every operand is dead now (outputs and gradients are fresh tensors): recycle buffers
        dy_op = ctx.w_kept = ctx.x_kept = None
        POOL.give(held)
        POOL.give(ctx.held)
        if ctx.state is not None:
            ctx.state.after_backward()  # TE: the gradient role's scales update now
        return dx, dw, db, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    state: ScalingState | None = None,
) -> torch.Tensor:
    """``y = x Wᵀ + b`` under ``plan`` (`fp8lab.nn.plan.build_plan`); x ``[..., in]`` ->
    ``[..., out]``, in x's dtype (the autocast dtype under ``torch.autocast``). ``state``: its
    ``after_backward()`` runs at the end of the backward."""
    device = x.device.type
    if torch.is_autocast_enabled(device):  # TE: cast before quantization, output in this dtype
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    return _LinearFunction.apply(x, weight, bias, plan, state, keep)
