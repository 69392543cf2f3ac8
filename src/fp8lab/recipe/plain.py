"""Plain data (TOML/JSON tables) -> `Recipe`, type-checked key by key.

Every error is a `RecipeFileError` naming where the data came from (a file), the table
(``[top level]``, ``[input]``, ``[input.scaling.delayed]``, ``[fprop.accumulator]``,
``[dgrad.overrides.grad_output]``...) and the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fp8lab._keys import check_keys
from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe.config import (
    GEMMS,
    ROLES,
    GemmConfig,
    RecipeFileError,
    _spec,
    check_operand_source,
)
from fp8lab.recipe.dpa import DPAConfig
from fp8lab.recipe.layers import LayerRule, deep_merge, preset
from fp8lab.recipe.moe import MoEConfig
from fp8lab.recipe.shorthands import hp_last_from_plain
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

__all__ = ["recipe_from_plain"]

#: the per-moment optimizer-state keys (Megatron's names), exclusive with optimizer_state
_PER_MOMENT = ("exp_avg_dtype", "exp_avg_sq_dtype")

# expected plain-data types per key: TOML/JSON values (objects built in Python pass too)
_NUMBER = (int, float)
_TYPE_NAMES = {str: "a string", bool: "a bool (true/false)", int: "an integer", float: "a number"}


def _plain_types(cls: type, overrides: Mapping[str, tuple[type, ...]]) -> dict[str, tuple]:
    """Key -> accepted types of a frozen dataclass's plain form: ``overrides``, else the type of
    the field's default (a float field takes ints too; a None default is not checked)."""
    out: dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            out[f.name] = overrides[f.name]
            continue
        d = f.default
        if isinstance(d, bool | int | str):
            out[f.name] = (type(d),)
        elif isinstance(d, float):
            out[f.name] = _NUMBER
    return out


def _what(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, "a table" if t is Mapping else t.__name__) for t in types)


def _check_table(
    d: Any, types: Mapping[str, tuple], known: Any, what: str, where: str, table: str
) -> None:
    """Unknown keys (`check_keys`) and each known key's type, errors naming where/table/key."""
    if not isinstance(d, Mapping):
        raise RecipeFileError(f"{where}: [{table}] must be a table, got {d!r}")
    try:
        check_keys(d, known, what)
    except ValueError as exc:
        raise RecipeFileError(f"{where}: [{table}] {exc}") from None
    for key, v in d.items():
        t = types.get(key)
        # bool is an int in Python: an int key must not take true/false, nor a number key
        ok = t is None or (isinstance(v, t) and not (isinstance(v, bool) and bool not in t))
        if not ok:
            raise RecipeFileError(
                f"{where}: [{table}] key {key!r}: expected {_what(t)}, got {v!r} "
                f"({type(v).__name__})"
            )


def _build(where: str, table: str, make: Any, *args: Any) -> Any:
    """``make(*args)`` with a constructor's ValueError/TypeError prefixed by where and table."""
    try:
        return make(*args)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, RecipeFileError):
            if str(exc).startswith(where):
                raise
            raise RecipeFileError(f"{where}: {exc}") from None  # e.g. a [[layer]] rule's check
        raise RecipeFileError(f"{where}: [{table}] {exc}") from None


def _granularity_ok(g: Any) -> bool:
    return isinstance(g, str) or (
        isinstance(g, list | tuple)
        and len(g) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in g)
    )


def _spec_from_plain(v: Any, where: str, table: str) -> Any:
    """A role or override entry: a format name, a QuantSpec, or a type-checked spec table."""
    if v is None or isinstance(v, str | QuantSpec):
        return _build(where, table, _spec, v, table)
    types = _plain_types(
        QuantSpec,
        {
            "granularity": (str, list, tuple),
            "scaling": (str, *_NUMBER, Mapping, DelayedScalingConfig, DelayedScaling),
            "rounding": (str,),
            "four_over_six": (str,),
            "four_over_six_use_256": (bool,),
            "hadamard": (int,),
        },
    )
    known = [f.name for f in dataclasses.fields(QuantSpec)]
    _check_table(v, types, known, "QuantSpec", where, table)
    if "granularity" in v and not _granularity_ok(v["granularity"]):
        raise RecipeFileError(
            f"{where}: [{table}] key 'granularity': expected a name or [rows, cols], "
            f"got {v['granularity']!r}"
        )
    sc = v.get("scaling")
    if isinstance(sc, Mapping):
        _check_table(sc, {"delayed": (Mapping,)}, ["delayed"], "scaling", where, f"{table}.scaling")
        types = _plain_types(DelayedScalingConfig, {})
        known = [f.name for f in dataclasses.fields(DelayedScalingConfig)]
        t = f"{table}.scaling.delayed"
        _check_table(sc.get("delayed", {}), types, known, "DelayedScaling", where, t)
    return _build(where, table, _spec, dict(v), table)


def _gemm_from_plain(v: Any, where: str, g: str) -> GemmConfig:
    if isinstance(v, GemmConfig):
        return v
    types = {"accumulator": (str, Mapping, Accumulator), "high_precision": (str,)}
    types["overrides"] = (Mapping,)
    types["high_precision_roles"] = (Mapping,)
    types["operand_source"] = (str, Mapping)
    _check_table(v, types, types, "GemmConfig", where, g)
    acc = v.get("accumulator")
    if isinstance(acc, Mapping):
        at = _plain_types(Accumulator, {})
        known = [f.name for f in dataclasses.fields(Accumulator)]
        _check_table(acc, at, known, "Accumulator", where, f"{g}.accumulator")
    acc = _build(where, f"{g}.accumulator", Accumulator.parse, acc)
    ov = v.get("overrides", {})
    _check_table(ov, {}, ROLES, "override role", where, f"{g}.overrides")
    overrides = {r: _spec_from_plain(s, where, f"{g}.overrides.{r}") for r, s in ov.items()}
    cells = v.get("high_precision_roles", {})
    cell_types = dict.fromkeys(ROLES, (str,))
    _check_table(cells, cell_types, ROLES, "role", where, f"{g}.high_precision_roles")
    src = v.get("operand_source", "auto")
    if isinstance(src, Mapping):
        _check_table(src, cell_types, ROLES, "role", where, f"{g}.operand_source")
        src = dict(src)
    cfg = _build(where, g, GemmConfig, acc, v.get("high_precision"), overrides, cells, src)
    return _build(where, g, check_operand_source, g, cfg)


def recipe_from_plain(cls: type, d: Any, where: str) -> Any:
    """``cls(**d)`` (``cls`` is `Recipe`) with every table and key checked, errors naming
    where/table/key. ``base = "PRESET"`` starts from that preset's plain data (the file's keys
    are merged over it: `fp8lab.recipe.layers.deep_merge`); ``layer`` is the list of
    ``[[layer]]`` tables (`fp8lab.recipe.layers.LayerRule`)."""
    if isinstance(d, Mapping):
        both = [k for k in _PER_MOMENT if k in d]
        if both and "optimizer_state" in d:
            raise RecipeFileError(
                f"{where}: [top level] keys 'optimizer_state' and {', '.join(map(repr, both))}: "
                "give either optimizer_state (both moments) or the per-moment dtypes, not both"
            )
    if isinstance(d, Mapping) and "base" in d:
        d = _inherit(d, where)
    types = _plain_types(
        cls,
        {
            **{r: (str, Mapping, QuantSpec) for r in ROLES},
            **{g: (Mapping, GemmConfig) for g in GEMMS},
            "loss_scale": _NUMBER,
            "layer": (list, tuple),
            "moe": (Mapping, MoEConfig),
            "dpa": (Mapping, DPAConfig),
            "exp_avg_dtype": (str,),
            "exp_avg_sq_dtype": (str,),
            "hp_last_blocks": (int, str, type(None)),  # "auto" (TOML) or null (JSON): None
        },
    )
    fields = [f.name for f in dataclasses.fields(cls) if f.name not in ("layers", "path")]
    known = [*fields, "layer"]
    _check_table(d, types, known, "Recipe", where, "top level")
    kw = dict(d)
    if "hp_last_blocks" in kw:
        kw["hp_last_blocks"] = hp_last_from_plain(kw["hp_last_blocks"])
    for r in ROLES:
        if r in kw:
            kw[r] = _spec_from_plain(kw[r], where, r)
    for g in GEMMS:
        if g in kw:
            kw[g] = _gemm_from_plain(kw[g], where, g)
    if "moe" in kw and not isinstance(kw["moe"], MoEConfig):
        types = _plain_types(MoEConfig, {})
        known = [f.name for f in dataclasses.fields(MoEConfig)]
        _check_table(kw["moe"], types, known, "moe", where, "moe")
        kw["moe"] = _build(where, "moe", MoEConfig.from_dict, kw["moe"])
    if "dpa" in kw and not isinstance(kw["dpa"], DPAConfig):
        types = _plain_types(DPAConfig, {})
        known = [f.name for f in dataclasses.fields(DPAConfig)]
        _check_table(kw["dpa"], types, known, "dpa", where, "dpa")
        kw["dpa"] = _build(where, "dpa", DPAConfig.from_dict, kw["dpa"])
    if "layer" in kw:
        kw["layers"] = tuple(
            _build(where, f"[layer] {i}", LayerRule.from_dict, t)
            for i, t in enumerate(kw.pop("layer"), 1)
        )
    return _build(where, "top level", lambda: cls(**kw))


def _inherit(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``d`` written over the plain data of its ``base`` preset (name and prose: the file's,
    else ``BASE-custom`` and the preset's source)."""
    base = d["base"]
    if not isinstance(base, str):
        raise RecipeFileError(
            f"{where}: [top level] key 'base': expected a preset name, got {base!r}"
        )
    b = _build(where, "top level key 'base':", preset, base).to_dict()
    b["name"] = f"{base}-custom"
    b["description"] = f"the {base} preset with this file's changes"
    if any(k in d for k in _PER_MOMENT):  # the file's per-moment dtypes replace the base's
        b.pop("optimizer_state", None)
    return deep_merge(b, {k: v for k, v in d.items() if k != "base"})
