"""Training recipes: which tensor is quantized how, and how each GEMM of a Linear layer runs.

A `Recipe` is frozen, printable data that round-trips through TOML and JSON. It describes:

* per tensor **role** -- ``input`` (activation), ``weight``, ``grad_output`` -- a `QuantSpec`
  (format, granularity, scaling rule or `DelayedScaling`, rounding), or ``None`` (kept fp32);
* per **GEMM** of a linear layer (seed 001) -- ``fprop`` ``y = x Wᵀ``, ``dgrad`` ``dx = dy W``,
  ``wgrad`` ``dW = dyᵀ x`` -- a `GemmConfig`: the `Accumulator`, an optional high-precision
  override (``"fp32"``, ``"bf16"``, ``"fp16"``: both operands merely rounded to that format) and
  optional per-(GEMM, role) spec overrides (seed 001's cure: current scaling for ``grad_output``
  in ``dgrad`` only, while the same gradient feeds ``wgrad`` under the delayed spec);
* what is saved for backward (``"quantized"``: the forward's quantized operands, re-tiled from
  the quantized values where the backward GEMM needs other blocks, as DeepSeek-V3 does;
  ``"high_precision"``: the fp32 operands, re-quantized in backward, TE's ``backward_override``);
* whether attention's two matmuls are quantized (``attention``, off by default like TE's fp8_dpa);
* the optimizer-state precision and loss scaling (consumed by `fp8lab.optim` and the lab).

Granularity convention: a role's block shape is written for the tensor in its natural layout
(``input`` ``[tokens, in]``, ``weight`` ``[out, in]``, ``grad_output`` ``[tokens, out]``) as used by
the GEMM that reduces along its *last* axis (fprop for input and weight, dgrad for grad_output).
A GEMM that reduces along the first axis (dgrad for weight, wgrad for both operands) uses the
transposed blocks: ``(1, 128)`` becomes ``(128, 1)``, ``"row"`` becomes ``"col"`` (re-tiling).
Per-(GEMM, role) overrides follow the same convention.
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

from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.scaling.delayed import DelayedScaling

__all__ = [
    "GEMMS",
    "GEMM_OPERANDS",
    "ROLES",
    "GemmConfig",
    "Recipe",
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


def _spec(value: Any, what: str) -> QuantSpec | None:
    if value is None or isinstance(value, QuantSpec):
        return value
    if isinstance(value, Mapping):
        return QuantSpec.from_dict(dict(value))
    if isinstance(value, str):
        return QuantSpec(format=value)
    raise TypeError(
        f"{what}: expected a QuantSpec, dict or format name, got {type(value).__name__}"
    )


@dataclass(frozen=True, eq=False)
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
        unknown = set(d) - {"accumulator", "high_precision", "overrides"}
        if unknown:
            raise ValueError(f"unknown GemmConfig keys: {sorted(unknown)}")
        return cls(
            accumulator=Accumulator.parse(d.get("accumulator")),
            high_precision=d.get("high_precision"),
            overrides=dict(d.get("overrides", {})),
        )


@dataclass(frozen=True, eq=False)
class Recipe:
    """A complete simulated low-precision training recipe (see the module docstring).

    Equality and hashing compare the serialised form (`to_dict`), so a recipe equals its TOML or
    JSON round trip even though `DelayedScaling` templates are objects.
    """

    name: str = "custom"
    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    grad_output: QuantSpec | None = None
    fprop: GemmConfig = field(default_factory=GemmConfig)
    dgrad: GemmConfig = field(default_factory=GemmConfig)
    wgrad: GemmConfig = field(default_factory=GemmConfig)
    save_for_backward: str = "quantized"
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
        """Copy with ``gemms`` run in high precision (seed 001's per-GEMM bisection)."""
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
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Recipe keys: {sorted(unknown)}; valid: {sorted(names)}")
        kw = dict(d)
        for g in GEMMS:
            if g in kw:
                kw[g] = GemmConfig.from_dict(kw[g])
        return cls(**kw)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        return cls.from_dict(json.loads(text))

    def to_toml(self) -> str:
        return _dump_toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str) -> Recipe:
        return cls.from_dict(tomllib.loads(text))

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
        p = Path(path)
        if p.suffix == ".toml":
            return cls.from_toml(p.read_text(encoding="utf-8"))
        if p.suffix == ".json":
            return cls.from_json(p.read_text(encoding="utf-8"))
        raise ValueError(f"recipe files end in .toml or .json, got {p.name!r}")

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

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __repr__(self) -> str:
        def spec_str(s: QuantSpec | None) -> str:
            if s is None:
                return "fp32"
            sc = s.scaling
            if isinstance(sc, DelayedScaling):
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


def _te_delayed() -> DelayedScaling:
    return DelayedScaling(history_len=1024, algorithm="max", margin=0)


def _build_presets() -> dict[str, Recipe]:
    te_src = (
        "NVIDIA Transformer Engine transformer_engine/common/recipe/__init__.py "
        "(reference/transformer-engine.md §1-2)"
    )
    limited_fast = Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=None)
    ds_acc = Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=128)
    hif8_round = "nearest_away"  # HiF8's native TA rounding (formats.md §1.5)
    p: list[Recipe] = [
        Recipe(
            name="fp32",
            **_hp("fp32"),
            description="Everything in fp32: the reference; fp8lab.nn.Linear == torch.nn.Linear.",
            source="baseline",
        ),
        Recipe(
            name="bf16",
            **_hp("bf16"),
            description="GEMM operands rounded to bf16 (RNE), fp32 accumulation and output.",
            source="standard BF16 mixed precision (seed 002 §3; emulated in fp32, see design.md)",
        ),
        Recipe(
            name="fp16-amp",
            **_hp("fp16"),
            loss_scaling="dynamic",
            loss_scale=2.0**16,
            description="fp16 operands, fp32 accumulation, dynamic loss scaling (2^16, x2/2000, x0.5).",
            source="Micikevicius et al. 2018 'Mixed Precision Training'; seed 002 §3.2",
        ),
        Recipe(
            name="te-delayed",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            description="TE DelayedScaling(): HYBRID (E4M3 fwd, E5M2 grads), per-tensor, amax "
            "history 1024, max, margin 0; fp32 accumulation in all GEMMs.",
            source=te_src + " DelayedScaling",
        ),
        Recipe(
            name="te-delayed-hopper",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            fprop=GemmConfig(accumulator=limited_fast),
            description="te-delayed with Hopper's fast (limited, never promoted, ~13-bit) FP8 "
            "accumulation in fprop (TE _2X_ACC_FPROP=False); dgrad/wgrad split-accumulate (fp32).",
            source=te_src + " module/base.py _2X_ACC_*; formats.md §4.4",
        ),
        Recipe(
            name="te-current",
            input=_e("e4m3"),
            weight=_e("e4m3"),
            grad_output=_e("e5m2"),
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
            description="DeepSeek-V3: E4M3 on all tensors; activations and grads 1x128 tiles "
            "(128x1 for wgrad, re-tiled from the quantized values), weights 128x128 blocks, "
            "online amax/448 scales; limited accumulation promoted to fp32 every 128; BF16 AdamW "
            "moments, FP32 master weights. Embedding and output head stay high precision.",
            source="arXiv 2412.19437v2 §3.3, §3.5.2 (reference/formats.md §4)",
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
            source=te_src + " MXFP8BlockScaling; quantize_mxfp8.cuh (transformer-engine.md §2.4)",
        ),
        Recipe(
            name="hif8-current",
            input=_e("hif8", rounding=hif8_round),
            weight=_e("hif8", rounding=hif8_round),
            grad_output=_e("hif8", rounding=hif8_round),
            description="HiFloat8 on all tensors, per-tensor current scaling, TA rounding.",
            source="seed 003 §5.1; arXiv 2409.16626",
        ),
        Recipe(
            name="hif8-delayed",
            input=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            weight=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            grad_output=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            description="HiFloat8 per-tensor delayed scaling: amax measured every 5 steps "
            "(interval 5), guard margin Nguard=8 binades, first step current scaling.",
            source="seed 003 §1.2, §5.2 (interval 5, Nguard 8-12 for HiF8)",
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
            source=te_src + " NVFP4BlockScaling; reference_nvfp4.py (transformer-engine.md §2.6)",
        ),
    ]
    return {r.name: r for r in p}


def _hif8_delayed() -> DelayedScaling:
    return DelayedScaling(
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

    A preset holds `DelayedScaling` *templates*; modules take fresh state objects from them, so a
    preset can be shared by any number of layers and runs.
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    pres = _presets()
    if name not in pres:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(pres)}")
    return pres[name]
