"""Inputs of nonlinearities saved for backward in FP8 (the recipe key ``save_activations``).

Autograd keeps the input of every elementwise nonlinearity and norm until the backward pass;
in a Llama-style block those tensors take about half of the activation memory (COAT, Xi et al.,
arXiv 2410.19313, Sec. 5: "non-linear layers" vs linear layers). COAT saves them in FP8 with
per-group scaling (one scale per 1 x G group of the last axis, G = 16 in NVlabs/COAT's
``coat/utils/_fp8_quantization_config.py``), and Megatron-LM's
``activation_func_fp8_input_store`` stores the activation function's input in FP8 likewise.

:func:`save_quantized` runs ``fn`` on the exact inputs in the forward (the output is unchanged)
and keeps only their FP8 quantization (E4M3, current scaling per 1 x 16 group: `SAVED_SPEC`);
the backward recomputes ``fn``'s local derivative at the dequantized inputs. So the forward is
bit for bit the high-precision one, and the gradient differs exactly by evaluating the
derivative at ``Q(x)`` instead of ``x``. Linear inputs are not touched here (``save_for_backward``
keeps its meaning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp8lab.qtensor import QuantSpec, fake_quant

__all__ = ["SAVED_GROUP", "SAVED_SPEC", "save_quantized"]

#: COAT's group size for the inputs of nonlinear layers
SAVED_GROUP = 16
#: how a saved input is quantized: E4M3, one current (max) scale per 1 x 16 group of the last axis
SAVED_SPEC = QuantSpec("e4m3", granularity=(1, SAVED_GROUP), scaling="max")


def _quantized(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` as saved: quantized under ``spec`` over its last axis, dequantized (float32)."""
    flat = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    return fake_quant(flat.to(torch.float32), spec).reshape(x.shape).to(x.dtype)


class _SaveQuantized(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, spec: QuantSpec, n_q: int, *args: torch.Tensor) -> Any:
        ctx.fn, ctx.n_q = fn, n_q
        saved = [_quantized(a, spec) for a in args[:n_q]] + [a.detach() for a in args[n_q:]]
        ctx.save_for_backward(*saved)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            ins = [s.detach().requires_grad_(n) for s, n in zip(saved, needs, strict=True)]
            out = ctx.fn(*ins)
            wanted = [t for t, n in zip(ins, needs, strict=True) if n]
            got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, None, *(next(got) if n else None for n in needs))


def save_quantized(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    spec: QuantSpec = SAVED_SPEC,
) -> torch.Tensor:
    """``fn(*inputs, *params)`` whose backward sees ``inputs`` as saved in FP8 under ``spec``
    (module doc); ``params`` (norm weights...) are saved as they are. ``fn`` must be a pure
    function of its arguments, returning one tensor."""
    return _SaveQuantized.apply(fn, spec, len(inputs), *inputs, *params)
