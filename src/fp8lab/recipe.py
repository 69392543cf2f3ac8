"""Training recipes: which tensor is quantized how, and how each GEMM of a Linear layer runs.

A `Recipe` is frozen, printable data that round-trips through TOML and JSON. It describes:

* per tensor **role** -- ``input`` (activation), ``weight``, ``grad_output`` -- a `QuantSpec`
  (format, granularity, scaling rule or delayed-scaling *configuration*, rounding), or ``None``
  (kept fp32);
* per **GEMM** of a linear layer (NVIDIA developer blog "探索 FP8 训练中 Debug 思路与技巧") --
  ``fprop`` ``y = x Wᵀ``, ``dgrad`` ``dx = dy W``,
  ``wgrad`` ``dW = dyᵀ x`` -- a `GemmConfig`: the `Accumulator`, an optional high-precision
  override (``"fp32"``, ``"bf16"``, ``"fp16"``: both operands merely rounded to that format) and
  optional per-(GEMM, role) spec overrides (that blog's cure: current scaling for
  ``grad_output`` in ``dgrad`` only, while the same gradient feeds ``wgrad`` under the delayed
  spec);
* what is saved for backward (``"high_precision"``, the default: the fp32 operands, quantized
  again in backward, as TE and torchao do; ``"quantized"``: the forward's quantized operands,
  re-tiled from the quantized values where the backward GEMM needs other blocks, as DeepSeek-V3
  does);
* whether attention's two matmuls are quantized (``attention``, off by default like TE's fp8_dpa);
* the optimizer-state precision and loss scaling (consumed by `fp8lab.optim` and the lab).

Granularity convention: a role's block shape is written for the tensor in its natural layout
(``input`` ``[tokens, in]``, ``weight`` ``[out, in]``, ``grad_output`` ``[tokens, out]``) as used by
the GEMM that reduces along its *last* axis (fprop for input and weight, dgrad for grad_output).
A GEMM that reduces along the first axis (dgrad for weight, wgrad for both operands) uses the
transposed blocks: ``(1, 128)`` becomes ``(128, 1)``, ``"row"`` becomes ``"col"`` (re-tiling).
Per-(GEMM, role) overrides follow the same convention.

A recipe is configuration only: a `DelayedScaling` given in a spec is stored as its frozen
`DelayedScalingConfig`; the scaling state belongs to whoever quantizes (`fp8lab.nn.Linear`, or
the user through `DelayedScaling.bind`). Presets are therefore immutable and shareable.

Recipe files (`Recipe.load`) are type-checked key by key; every error (`RecipeFileError`) names
the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8lab._keys import check_keys
from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

__all__ = [
    "GEMMS",
    "GEMM_OPERANDS",
    "ROLES",
    "GemmConfig",
    "Recipe",
    "RecipeFileError",
    "get_recipe",
    "recipes",
]

ROLES = ("input", "weight", "grad_output")
GEMMS = ("fprop", "dgrad", "wgrad")
#: the two operand roles of each GEMM, and whether that operand is reduced along its first axis
GEMM_OPERANDS: dict[str, tuple[tuple[str, bool], tuple[str, bool]]] = {
    "fprop": (("input", False), ("weight", False)),
    "dgrad": (("grad_output", False), ("weight", True)),
    "wgrad": (("grad_output", True), ("input", True)),
}
HIGH_PRECISIONS = ("fp32", "bf16", "fp16")
SAVE_MODES = ("quantized", "high_precision")
LOSS_SCALINGS = ("none", "static", "dynamic")
#: storage of the AdamW moments (fp8lab.optim.AdamW's state_precision; "fp8" = block-scaled E4M3)
OPTIMIZER_STATES = ("fp32", "bf16", "fp16", "fp8", "e4m3", "e5m2")


class RecipeFileError(ValueError):
    """A recipe file (or plain-data recipe) that cannot be read: names the file, table and key."""


def _spec(value: Any, what: str) -> QuantSpec | None:
    """A `QuantSpec` holding configuration only (a `DelayedScaling`'s state is dropped)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = QuantSpec.from_dict(dict(value))
    elif isinstance(value, str):
        value = QuantSpec(format=value)
    elif not isinstance(value, QuantSpec):
        raise TypeError(
            f"{what}: expected a QuantSpec, dict or format name, got {type(value).__name__}"
        )
    if isinstance(value.scaling, DelayedScaling):
        value = value.replace(scaling=value.scaling.cfg)
    return value


@dataclass(frozen=True)
class GemmConfig:
    """How one GEMM (fprop, dgrad or wgrad) runs.

    Attributes:
        accumulator: the `Accumulator` model (default fp32).
        high_precision: ``None`` (quantized operands) or ``"fp32"``/``"bf16"``/``"fp16"``: run this
            GEMM in high precision, both operands rounded to that format, no scaling.
        overrides: per-role `QuantSpec` overrides for this GEMM's operands (a dict on input,
            stored as a sorted tuple of pairs so the config stays immutable).
    """

    accumulator: Accumulator = field(default_factory=Accumulator)
    high_precision: str | None = None
    overrides: tuple[tuple[str, QuantSpec], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "accumulator", Accumulator.parse(self.accumulator))
        hp = self.high_precision
        if hp is not None:
            hp = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(hp, hp)
            if hp not in HIGH_PRECISIONS:
                raise ValueError(
                    f"high_precision must be None or one of {HIGH_PRECISIONS}, got {hp!r}"
                )
        object.__setattr__(self, "high_precision", hp)
        ov = self.overrides
        items = ov.items() if isinstance(ov, Mapping) else ov
        pairs = []
        for role, spec in items:
            if role not in ROLES:
                raise ValueError(f"override role must be one of {ROLES}, got {role!r}")
            s = _spec(spec, f"override for {role}")
            if s is None:
                raise ValueError(f"override for {role} must be a QuantSpec, got None")
            pairs.append((role, s))
        object.__setattr__(self, "overrides", tuple(sorted(pairs, key=lambda p: p[0])))

    def override(self, role: str) -> QuantSpec | None:
        for r, s in self.overrides:
            if r == role:
                return s
        return None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"accumulator": self.accumulator.to_dict()}
        if self.high_precision is not None:
            d["high_precision"] = self.high_precision
        if self.overrides:
            d["overrides"] = {r: s.to_dict() for r, s in self.overrides}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GemmConfig:
        check_keys(d, ("accumulator", "high_precision", "overrides"), "GemmConfig")
        return cls(
            accumulator=Accumulator.parse(d.get("accumulator")),
            high_precision=d.get("high_precision"),
            overrides=dict(d.get("overrides", {})),
        )


@dataclass(frozen=True)
class Recipe:
    """A complete simulated low-precision training recipe (see the module docstring).

    Frozen configuration: equal to its TOML or JSON round trip, hashable.
    """

    name: str = "custom"
    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    grad_output: QuantSpec | None = None
    fprop: GemmConfig = field(default_factory=GemmConfig)
    dgrad: GemmConfig = field(default_factory=GemmConfig)
    wgrad: GemmConfig = field(default_factory=GemmConfig)
    save_for_backward: str = "high_precision"
    attention: bool = False
    optimizer_state: str = "fp32"
    master_weights: str = "fp32"
    loss_scaling: str = "none"
    loss_scale: float = 2.0**16
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for role in ROLES:
            object.__setattr__(self, role, _spec(getattr(self, role), role))
        for g in GEMMS:
            v = getattr(self, g)
            if isinstance(v, Mapping):
                v = GemmConfig.from_dict(v)
            elif not isinstance(v, GemmConfig):
                raise TypeError(f"{g} must be a GemmConfig or dict, got {type(v).__name__}")
            object.__setattr__(self, g, v)
        if self.save_for_backward not in SAVE_MODES:
            raise ValueError(
                f"save_for_backward must be one of {SAVE_MODES}, got {self.save_for_backward!r}"
            )
        if self.loss_scaling not in LOSS_SCALINGS:
            raise ValueError(
                f"loss_scaling must be one of {LOSS_SCALINGS}, got {self.loss_scaling!r}"
            )
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"loss_scale must be finite and > 0, got {self.loss_scale}")
        object.__setattr__(self, "loss_scale", float(self.loss_scale))
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer_state must be one of {OPTIMIZER_STATES}, got {self.optimizer_state!r}"
            )
        if self.master_weights not in ("fp32", "bf16", "fp16"):
            raise ValueError(
                f"master_weights must be fp32, bf16 or fp16, got {self.master_weights!r}"
            )
        if not isinstance(self.attention, bool):
            raise TypeError(f"attention must be a bool, got {type(self.attention).__name__}")

    # ------------------------------------------------------------------ queries
    def gemm(self, gemm: str) -> GemmConfig:
        if gemm not in GEMMS:
            raise ValueError(f"unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
        return getattr(self, gemm)

    def spec(self, gemm: str, role: str) -> QuantSpec | None:
        """The spec of ``role`` in ``gemm`` (the override if any, else the role's spec), in the
        natural-layout convention; ``None`` when the operand stays unquantized."""
        cfg = self.gemm(gemm)
        if role not in (r for r, _ in GEMM_OPERANDS[gemm]):
            raise ValueError(f"{role!r} is not an operand of {gemm}")
        ov = cfg.override(role)
        return ov if ov is not None else getattr(self, role)

    @property
    def is_delayed(self) -> bool:
        """Whether any operand uses delayed scaling (the module then keeps state)."""
        return any(
            s is not None and s.is_delayed
            for g in GEMMS
            for r, _ in GEMM_OPERANDS[g]
            for s in [self.spec(g, r)]
        )

    # ------------------------------------------------------------------ derivation
    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)

    def with_high_precision(self, *gemms: str, precision: str = "bf16") -> Recipe:
        """Copy with ``gemms`` run in high precision (the per-GEMM bisection of NVIDIA's
        developer blog "探索 FP8 训练中 Debug 思路与技巧")."""
        ch = {g: dataclasses.replace(self.gemm(g), high_precision=precision) for g in gemms}
        return dataclasses.replace(self, **ch)

    def with_override(self, gemm: str, role: str, spec: QuantSpec | Mapping | str) -> Recipe:
        """Copy with ``role``'s spec replaced in ``gemm`` only."""
        cfg = self.gemm(gemm)
        if role not in (r for r, _ in GEMM_OPERANDS[gemm]):
            raise ValueError(f"{role!r} is not an operand of {gemm}")
        ov = dict(cfg.overrides)
        ov[role] = _spec(spec, f"override for {role}")
        return dataclasses.replace(self, **{gemm: dataclasses.replace(cfg, overrides=ov)})

    def with_accumulator(self, accumulator: Accumulator | str, *gemms: str) -> Recipe:
        """Copy with the accumulator of ``gemms`` (default: all three) replaced."""
        acc = Accumulator.parse(accumulator)
        ch = {g: dataclasses.replace(self.gemm(g), accumulator=acc) for g in (gemms or GEMMS)}
        return dataclasses.replace(self, **ch)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain data (no None: absent role = unquantized), TOML/JSON friendly."""
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "save_for_backward": self.save_for_backward,
            "attention": self.attention,
            "optimizer_state": self.optimizer_state,
            "master_weights": self.master_weights,
            "loss_scaling": self.loss_scaling,
            "loss_scale": self.loss_scale,
        }
        for role in ROLES:
            s = getattr(self, role)
            if s is not None:
                d[role] = s.to_dict()
        for g in GEMMS:
            d[g] = self.gemm(g).to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "recipe") -> Recipe:
        """Inverse of `to_dict`, type-checked key by key: a `RecipeFileError` (a ValueError)
        names ``where`` (e.g. the file), the table and the key of a bad or unknown entry."""
        return _recipe_from_plain(d, where)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, *, where: str = "recipe") -> Recipe:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecipeFileError(f"{where}: not valid JSON: {exc}") from None
        return cls.from_dict(d, where=where)

    def to_toml(self) -> str:
        return _dump_toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, where: str = "recipe") -> Recipe:
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RecipeFileError(f"{where}: not valid TOML: {exc}") from None
        return cls.from_dict(d, where=where)

    def save(self, path: str | Path) -> None:
        """Write ``.toml`` or ``.json`` (by suffix)."""
        p = Path(path)
        if p.suffix == ".toml":
            p.write_text(self.to_toml(), encoding="utf-8")
        elif p.suffix == ".json":
            p.write_text(self.to_json() + "\n", encoding="utf-8")
        else:
            raise ValueError(f"recipe files end in .toml or .json, got {p.name!r}")

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a ``.toml`` or ``.json`` recipe file. Every problem is a `RecipeFileError`
        naming the file: "no such recipe file", unreadable, not TOML/JSON, or a bad table/key."""
        p = Path(path)
        if p.suffix not in (".toml", ".json"):
            raise ValueError(f"recipe files end in .toml or .json, got {p.name!r}")
        if not p.exists():
            raise RecipeFileError(f"no such recipe file: {str(p)!r}")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeFileError(f"cannot read recipe file {str(p)!r}: {exc}") from None
        where = f"recipe file {str(p)!r}"
        if p.suffix == ".toml":
            return cls.from_toml(text, where=where)
        return cls.from_json(text, where=where)

    def fingerprint(self) -> str:
        """Canonical JSON of the numerics (name and prose excluded): equal iff same numerics.

        Computed once per (immutable) recipe: modules look it up on every forward."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            d = self.to_dict()
            for k in ("name", "description", "source"):
                d.pop(k)
            cached = json.dumps(d, sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def __repr__(self) -> str:
        def spec_str(s: QuantSpec | None) -> str:
            if s is None:
                return "fp32"
            sc = s.scaling
            if isinstance(sc, DelayedScaling | DelayedScalingConfig):
                sc_s = (
                    f"delayed(h={sc.history_len}, {sc.algorithm}, margin={sc.margin}"
                    + (f", interval={sc.interval}" if sc.interval != 1 else "")
                    + (f", nguard={sc.nguard}" if sc.nguard else "")
                    + (f", first={sc.first_step}" if sc.first_step != "unit" else "")
                    + ")"
                )
            else:
                sc_s = str(sc)
            g = (
                s.granularity
                if isinstance(s.granularity, str)
                else "x".join(map(str, s.granularity))
            )
            extra = "" if s.rounding == "nearest_even" else f" {s.rounding}"
            return f"{s.format}/{g}/{sc_s}{extra}"

        def gemm_str(name: str) -> str:
            c = self.gemm(name)
            a = c.accumulator
            acc = (
                "fp32"
                if a.kind == "fp32"
                else (
                    f"limited(m={a.mantissa_bits}"
                    + (f", promote={a.promote_every}" if a.promote_every else "")
                    + ")"
                )
            )
            parts = [f"acc={acc}"]
            if c.high_precision:
                parts.append(f"high_precision={c.high_precision}")
            for r, s in c.overrides:
                parts.append(f"{r}={spec_str(s)}")
            return f"{name}({', '.join(parts)})"

        lines = [f"Recipe({self.name!r}"]
        lines.append("  roles: " + ", ".join(f"{r}={spec_str(getattr(self, r))}" for r in ROLES))
        lines.append("  gemms: " + ", ".join(gemm_str(g) for g in GEMMS))
        lines.append(
            f"  save_for_backward={self.save_for_backward}, attention={self.attention}, "
            f"optimizer_state={self.optimizer_state}, master_weights={self.master_weights}, "
            f"loss_scaling={self.loss_scaling}"
            + (f"({self.loss_scale:g})" if self.loss_scaling != "none" else "")
            + ")"
        )
        return "\n".join(lines)


# ---------------------------------------------------------------------------- plain data -> Recipe
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
            raise
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
    return _build(where, g, GemmConfig, acc, v.get("high_precision"), overrides)


def _recipe_from_plain(d: Any, where: str) -> Recipe:
    """`Recipe.from_dict`: every table and key checked, errors naming where/table/key."""
    types = _plain_types(
        Recipe,
        {
            **{r: (str, Mapping, QuantSpec) for r in ROLES},
            **{g: (Mapping, GemmConfig) for g in GEMMS},
            "loss_scale": _NUMBER,
        },
    )
    known = [f.name for f in dataclasses.fields(Recipe)]
    _check_table(d, types, known, "Recipe", where, "top level")
    kw = dict(d)
    for r in ROLES:
        if r in kw:
            kw[r] = _spec_from_plain(kw[r], where, r)
    for g in GEMMS:
        if g in kw:
            kw[g] = _gemm_from_plain(kw[g], where, g)
    return _build(where, "top level", lambda: Recipe(**kw))


# ---------------------------------------------------------------------------- TOML writer
def _toml_key(k: str) -> str:
    if k and all(c.isalnum() or c in "_-" for c in k):
        return k
    return json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _dump_toml(d: Mapping[str, Any], prefix: str = "") -> str:
    scalars = [(k, v) for k, v in d.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
    out = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    for k, v in tables:
        name = f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k)
        body = _dump_toml(v, name)
        out.append("")
        out.append(f"[{name}]")
        if body:
            out.append(body)
    return "\n".join(out).strip("\n") + ("\n" if not prefix else "")


# ---------------------------------------------------------------------------- presets
def _e(fmt: str, gran: Any = "tensor", scaling: Any = "max", **kw: Any) -> QuantSpec:
    return QuantSpec(format=fmt, granularity=gran, scaling=scaling, **kw)


def _hp(precision: str) -> dict[str, GemmConfig]:
    return {g: GemmConfig(high_precision=precision) for g in GEMMS}


def _te_delayed() -> DelayedScalingConfig:
    return DelayedScalingConfig(history_len=1024, algorithm="max", margin=0)


def _build_presets() -> dict[str, Recipe]:
    te_src = "NVIDIA Transformer Engine transformer_engine/common/recipe/__init__.py"
    hif8_src = '"HiFloat8:高性能训练之路" (GCC / Huawei, 2025-12-19); HiFloat8 arXiv 2409.16626'
    mixed_src = '"混合精度训练:FP16、BF16、FP8深度对比"'
    # save_for_backward is stated by every preset: the dataclass default changed to
    # "high_precision" and a preset's fingerprint (run directories resume on it) must not
    ds_acc = Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=128)
    h100_fast = Accumulator("h100")  # the H100 tensor core, bit-exact (fp8lab.gemm.fused)
    h100_ds = Accumulator("h100", promote_every=128)
    hif8_round = "nearest_away"  # HiF8's native TA rounding (arXiv 2409.16626)
    p: list[Recipe] = [
        Recipe(
            name="fp32",
            **_hp("fp32"),
            save_for_backward="quantized",
            description="Everything in fp32: the reference; fp8lab.nn.Linear == torch.nn.Linear.",
            source="baseline",
        ),
        Recipe(
            name="bf16",
            **_hp("bf16"),
            save_for_backward="quantized",
            description="GEMM operands rounded to bf16 (RNE), fp32 accumulation and output.",
            source=f"standard BF16 mixed precision ({mixed_src}; emulated in fp32, docs/design.md)",
        ),
        Recipe(
            name="fp16-amp",
            **_hp("fp16"),
            save_for_backward="quantized",
            loss_scaling="dynamic",
            loss_scale=2.0**16,
            description="fp16 operands, fp32 accumulation, dynamic loss scaling (2^16, x2/2000, x0.5).",
            source="Micikevicius et al., 'Mixed Precision Training', arXiv 1710.03740; "
            + mixed_src,
        ),
        Recipe(
            name="te-delayed",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            save_for_backward="quantized",
            description="TE DelayedScaling(): HYBRID (E4M3 fwd, E5M2 grads), per-tensor, amax "
            "history 1024, max, margin 0; fp32 accumulation in all GEMMs.",
            source=te_src + " DelayedScaling",
        ),
        Recipe(
            name="te-delayed-hopper",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            fprop=GemmConfig(accumulator=h100_fast),
            save_for_backward="quantized",
            description="te-delayed with Hopper's fast FP8 accumulation in fprop (TE "
            "_2X_ACC_FPROP=False: the H100 tensor core's 13-bit fused accumulator, never "
            "promoted, bit-exact model); dgrad/wgrad split-accumulate (fp32).",
            source=te_src + " module/base.py _2X_ACC_*; Khattak & Mikaitis, 'Accurate Models "
            "of NVIDIA Tensor Cores', arXiv 2512.07004 (H100 model)",
        ),
        Recipe(
            name="te-current",
            input=_e("e4m3"),
            weight=_e("e4m3"),
            grad_output=_e("e5m2"),
            save_for_backward="quantized",
            description="TE Float8CurrentScaling(): HYBRID, per-tensor scale fmt_max/amax of the "
            "current tensor; fp32 accumulation.",
            source=te_src + " Float8CurrentScaling",
        ),
        Recipe(
            name="deepseek-v3",
            input=_e("e4m3", (1, 128)),
            weight=_e("e4m3", (128, 128)),
            grad_output=_e("e4m3", (1, 128)),
            fprop=GemmConfig(accumulator=ds_acc),
            dgrad=GemmConfig(accumulator=ds_acc),
            wgrad=GemmConfig(accumulator=ds_acc),
            optimizer_state="bf16",
            save_for_backward="quantized",
            description="DeepSeek-V3: E4M3 on all tensors; activations and grads 1x128 tiles "
            "(128x1 for wgrad, re-tiled from the quantized values), weights 128x128 blocks, "
            "online amax/448 scales; limited accumulation promoted to fp32 every 128; BF16 AdamW "
            "moments, FP32 master weights. Embedding and output head stay high precision.",
            source="DeepSeek-V3 technical report, arXiv 2412.19437v2 §3.3, §3.5.2",
        ),
        Recipe(
            name="deepseek-v3-h100",
            input=_e("e4m3", (1, 128)),
            weight=_e("e4m3", (128, 128)),
            grad_output=_e("e4m3", (1, 128)),
            fprop=GemmConfig(accumulator=h100_ds),
            dgrad=GemmConfig(accumulator=h100_ds),
            wgrad=GemmConfig(accumulator=h100_ds),
            optimizer_state="bf16",
            save_for_backward="quantized",
            description="deepseek-v3 with the bit-exact H100 tensor-core accumulator (13-bit "
            "fused block FMA over 32 products) promoted to fp32 every 128, instead of the fast "
            "approximate limited model.",
            source="DeepSeek-V3 technical report, arXiv 2412.19437v2 §3.3, §3.5.2; Khattak & "
            "Mikaitis, arXiv 2512.07004 (H100 model)",
        ),
        Recipe(
            name="mxfp8",
            input=_e("e4m3", "mx", "mx_rceil"),
            weight=_e("e4m3", "mx", "mx_rceil"),
            grad_output=_e("e4m3", "mx", "mx_rceil"),
            save_for_backward="high_precision",
            description="TE MXFP8BlockScaling(): E4M3 everywhere, 1x32 blocks with E8M0 scales "
            "rounded up (rceil, never clips); rowwise and columnwise copies quantized "
            "independently from the high-precision tensor.",
            source=te_src + " MXFP8BlockScaling; TE quantize_mxfp8.cuh",
        ),
        Recipe(
            name="hif8-current",
            input=_e("hif8", rounding=hif8_round),
            weight=_e("hif8", rounding=hif8_round),
            grad_output=_e("hif8", rounding=hif8_round),
            save_for_backward="quantized",
            description="HiFloat8 on all tensors, per-tensor current scaling, TA rounding.",
            source=hif8_src,
        ),
        Recipe(
            name="hif8-delayed",
            input=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            weight=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            grad_output=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            save_for_backward="quantized",
            description="HiFloat8 per-tensor delayed scaling: amax measured every 5 steps "
            "(interval 5), guard margin Nguard=8 binades, first step current scaling.",
            source=hif8_src + " (interval 5, Nguard 8-12 for HiF8)",
        ),
        Recipe(
            name="nvfp4",
            input=_e("e2m1", "nvfp4", "nvfp4"),
            weight=_e("e2m1", (16, 16), "nvfp4"),
            grad_output=_e("e2m1", "nvfp4", "nvfp4", rounding="stochastic"),
            save_for_backward="high_precision",
            description="TE NVFP4BlockScaling(): E2M1 elements, 1x16 blocks with E4M3 scales "
            "under an FP32 tensor scale, 16x16 weight blocks, stochastic rounding of grads. "
            "The random Hadamard transform is not modelled.",
            source=te_src + " NVFP4BlockScaling; TE reference_nvfp4.py",
        ),
    ]
    return {r.name: r for r in p}


def _hif8_delayed() -> DelayedScalingConfig:
    return DelayedScalingConfig(
        history_len=1024, algorithm="max", margin=0, interval=5, nguard=8, first_step="current"
    )


_PRESETS: dict[str, Recipe] | None = None


def _presets() -> dict[str, Recipe]:
    global _PRESETS
    if _PRESETS is None:
        _PRESETS = _build_presets()
    return _PRESETS


def recipes() -> list[str]:
    """Names of the preset recipes."""
    return list(_presets())


def get_recipe(name: str | Recipe) -> Recipe:
    """The preset ``name`` (a `Recipe` passes through). Unknown names raise, listing valid ones.

    Presets are immutable configuration (delayed scaling as a frozen `DelayedScalingConfig`):
    quantizing under a preset's spec never changes the preset; each quantizing module owns its
    state (`DelayedScaling.bind`), so a preset can be shared by any number of layers and runs.
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    pres = _presets()
    if name not in pres:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(pres)}")
    return pres[name]
