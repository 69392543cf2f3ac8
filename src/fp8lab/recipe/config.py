"""Roles, GEMMs and the per-GEMM configuration (`GemmConfig`) of a recipe; `RecipeFileError`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp8lab._keys import check_keys
from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.scaling.delayed import DelayedScaling

__all__ = [
    "GEMMS",
    "GEMM_OPERANDS",
    "HIGH_PRECISIONS",
    "LOSS_SCALINGS",
    "OPTIMIZER_STATES",
    "ROLES",
    "SAVE_MODES",
    "GemmConfig",
    "RecipeFileError",
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
        high_precision_roles: per-role high precision (``{"grad_output": "bf16"}``): only that
            operand of this GEMM is rounded to ``"fp32"``/``"bf16"``/``"fp16"`` (no scaling),
            the other stays quantized; the GEMM then multiplies the dense operands in fp32.
            The single-cell switch of a per-GEMM bisection (stored as sorted pairs).
    """

    accumulator: Accumulator = field(default_factory=Accumulator)
    high_precision: str | None = None
    overrides: tuple[tuple[str, QuantSpec], ...] = ()
    high_precision_roles: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "accumulator", Accumulator.parse(self.accumulator))
        hp = None if self.high_precision is None else _precision(self.high_precision, "")
        object.__setattr__(self, "high_precision", hp)
        hp_roles = _by_role(self.high_precision_roles, "high_precision_roles: role",
                            lambda role, p: _precision(p, f" for {role}"))  # fmt: skip
        object.__setattr__(self, "high_precision_roles", tuple(sorted(hp_roles)))
        overrides = _by_role(self.overrides, "override role", _override)
        object.__setattr__(self, "overrides", tuple(sorted(overrides, key=lambda p: p[0])))

    def override(self, role: str) -> QuantSpec | None:
        for r, s in self.overrides:
            if r == role:
                return s
        return None

    def precision(self, role: str) -> str | None:
        """The high precision ``role`` runs in within this GEMM (the GEMM's own, else the
        role's cell), or ``None`` when it is quantized (or fp32 as is, without a spec)."""
        if self.high_precision is not None:
            return self.high_precision
        return dict(self.high_precision_roles).get(role)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"accumulator": self.accumulator.to_dict()}
        if self.high_precision is not None:
            d["high_precision"] = self.high_precision
        if self.overrides:
            d["overrides"] = {r: s.to_dict() for r, s in self.overrides}
        if self.high_precision_roles:
            d["high_precision_roles"] = dict(self.high_precision_roles)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GemmConfig:
        keys = ("accumulator", "high_precision", "overrides", "high_precision_roles")
        check_keys(d, keys, "GemmConfig")
        return cls(
            accumulator=Accumulator.parse(d.get("accumulator")),
            high_precision=d.get("high_precision"),
            overrides=dict(d.get("overrides", {})),
            high_precision_roles=dict(d.get("high_precision_roles", {})),
        )


def _by_role(cells: Any, what: str, convert: Callable[[str, Any], Any]) -> list[tuple[str, Any]]:
    """``cells`` (a mapping or pairs) as ``(role, convert(role, value))`` pairs; an unknown role
    is a ValueError starting with ``what``."""
    items = cells.items() if isinstance(cells, Mapping) else cells
    pairs = []
    for role, value in items:
        if role not in ROLES:
            raise ValueError(f"{what} must be one of {ROLES}, got {role!r}")
        pairs.append((role, convert(role, value)))
    return pairs


def _override(role: str, spec: Any) -> QuantSpec:
    s = _spec(spec, f"override for {role}")
    if s is None:
        raise ValueError(f"override for {role} must be a QuantSpec, got None")
    return s


def _precision(value: Any, what: str) -> str:
    """A high-precision name (torch spellings accepted), checked."""
    if not isinstance(value, str):
        raise ValueError(f"high_precision{what} must be one of {HIGH_PRECISIONS}, got {value!r}")
    hp = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(value, value)
    if hp not in HIGH_PRECISIONS:
        raise ValueError(
            f"high_precision{what} must be None or one of {HIGH_PRECISIONS}, got {hp!r}"
        )
    return hp
