"""Remedies for a culprit and their ``relative_cost`` (a documented proxy).

A remedy changes the culprit role on the culprit layers only:

- ``current-scaling``: the operand's delayed (or fixed) scale replaced by current scaling;
- ``finer-granularity``: per-tensor -> 1x128 tiles (128x128 blocks for weights), 128-blocks ->
  MX 1x32 blocks;
- ``e5m2-gradients``: the gradient operand in E5M2 (for ``grad_output`` only);
- ``high-precision-cells``: the culprit GEMM's operand in high precision;
- ``high-precision-role``: the operand in high precision in every GEMM it feeds (the probe that
  confirmed the culprit layers).

``relative_cost`` (no hardware cost model yet, so a proxy; docs/debug.md): the share of the
model's converted GEMM FLOPs the remedy moves to high precision (a GEMM with one operand in
high precision cannot run on FP8 tensor cores) plus the change in quantization passes per step
relative to R's, counted in elements read: each operand cast to a low-precision format (FP8,
or bf16/fp16 for a high-precision operand) costs one pass, plus one more for per-tensor
current scaling (its amax is a separate reduction before the cast: delayed scaling exists to
avoid it); an operand reused from an earlier GEMM costs nothing, a re-tiled one one pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp8lab.recipe import GEMMS, Recipe

#: remedy names, in the order they are tried
REMEDIES = ("current-scaling", "finer-granularity", "e5m2-gradients", "high-precision-cells",
            "high-precision-role")  # fmt: skip


def _operand_elems(role: str, tokens: int, fin: int, fout: int) -> int:
    return {"input": tokens * fin, "weight": fin * fout, "grad_output": tokens * fout}[role]


def layer_cost(recipe: Recipe, tokens: int, fin: int, fout: int) -> tuple[float, float, float]:
    """(high-precision GEMM FLOPs, total GEMM FLOPs, quantization passes in elements) of one
    Linear ``[fout, fin]`` running ``recipe`` on ``tokens`` rows."""
    from fp8lab.nn.plan import Reuse, build_plan
    from fp8lab.nn.state import ScalingState

    plan = build_plan(recipe, ScalingState(recipe), None)
    flops = 2.0 * tokens * fin * fout  # each of the three GEMMs
    hp = 0.0
    passes = 0.0
    for g in GEMMS:
        gp = getattr(plan, g)
        if any(op.high_precision is not None for op in gp.operands) or not any(
            op.quantized for op in gp.operands
        ):
            hp += flops
        for op in gp.operands:
            if op.reuse is Reuse.SAME:
                continue
            n = _operand_elems(op.role, tokens, fin, fout)
            if op.high_precision not in (None, "fp32"):
                passes += n  # rounded to bf16/fp16: a cast pass as well
            # a high-precision cell whose quantization a later GEMM still takes (its shadow)
            spec = op.spec if op.quantized else op.shadow
            if spec is None:
                continue
            passes += n
            per_tensor = tuple(spec.block) == (-1, -1)
            if op.reuse is not Reuse.RETILE and per_tensor and isinstance(spec.scaling, str):
                passes += n  # the amax reduction of per-tensor current scaling
    return hp, 3 * flops, passes


def model_cost(
    recipe: Recipe, dims: Mapping[str, tuple[int, int]], tokens: int
) -> tuple[float, float, float]:
    """:func:`layer_cost` summed over the converted layers ``dims`` (name -> (in, out))."""
    hp = total = passes = 0.0
    for name, (fin, fout) in dims.items():
        h, t, p = layer_cost(recipe.for_layer(name), tokens, fin, fout)
        hp, total, passes = hp + h, total + t, passes + p
    return hp, total, passes


def relative_cost(
    variant: Recipe, recipe: Recipe, dims: Mapping[str, tuple[int, int]], tokens: int
) -> float:
    """Share of GEMM FLOPs ``variant`` moves to high precision relative to ``recipe``, plus its
    extra quantization passes relative to ``recipe``'s (see the module doc)."""
    hp_v, total, pass_v = model_cost(variant, dims, tokens)
    hp_r, _, pass_r = model_cost(recipe, dims, tokens)
    moved = (hp_v - hp_r) / total if total else 0.0
    extra = (pass_v - pass_r) / pass_r if pass_r else 0.0
    return moved + extra


def remedy_variants(
    recipe: Recipe,
    role: str,
    gemm: str | None,
    layers: list[str],
    precision: str,
) -> dict[str, Recipe]:
    """The applicable remedies (name -> variant recipe) for ``role`` on ``layers``; a remedy
    that changes nothing (the operand already uses it) is left out. ``high-precision-role`` is
    not built here: the confirming probe is that variant."""
    from fp8lab.lab.debug.variants import (
        current_scaling,
        e5m2_gradients,
        finer_granularity,
        per_layer,
        with_cells_hp,
    )

    fns: dict[str, Any] = {
        "current-scaling": lambda r: current_scaling(r, (role,)),
        "finer-granularity": lambda r: finer_granularity(r, (role,)),
    }
    if role == "grad_output":
        fns["e5m2-gradients"] = e5m2_gradients
    if gemm is not None:
        fns["high-precision-cells"] = lambda r: with_cells_hp(r, [(gemm, role)], precision)
    out = {}
    for name, fn in fns.items():
        if all(fn(recipe.for_layer(x)).fingerprint() == recipe.for_layer(x).fingerprint()
               for x in layers):  # fmt: skip
            continue
        out[name] = per_layer(recipe, layers, fn, f"{recipe.name}+{name}")
    return out
