"""Smooth-SwiGLU (Fishman et al., "Scaling FP8 training to trillion-token LLMs", arXiv 2409.12517).

With SwiGLU, ``h = silu(gate(x)) * up(x)``, the gate and linear weight vectors of a channel
align over long training (weight decay drives them to it), and the product grows roughly
quadratically in their norm: a few channels of ``h`` then carry outliers that one per-tensor
scale of the down projection's input cannot cover. Smooth-SwiGLU scales each channel ``i`` of
``h`` by ``s_i`` before the down projection quantizes it and folds ``s_i^-1`` into the down
projection's weight column ``i``, so the function is unchanged in exact arithmetic:

    y = down(h) = (W_down · diag(s^-1)) · (s ⊙ h)

Here ``s_i`` is the power of two that brings the channel's largest magnitude over the current
batch into [0.5, 1) (``s_i = 1`` for an all-zero channel), computed without gradient: powers of
two make both rescalings exact in binary floating point, so only the quantization sees them.
(The paper's equation scales the channel before the quantizer ``Q`` and undoes it after it,
``s^-1 Q(s h)``; here ``s^-1`` is folded into the down projection's weight columns, the form a
GEMM with one scale per operand can run. The weight's quantization then sees those columns
scaled: the range problem moves from the activation, where it grows over training, to the
weight, where an outlier channel's column is as large as that channel's activation was.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from fp8lab.nn.saved_activations import layer_recipe, swiglu

__all__ = ["SmoothSwiGLU", "smooth_scales"]


def smooth_scales(h: torch.Tensor) -> torch.Tensor:
    """Per-channel powers of two ``s`` [C] for ``h`` [..., C]: ``max|s_i h[..., i]|`` in
    [0.5, 1); 1 where a channel is all zeros (or not finite)."""
    amax = h.detach().abs().reshape(-1, h.shape[-1]).amax(0).float()
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1)
    s = torch.ldexp(torch.ones_like(amax), -exp)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, s, torch.ones_like(s))


class SmoothSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with per-channel smoothing before ``down`` (module doc).

    ``gate``, ``up`` ``[d_ff, d_model]`` and ``down`` ``[d_model, d_ff]`` are bias-free
    ``torch.nn.Linear`` (``fp8lab.nn.convert`` swaps them like any other), named as in a plain
    SwiGLU so weights load across the two."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under save_activations = "quantized" the product's inputs are saved in FP8
        h = swiglu(self.gate(x), self.up(x), layer_recipe(self.gate))
        s = smooth_scales(h).to(h.dtype)
        # the same module (its recipe, scaling state, name) with the weight W · diag(s^-1)
        w = self.down.weight / s
        return functional_call(self.down, {"weight": w}, (h * s,))
