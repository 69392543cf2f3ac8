"""Remedies for a culprit and their ``relative_cost`` (a documented proxy).

A remedy changes the culprit role on the culprit layers only:

- ``current-scaling``: the operand's delayed (or fixed) scale replaced by current scaling;
- ``finer-granularity``: per-tensor -> 1x128 tiles (128x128 blocks for weights), 128-blocks ->
  MX 1x32 blocks;
- ``e5m2-gradients``: the gradient operand in E5M2 (for ``grad_output`` only);
- ``high-precision-cells``: the culprit GEMM's operand in high precision;
- ``high-precision-role``: the operand in high precision in every GEMM it feeds (the probe that
  confirmed the culprit layers);
- ``shorter-history``: the operand's delayed-scaling amax history cut to
  `fp8lab.lab.debug.kinds.SHORT_HISTORY` steps (TE's default keeps 1024), tried only where the
  run's records show the operand's amax fell gradually (`fp8lab.lab.debug.kinds.amax_fell`):
  the history then holds an old maximum and the scale stays too small;
- ``last-blocks-high-precision``: every GEMM of the blocks from the first culprit block to the
  last in high precision (the NVFP4 recipe's last blocks in BF16, NVIDIA arXiv 2509.25149), tried
  for a 4-bit operand whose culprit layers reach the last block.

The culprit kinds other than an operand have one remedy each, their probe
(`fp8lab.lab.debug.kinds`): ``dynamic-loss-scaling`` (``loss_scale``),
``norm-weights-high-precision`` (``norm_weight``), ``attention-high-precision``
(``attention``).

``relative_cost`` (no hardware cost model yet, so a proxy; docs/debug.md): the share of the
model's converted GEMM FLOPs the remedy moves to high precision (a GEMM with one operand in
high precision cannot run on FP8 tensor cores) plus the change in quantization passes per step
relative to R's, counted in elements read: each operand cast to a low-precision format (FP8,
or bf16/fp16 for a high-precision operand) costs one pass, plus one more for per-tensor
current scaling (its amax is a separate reduction before the cast: delayed scaling exists to
avoid it); an operand reused from an earlier GEMM costs nothing, a re-tiled one one pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fp8lab.recipe import GEMMS, Recipe

#: remedy names, in the order they are tried
REMEDIES = ("current-scaling", "finer-granularity", "e5m2-gradients", "high-precision-cells",
            "high-precision-role", "shorter-history", "last-blocks-high-precision",
            "dynamic-loss-scaling", "norm-weights-high-precision",
            "attention-high-precision")  # fmt: skip


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
    *,
    fell: Sequence[str] = (),
    all_layers: Sequence[str] = (),
) -> dict[str, Recipe]:
    """The applicable remedies (name -> variant recipe) for ``role`` on ``layers``; a remedy
    that changes nothing (the operand already uses it) is left out. ``high-precision-role`` is
    not built here: the confirming probe is that variant. ``fell``: the culprit layers whose
    amax fell (`fp8lab.lab.debug.kinds.amax_fell`; ``shorter-history`` is tried on them);
    ``all_layers``: the model's converted layers (``last-blocks-high-precision``)."""
    from fp8lab.lab.debug.kinds import SHORT_HISTORY, last_blocks
    from fp8lab.lab.debug.variants import (
        all_hp,
        current_scaling,
        e5m2_gradients,
        finer_granularity,
        per_layer,
        shorter_history,
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
    fallen = [x for x in layers if x in set(fell)]
    if fallen:
        v = per_layer(recipe, fallen, lambda r: shorter_history(r, (role,), SHORT_HISTORY),
                      f"{recipe.name}+shorter-history")  # fmt: skip
        if v.fingerprint() != recipe.fingerprint():
            out["shorter-history"] = v
    spec = [recipe.for_layer(x).spec(gemm or ROLE_GEMM[role], role) for x in layers]
    tail = last_blocks(all_layers, layers)
    if tail and any(s is not None and s.format == "e2m1" for s in spec):
        out["last-blocks-high-precision"] = per_layer(
            recipe, tail, lambda r: all_hp(r, precision), f"{recipe.name}+last-blocks-hp"
        )
    return out


#: a GEMM each role feeds (to read its spec when no culprit GEMM is known)
ROLE_GEMM = {"input": "fprop", "weight": "fprop", "grad_output": "dgrad"}
