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

Where it applies (the recipe a layer runs under decides, :func:`layer_recipe`): the SwiGLU
product :func:`swiglu` (the lab GPT's MLP, `fp8lab.nn.SmoothSwiGLU` and the experts of
`fp8lab.nn.MoE`) and the lab GPT's norms (each block's two, the q/k norms and the final norm).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fp8lab.nn.context import active_recipe
from fp8lab.nn.linear import Linear
from fp8lab.qtensor import QuantSpec, fake_quant
from fp8lab.recipe import Recipe

__all__ = [
    "SAVED_GROUP",
    "SAVED_SPEC",
    "layer_recipe",
    "save_quantized",
    "saves_quantized",
    "swiglu",
]

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


def layer_recipe(layer: torch.nn.Module) -> Recipe | None:
    """The recipe a layer runs under now: a converted `fp8lab.nn.Linear`'s own, or an
    `fp8lab.nn.autocast` override, with its ``[[layer]]`` rules resolved for the layer's name
    (None: a plain torch layer outside autocast)."""
    own = layer.recipe if isinstance(layer, Linear) else None
    r = active_recipe(own)
    return r if r is None or not r.layers else r.for_layer(getattr(layer, "name", "") or "")


def saves_quantized(recipe: Recipe | None) -> bool:
    """Whether ``recipe`` saves the inputs of nonlinearities in FP8 (``save_activations =
    "quantized"``)."""
    return recipe is not None and recipe.save_activations == "quantized"


def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def swiglu(g: torch.Tensor, u: torch.Tensor, recipe: Recipe | None = None) -> torch.Tensor:
    """``silu(g) * u`` (same shapes); under ``save_activations = "quantized"`` both inputs are
    saved for backward in FP8 (:func:`save_quantized`), the output unchanged."""
    if saves_quantized(recipe):
        return save_quantized(_swiglu, (g, u))
    return _swiglu(g, u)
