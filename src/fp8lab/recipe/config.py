"""Roles, GEMMs and the per-GEMM configuration (`GemmConfig`) of a recipe; `RecipeFileError`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp8lab._keys import check_keys
from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.scaling.delayed import DelayedScaling

__all__ = [
    "BACKWARD_OPERANDS",
    "GEMMS",
    "GEMM_OPERANDS",
    "HIGH_PRECISIONS",
    "LOSS_SCALINGS",
    "MASTER_WEIGHTS",
    "OPERAND_SOURCES",
    "OPTIMIZER_STATES",
    "PARAM_MASTER_INITS",
    "PARAM_STORAGES",
    "ROLES",
    "SAVE_ACTIVATIONS",
    "SAVE_MODES",
    "GemmConfig",
    "RecipeFileError",
    "check_operand_source",
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
#: where a backward GEMM's operand comes from (`GemmConfig.operand_source`): ``auto`` (the
#: source system's choice, docs/recipes.md), the high-precision tensor, the earlier GEMM's saved
#: quantized copy (as is when it quantizes alike, else re-tiled), or that copy's dequantized values
OPERAND_SOURCES = ("auto", "high_precision", "saved_quantized", "saved_dequantized")
#: per GEMM, the roles it may take from an earlier GEMM and that GEMM (dgrad's grad_output is
#: dy's first use)
BACKWARD_OPERANDS: dict[str, dict[str, str]] = {
    "fprop": {},
    "dgrad": {"weight": "fprop"},
    "wgrad": {"input": "fprop", "grad_output": "dgrad"},
}
SAVE_MODES = ("quantized", "high_precision")
LOSS_SCALINGS = ("none", "static", "dynamic")
#: norm affine parameters (RMSNorm/LayerNorm weight and bias): kept as they are, or quantized
#: with the weight role's spec before use (Su et al. arXiv 2506.20752, MX LayerNorm affine)
NORM_WEIGHTS = ("high_precision", "quantized")
#: storage of the AdamW moments (fp8lab.optim.AdamW's state_precision; "fp8" = block-scaled E4M3)
OPTIMIZER_STATES = ("fp32", "bf16", "fp16", "fp8", "e4m3", "e5m2")
#: the master copy of the weights: "bf16"/"fp16" parameters rounded from an fp32 master,
#: "fp16-scaled" MS-AMP O2's per-tensor scaled FP16 master, "none" no master (FP8 parameters)
MASTER_WEIGHTS = ("fp32", "bf16", "fp16", "fp16-scaled", "none")
#: how quantized Linear weights are stored: as the fp32 parameter, or as FP8 codes plus scales
PARAM_STORAGES = ("high_precision", "fp8")
#: where the master of an FP8-stored weight starts (TE PR 1121's two paths)
PARAM_MASTER_INITS = ("high_precision", "from_fp8")
#: the inputs of nonlinearities (activation, norms) saved for backward as they are or in FP8
SAVE_ACTIVATIONS = ("high_precision", "quantized")


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


class OptionTable:
    """Base of a recipe's option tables (``[dpa]``, ``[moe]``): a frozen dataclass whose TOML
    table is named ``TABLE``, written with only the fields that differ from their defaults."""

    TABLE = ""

    @property
    def is_default(self) -> bool:
        return self == type(self)()

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults (an all-default table is ``{}``)."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        check_keys(d, [f.name for f in dataclasses.fields(cls)], cls.TABLE)  # type: ignore[arg-type]
        return cls(**dict(d))

    def describe(self) -> str:
        """One line: the non-default options (``"defaults"`` when none)."""
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items()) or "defaults"


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
        operand_source: where this (backward) GEMM takes an operand the forward or dgrad
            already quantized (`OPERAND_SOURCES`): one value for every such role, or per role
            (``{"input": "saved_quantized", "grad_output": "high_precision"}``); ``"auto"`` (the
            default) is the source system's choice (docs/recipes.md). Only ``dgrad``'s weight
            and ``wgrad``'s input and grad_output take one (`BACKWARD_OPERANDS`; a `Recipe`
            checks it and stores it per role); a GEMM or cell in high precision rounds the
            high-precision tensor whatever it says. Stored as ``"auto"``, one value, or sorted
            ``(role, value)`` pairs without ``"auto"`` entries.
    """

    accumulator: Accumulator = field(default_factory=Accumulator)
    high_precision: str | None = None
    overrides: tuple[tuple[str, QuantSpec], ...] = ()
    high_precision_roles: tuple[tuple[str, str], ...] = ()
    operand_source: str | tuple[tuple[str, str], ...] = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "accumulator", Accumulator.parse(self.accumulator))
        hp = None if self.high_precision is None else _precision(self.high_precision, "")
        object.__setattr__(self, "high_precision", hp)
        hp_roles = _by_role(self.high_precision_roles, "high_precision_roles: role",
                            lambda role, p: _precision(p, f" for {role}"))  # fmt: skip
        object.__setattr__(self, "high_precision_roles", tuple(sorted(hp_roles)))
        overrides = _by_role(self.overrides, "override role", _override)
        object.__setattr__(self, "overrides", tuple(sorted(overrides, key=lambda p: p[0])))
        object.__setattr__(self, "operand_source", _operand_source(self.operand_source))

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

    def source(self, role: str) -> str:
        """`operand_source` for ``role`` (one of `OPERAND_SOURCES`; ``"auto"`` when unset)."""
        if isinstance(self.operand_source, str):
            return self.operand_source
        return dict(self.operand_source).get(role, "auto")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"accumulator": self.accumulator.to_dict()}
        if self.high_precision is not None:
            d["high_precision"] = self.high_precision
        if self.overrides:
            d["overrides"] = {r: s.to_dict() for r, s in self.overrides}
        if self.high_precision_roles:
            d["high_precision_roles"] = dict(self.high_precision_roles)
        if self.operand_source != "auto":  # absent when auto: fingerprints stay as they were
            src = self.operand_source
            d["operand_source"] = src if isinstance(src, str) else dict(src)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GemmConfig:
        keys = ("accumulator", "high_precision", "overrides", "high_precision_roles",
                "operand_source")  # fmt: skip
        check_keys(d, keys, "GemmConfig")
        src = d.get("operand_source", "auto")
        return cls(
            accumulator=Accumulator.parse(d.get("accumulator")),
            high_precision=d.get("high_precision"),
            overrides=dict(d.get("overrides", {})),
            high_precision_roles=dict(d.get("high_precision_roles", {})),
            operand_source=src if isinstance(src, str) else dict(src),
        )


def _source_value(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in OPERAND_SOURCES:
        raise ValueError(f"{what} must be one of {OPERAND_SOURCES}, got {value!r}")
    return value


def _operand_source(value: Any) -> str | tuple[tuple[str, str], ...]:
    """`GemmConfig.operand_source` normalised: ``"auto"``, one value, or sorted per-role pairs
    (``"auto"`` entries dropped; none left is ``"auto"``)."""
    if isinstance(value, str):
        return _source_value(value, "operand_source")
    if not isinstance(value, Mapping | list | tuple):
        raise ValueError(
            f"operand_source must be one of {OPERAND_SOURCES} or a table role -> value, "
            f"got {value!r}"
        )
    pairs = _by_role(value, "operand_source: role",
                     lambda role, v: _source_value(v, f"operand_source for {role}"))  # fmt: skip
    kept = tuple(sorted((r, v) for r, v in pairs if v != "auto"))
    return kept or "auto"


def check_operand_source(gemm: str, cfg: GemmConfig) -> GemmConfig:
    """``cfg`` of ``gemm`` with its `GemmConfig.operand_source` checked against the roles that
    GEMM takes from an earlier one (`BACKWARD_OPERANDS`) and stored per role (one value
    expanded to those roles, so equal settings compare and fingerprint alike)."""
    src = cfg.operand_source
    roles = tuple(BACKWARD_OPERANDS[gemm])
    if isinstance(src, str):
        if src == "auto":
            return cfg
        if not roles:
            raise ValueError(
                f"{gemm}.operand_source: {gemm} takes no operand from an earlier GEMM; only "
                f"dgrad (weight) and wgrad (input, grad_output) have one, got {src!r}"
            )
        return dataclasses.replace(cfg, operand_source=tuple((r, src) for r in roles))
    bad = [r for r, _ in src if r not in roles]
    if bad:
        takes = ", ".join(roles) if roles else "no role"
        raise ValueError(
            f"{gemm}.operand_source: {bad[0]!r} is not an operand {gemm} takes from an earlier "
            f"GEMM ({gemm}: {takes}; dgrad's grad_output is always quantized from dy)"
        )
    return cfg


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
