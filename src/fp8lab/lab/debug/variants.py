"""Counterfactual recipes: the recipe under debug with something changed on some layers.

Every variant is built the same way: for each chosen layer, ``fn(recipe.for_layer(layer))``
gives the recipe that layer should run, and the difference is written as per-layer rules
(``fp8lab.recipe.LayerRule``: exact module names, only the keys that change). The result is
checked layer by layer (``variant.for_layer(layer)`` has the intended numerics), so a variant
is exactly what it claims whatever rules the recipe already had.

Cells are ``(gemm, role)`` pairs of a converted Linear: fprop (input, weight), dgrad
(grad_output, weight), wgrad (grad_output, input).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fp8lab.recipe import GEMM_OPERANDS, GEMMS, ROLES, Recipe
from fp8lab.recipe.layers import LAYER_KEYS

#: every (gemm, role) cell of a Linear, in screening order
CELLS: tuple[tuple[str, str], ...] = tuple((g, r) for g in GEMMS for r, _ in GEMM_OPERANDS[g])
#: the GEMMs an operand role feeds
ROLE_GEMMS: dict[str, tuple[str, ...]] = {
    r: tuple(g for g in GEMMS if r in dict(GEMM_OPERANDS[g])) for r in ROLES
}


def converted_layers(model: torch.nn.Module) -> list[str]:
    """Qualified names of the converted (``fp8lab.nn.Linear``) layers, in module order."""
    from fp8lab.nn import Linear

    return [n for n, m in model.named_modules() if isinstance(m, Linear)]


def hp_precision(baseline: Recipe) -> str:
    """The precision a switched cell runs in: the baseline's, when all its GEMMs share one
    high precision (bf16 for the bf16 baseline, fp32 for fp32), else bf16."""
    hps = {baseline.gemm(g).high_precision for g in GEMMS}
    return hps.pop() if len(hps) == 1 and None not in hps else "bf16"


def _plain(recipe: Recipe) -> dict[str, Any]:
    d = recipe.to_dict()
    return {k: d[k] for k in LAYER_KEYS if k in d}


def _diff(
    old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = ""
) -> tuple[dict[str, Any], list[str]]:
    """``(changes, removed)``: the keys of ``new`` that differ from ``old`` (recursively) and the
    dotted paths of the keys of ``old`` that ``new`` drops (a rule's ``reset``: a deep merge
    cannot express a removal, e.g. fake quantization's fp32 accumulator has no
    ``promote_every``)."""
    out: dict[str, Any] = {}
    removed = [f"{prefix}{k}" for k in old if k not in new]
    for k, v in new.items():
        o = old.get(k)
        if isinstance(v, Mapping) and isinstance(o, Mapping):
            d, r = _diff(o, v, f"{prefix}{k}.")
            removed += r
            if d:
                out[k] = d
        elif v != o:
            out[k] = v
    return out, removed


def per_layer(
    recipe: Recipe, layers: Iterable[str], fn: Callable[[Recipe], Recipe], name: str
) -> Recipe:
    """``recipe`` with each of ``layers`` running ``fn(recipe.for_layer(layer))``, as layer
    rules appended to the recipe's own (layers with equal changes share one rule). RuntimeError
    naming the layer when a rule does not give the intended recipe."""
    from fp8lab.recipe import LayerRule

    groups: dict[str, list[str]] = {}
    rule_of: dict[str, tuple[dict[str, Any], list[str]]] = {}
    wanted: dict[str, Recipe] = {}
    for layer in layers:
        old = recipe.for_layer(layer)
        new = fn(old)
        wanted[layer] = new
        if new.fingerprint() == old.fingerprint():
            continue
        d, removed = _diff(_plain(old), _plain(new))
        key = json.dumps([d, removed], sort_keys=True)
        groups.setdefault(key, []).append(layer)
        rule_of[key] = (d, removed)
    rules = [
        LayerRule(match=tuple(ls), changes=rule_of[k][0], reset=tuple(rule_of[k][1]))
        for k, ls in groups.items()
    ]
    out = recipe.with_layers(*rules).replace(name=name) if rules else recipe.replace(name=name)
    for layer, new in wanted.items():
        got = out.for_layer(layer)
        if got.fingerprint() != new.fingerprint():
            raise RuntimeError(f"variant {name}: layer {layer} does not run the intended recipe")
    return out


def with_cells_hp(recipe: Recipe, cells: Iterable[tuple[str, str]], precision: str) -> Recipe:
    """``recipe`` (one layer's) with each ``(gemm, role)`` operand in high precision."""
    import dataclasses

    for g, r in cells:
        if recipe.gemm(g).high_precision is None and recipe.spec(g, r) is not None:
            try:
                recipe = recipe.with_cell_high_precision(g, r, precision)
            except ValueError:
                # a GEMM whose operands must be quantized together (a random Hadamard
                # transform on both wgrad operands, rht_gemms): the whole GEMM instead
                cfg = dataclasses.replace(recipe.gemm(g), high_precision=precision,
                                          high_precision_roles=())  # fmt: skip
                recipe = dataclasses.replace(recipe, **{g: cfg})
    return recipe


def cells_hp(
    recipe: Recipe,
    cells: Mapping[str, Sequence[tuple[str, str]]],
    precision: str,
    name: str,
) -> Recipe:
    """Variant: ``cells[layer]`` in high precision on each layer (layers with the same cells
    share one rule)."""
    by_set: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for layer, cs in cells.items():
        by_set.setdefault(tuple(sorted(cs)), []).append(layer)
    out = recipe.replace(name=name)
    for cs, layers in by_set.items():
        out = per_layer(out, layers, lambda r, _cs=cs: with_cells_hp(r, _cs, precision), name)
    return out


def _map_specs(recipe: Recipe, roles: Iterable[str], fn: Callable[[str, Any], Any]) -> Recipe:
    """``recipe`` with ``fn(role, spec)`` applied to each of ``roles``' specs (the role's and
    its GEMM overrides)."""
    import dataclasses

    roles = tuple(roles)
    ch: dict[str, Any] = {}
    for r in roles:
        s = getattr(recipe, r)
        if s is not None:
            ch[r] = fn(r, s)
    for g in GEMMS:
        cfg = recipe.gemm(g)
        if any(r in roles for r, _ in cfg.overrides):
            ov = {r: (fn(r, s) if r in roles else s) for r, s in cfg.overrides}
            ch[g] = dataclasses.replace(cfg, overrides=ov)
    return recipe.replace(**ch) if ch else recipe


def is_current(spec: Any) -> bool:
    """Per-tensor or block scaling computed from the tensor itself (not delayed, not fixed)."""
    return isinstance(spec.scaling, str)


def current_scaling(recipe: Recipe, roles: Iterable[str] = ROLES) -> Recipe:
    """Delayed or fixed scales of ``roles`` replaced by current scaling (amax of the tensor
    itself; block granularities keep their block rule)."""

    def fn(role, s):
        return s if is_current(s) else s.replace(scaling="max")

    return _map_specs(recipe, roles, fn)


def finer_granularity(recipe: Recipe, roles: Iterable[str]) -> Recipe:
    """``roles`` one step finer: per-tensor -> 1x128 tiles (128x128 blocks for weights) with
    current scaling; 128-blocks -> MX 1x32 blocks (E4M3 elements, rceil E8M0 scales)."""

    def fn(role, s):
        block = s.block
        if block == (-1, -1):
            gran = (128, 128) if role == "weight" else (1, 128)
            return s.replace(granularity=gran, scaling="max")
        if s.granularity in ("mx", "nvfp4") or min(b for b in block if b > 0) <= 32:
            return s
        return s.replace(format="e4m3", granularity="mx", scaling="mx_rceil")

    return _map_specs(recipe, roles, fn)


def e5m2_gradients(recipe: Recipe) -> Recipe:
    """The gradient operand in E5M2 (wider range, one mantissa bit less), scaling kept."""

    def fn(role, s):
        if s.format == "e5m2":
            return s
        # the NVFP4-only options (a Hadamard transform, 4/6 scale selection) leave with E2M1
        nvfp4_only = {"rht": False, "four_over_six": None, "four_over_six_use_256": None}
        return s.replace(format="e5m2", **{k: v for k, v in nvfp4_only.items()
                                           if getattr(s, k, v) != v})  # fmt: skip

    if getattr(recipe, "rht_gemms", "none") != "none":
        return recipe  # the Hadamard transform needs both wgrad operands in NVFP4: not applicable
    return _map_specs(recipe, ("grad_output",), fn)


def fake_quant(recipe: Recipe) -> Recipe:
    """Deprecated alias of :func:`fake_quant_recipe` (``fake_quant`` is the quantize-dequantize
    function of `fp8lab.qtensor`)."""
    import warnings

    warnings.warn("fp8lab.lab.debug.variants.fake_quant is deprecated: use fake_quant_recipe",
                  DeprecationWarning, stacklevel=2)  # fmt: skip
    return fake_quant_recipe(recipe)


def fake_quant_recipe(recipe: Recipe) -> Recipe:
    """The fake-quantization recipe of ``recipe``: operands on the same grids (format, blocks, rounding) with current
    scaling, every GEMM accumulated in fp32 (the sim then runs an fp32 GEMM of the dequantized
    operands)."""
    from fp8lab.gemm import Accumulator

    r = current_scaling(recipe)
    return r.with_accumulator(Accumulator(), *GEMMS)


def layer_dims(model: torch.nn.Module, layers: Iterable[str]) -> dict[str, tuple[int, int]]:
    """``{layer: (in_features, out_features)}`` of converted layers."""
    return {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features)
            for n in layers}  # fmt: skip


def shorter_history(recipe: Recipe, roles: Iterable[str], length: int) -> Recipe:
    """Delayed scaling of ``roles`` with an amax history of ``length`` steps (at most: a
    shorter one is kept); other scalings unchanged."""
    import dataclasses

    from fp8lab.scaling.delayed import DelayedScalingConfig

    def fn(role, s):
        sc = s.scaling
        if not isinstance(sc, DelayedScalingConfig) or sc.history_len <= length:
            return s
        return s.replace(scaling=dataclasses.replace(sc, history_len=length))

    return _map_specs(recipe, roles, fn)


#: where the dynamic loss scaler starts (torch.amp.GradScaler's and Megatron-LM's default 2^16
#: would do too; a static scale below it is raised to it: the scaler grows only every 2000 steps)
DYNAMIC_START = 2.0**16


def dynamic_loss_scaling(recipe: Recipe) -> Recipe:
    """The loss scaler made dynamic (grows after a run of finite steps, halves and skips on an
    overflow; `fp8lab.optim.LossScaler`), starting from the larger of the recipe's
    ``loss_scale`` and :data:`DYNAMIC_START`."""
    if recipe.loss_scaling == "dynamic":
        return recipe
    return recipe.replace(loss_scaling="dynamic", loss_scale=max(recipe.loss_scale, DYNAMIC_START))


def norm_weights_hp(recipe: Recipe) -> Recipe:
    """The norms' affine parameters in high precision (``norm_weights = "high_precision"``)."""
    return recipe.replace(norm_weights="high_precision")


def attention_hp(recipe: Recipe) -> Recipe:
    """Attention in high precision (``attention = false``; its ``[dpa]`` options dropped)."""
    if not recipe.attention and not any(r.changes.get("attention") for r in recipe.layers):
        return recipe
    d = recipe.to_dict()
    d.pop("dpa", None)
    d["attention"] = False
    for rule in d.get("layer", []):  # a rule's attention options go with it
        rule.pop("dpa", None)
        rule.pop("attention", None)
    return Recipe.from_dict(d, where=f"{recipe.name} without FP8 attention")


def all_hp(recipe: Recipe, precision: str) -> Recipe:
    """Every operand of every GEMM in high precision (one layer's recipe)."""
    return with_cells_hp(recipe, [(g, r) for r in ROLES for g in ROLE_GEMMS[r]], precision)
