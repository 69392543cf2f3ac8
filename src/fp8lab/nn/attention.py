"""`attention_matmul`: attention's two matmuls (``q kᵀ`` and ``p v``) under a recipe."""

from __future__ import annotations

import torch

from fp8lab.nn.context import active_recipe
from fp8lab.qtensor import QuantSpec, quantize
from fp8lab.recipe import Recipe

__all__ = ["attention_matmul"]


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


@torch.compiler.disable
def attention_matmul(
    a: torch.Tensor, b: torch.Tensor, recipe: Recipe | None = None
) -> torch.Tensor:
    """``a @ b`` for attention's two matmuls (``q kᵀ`` and ``p v``), quantized when the recipe
    says so (``recipe.attention``, off by default like TE's ``fp8_dpa``).

    ``recipe=None`` uses the innermost :func:`fp8lab.nn.autocast` recipe (no autocast: plain
    matmul). Operands use the recipe's ``input`` spec and the incoming gradient its
    ``grad_output`` spec, each quantized as a ``[..., last dim]`` tensor with current scaling
    (delayed specs fall back to current scaling: attention operands keep no state). Float32
    operands; the result is float32 ``[..., M, N]`` for ``a [..., M, K]``, ``b [..., K, N]``.
    """
    if recipe is None:
        recipe = active_recipe()
    if recipe is None or not recipe.attention:
        return torch.matmul(a, b)
    return _AttentionMatmul.apply(
        a.contiguous(),
        b.contiguous(),
        _stateless(recipe.input),
        _stateless(recipe.grad_output),
    )
