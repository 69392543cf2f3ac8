"""Straight-through gradients for the rounding functions (`fp8lab.cast`, `fake_quant`,
`QTensor.dequantize`).

Rounding onto a grid has a zero derivative almost everywhere; quantization-aware training uses
the straight-through estimator instead (Bengio, Léonard and Courville, arXiv 1308.3432): the
backward pass treats the rounding as the identity. ``torch.fake_quantize_per_tensor_affine`` does
the same inside its clamping range (it zeroes the gradient of clamped elements); fp8lab passes the
gradient of saturated elements too, as torchao's float8 training casts do
(``torchao/float8/float8_training_tensor.py``, ``_ToFloat8ConstrFunc``: "backward: pass the
gradient without changes").
"""

from __future__ import annotations

import torch

__all__ = ["straight_through"]


class _StraightThrough(torch.autograd.Function):
    """Forward: the precomputed rounded tensor; backward: the gradient unchanged to the source."""

    @staticmethod
    def forward(ctx, source, result):  # type: ignore[override]
        ctx.dtype = source.dtype
        ctx.shape = source.shape
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.reshape(ctx.shape).to(ctx.dtype), None


def straight_through(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` (``source``'s number of elements) carrying ``source``'s gradient straight
    through when ``source`` requires grad and grad mode is on; else ``result`` itself (no
    autograd cost on the no-grad path)."""
    if source.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(source, result)
    return result
