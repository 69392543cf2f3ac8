"""`QuantSpec`: how to quantize one tensor (frozen configuration), and the argument normaliser
shared by `quantize` and `fake_quant`."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from fp8lab._keys import check_keys
from fp8lab.formats import ROUNDING_MODES, FloatFormat, default_rounding, get_format
from fp8lab.scaling import rules as _rules
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig
from fp8lab.scaling.granularity import (
    GranularityLike,
    canonical_granularity,
    granularity_to_plain,
    normalize_granularity,
    transpose_granularity,
)

__all__ = ["QuantSpec", "ScalingLike"]

ScalingLike = str | float | int | DelayedScalingConfig | DelayedScaling | None


def _default_scaling(block: tuple[int, int]) -> str:
    if block in ((1, 32), (32, 1)):
        return "mx_floor"
    if block in ((1, 16), (16, 1)):
        return "nvfp4"
    return "max"


# fields added after the dict form was pinned: written only when they differ from these defaults,
# so every spec (and recipe fingerprint) written before they existed keeps its exact dict
_LATER_FIELDS = (
    ("rht", False),
    ("four_over_six", None),
    ("four_over_six_use_256", None),
    ("row_scaled", False),
    ("hadamard", None),
)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor. Frozen, hashable, serialisable with `to_dict`/`from_dict`.

    Attributes:
        format: element format name (`fp8lab.get_format`), e.g. ``"e4m3"``, ``"e5m2"``, ``"e2m1"``.
        granularity: ``"tensor"``, ``"row"``, ``"col"``, ``"mx"``, ``"mx_col"``, ``"nvfp4"``,
            ``"nvfp4_col"`` or a block ``(m, k)`` (-1 = full extent); stored canonically (a name
            if the block has one, else a tuple).
        scaling: a rule name (``max``, ``pow2_down``, ``pow2_up``, ``mx_floor``, ``mx_ceil``,
            ``mx_even``, ``mx_rceil``, ``nvfp4``, ``quest``: `fp8lab.scaling.rules`), a fixed
            float quantization multiplier (``values = cast(x * scaling)``), or delayed scaling
            (per-tensor only): a frozen `DelayedScalingConfig` (what recipes hold; each quantize
            then uses a throwaway state, i.e. step 0, unless a state is given:
            ``quantize(x, spec, state=ds)``).
            A stateful `DelayedScaling` here is deprecated (DeprecationWarning): it still
            quantizes with its scale and records the amax, as ``state=`` does.
            ``None`` picks the granularity's natural rule: ``mx_floor`` for MX blocks (OCP),
            ``nvfp4`` for NVFP4 blocks, ``max`` otherwise.
        rounding: rounding mode of the element cast (`fp8lab.ROUNDING_MODES`); ``None`` = the
            format's native rule (``nearest_even``; ``nearest_away`` = TA for HiF8).
        saturate: clamp out-of-range values to ±max (TE's ``__NV_SATFINITE``) instead of Inf/NaN.
        pad: ragged edge blocks are treated as zero-padded (True) or raise (False).
        margin: power-of-two margin for the ``max`` family: ``scale = fmt_max * 2**-margin / amax``.
        epsilon: floor on amax for the ``max`` family (TE ``amax_epsilon``).
        scale_format: the NVFP4 block-scale format (E4M3; any format `fp8lab.cast` rounds to).
        two_level: NVFP4 with the FP32 per-tensor second-level scale (True) or block scales only.
        tensor_scale: NVFP4 only: a user-chosen static FP32 tensor-level dequantization scale
            (torchao's ``per_tensor_scale``, e.g. ``calibrated_amax / (448 * 6)``) instead of
            one computed from this tensor's amax; see `fp8lab.scaling.rules.nvfp4_scales`.
        rht: NVFP4 only: Transformer Engine's random Hadamard transform (`fp8lab.rht16`) along
            the block axis before quantizing (the global amax is taken after it); the QTensor
            then dequantizes in the transformed domain. 1x16 blocks only (``nvfp4`` /
            ``nvfp4_col``); the transformed axis must be a multiple of 16. See docs/nvfp4.md.
        four_over_six: NVFP4 only: ``"mae"`` or ``"mse"``: per block (1x16) or tile (16x16) the
            better of the map-to-6 and map-to-4 block scale by that error of the dequantized
            block, ties to map-to-6 (TE ``nvfp4_4over6``, arXiv 2512.02010). Not with ``rht``.
        four_over_six_use_256: with ``four_over_six``: the global E4M3 bound 256 (True) or 448
            (False); None = 256, TE's default. Refused without ``four_over_six``.
        row_scaled: NVFP4 only, 1x16 / 16x1 blocks: one FP32 amax per row (per column for
            ``nvfp4_col``) for the second level instead of one per tensor (TE
            ``row_scaled_activation``).
        hadamard: a Hadamard transform over blocks of this many elements (a power of two, e.g.
            32 for Quartet, arXiv 2505.14669) along the block axis before quantizing
            (`fp8lab.hadamard_transform`); the QTensor dequantizes in the transformed domain.
    """

    format: str = "e4m3"
    granularity: str | tuple[int, int] = "tensor"
    scaling: ScalingLike = None
    rounding: str | None = None
    saturate: bool = True
    pad: bool = True
    margin: int = 0
    epsilon: float = 0.0
    scale_format: str = "e4m3"
    two_level: bool = True
    tensor_scale: float | None = None
    rht: bool = False
    four_over_six: str | None = None
    four_over_six_use_256: bool | None = None
    row_scaled: bool = False
    hadamard: int | None = None

    def __post_init__(self) -> None:
        fmt = self.format.name if isinstance(self.format, FloatFormat) else self.format
        get_format(fmt)  # validates
        object.__setattr__(self, "format", str(fmt))
        block = normalize_granularity(self.granularity)
        object.__setattr__(self, "granularity", canonical_granularity(block))
        sc = self.scaling
        if sc is None:
            sc = _default_scaling(block)
        if isinstance(sc, bool):
            raise TypeError(
                "scaling must be a rule name, a float or a DelayedScaling(Config), not a bool"
            )
        if isinstance(sc, str):
            sc = sc.strip().lower()
            if sc == "amax":
                sc = "max"
            if sc not in _rules.RULE_NAMES:
                _rules.get_rule(sc)  # raises with the list of names
        elif isinstance(sc, int | float):
            sc = float(sc)
            if not math.isfinite(sc) or sc <= 0:
                raise ValueError(f"a fixed scale must be a positive finite float, got {sc}")
        elif isinstance(sc, DelayedScaling | DelayedScalingConfig):
            if block != (-1, -1):
                raise ValueError("DelayedScaling is per-tensor: use granularity='tensor'")
            if isinstance(sc, DelayedScaling):
                # specs are configuration; the state belongs to whoever quantizes
                warnings.warn(
                    "QuantSpec(scaling=DelayedScaling(...)) is deprecated: give the spec the "
                    "configuration (scaling=ds.cfg) and the state to quantize "
                    "(fp8lab.quantize(x, spec, state=ds))",
                    DeprecationWarning,
                    stacklevel=3,  # the caller of QuantSpec(...) (through dataclass __init__)
                )
        else:
            raise TypeError(
                "scaling must be a rule name, a float or a DelayedScaling(Config), "
                f"got {type(sc).__name__}"
            )
        object.__setattr__(self, "scaling", sc)
        if self.rounding is None:
            object.__setattr__(self, "rounding", default_rounding(fmt))
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(
                f"unknown rounding {self.rounding!r}; valid: {', '.join(ROUNDING_MODES)}"
            )
        get_format(self.scale_format)
        if self.tensor_scale is not None:
            ts = self.tensor_scale
            if isinstance(ts, bool) or not isinstance(ts, int | float):
                raise TypeError(f"tensor_scale must be a float, got {type(ts).__name__}")
            if not (math.isfinite(ts) and ts > 0):
                raise ValueError(f"tensor_scale must be a positive finite float, got {ts!r}")
            if sc != "nvfp4" or not self.two_level:
                raise ValueError(
                    "tensor_scale is NVFP4's static second-level scale: it needs "
                    f"scaling='nvfp4' and two_level=True, got scaling={sc!r}, "
                    f"two_level={self.two_level}"
                )
            object.__setattr__(self, "tensor_scale", float(ts))
        object.__setattr__(self, "margin", int(self.margin))
        object.__setattr__(self, "epsilon", float(self.epsilon))
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        self._check_transforms(block, sc)

    def _check_transforms(self, block: tuple[int, int], sc: Any) -> None:
        """Validate ``rht``, ``four_over_six(_use_256)``, ``row_scaled`` and ``hadamard``."""
        for name in ("rht", "row_scaled"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        nvfp4 = sc == "nvfp4" and self.format == "e2m1" and self.two_level
        where = f"format={self.format!r}, granularity={self.granularity!r}, scaling={sc!r}"

        def need_nvfp4(field: str, value: Any) -> None:
            if not nvfp4:
                raise ValueError(
                    f"{field}={value!r} needs an NVFP4 spec (format='e2m1', scaling='nvfp4', "
                    f"two_level=True), got {where}, two_level={self.two_level}"
                )

        fos = self.four_over_six
        if fos is not None:
            if not isinstance(fos, str) or fos.strip().lower() not in ("mae", "mse"):
                raise ValueError(f"four_over_six must be 'mae' or 'mse' (or None), got {fos!r}")
            fos = fos.strip().lower()
            object.__setattr__(self, "four_over_six", fos)
            need_nvfp4("four_over_six", fos)
            if block not in ((1, 16), (16, 1), (16, 16)):
                raise ValueError(
                    f"four_over_six={fos!r} needs 1x16, 16x1 or 16x16 blocks, got {where}"
                )
            if self.tensor_scale is not None:
                raise ValueError(
                    f"four_over_six={fos!r} computes its own global scale: not with "
                    f"tensor_scale={self.tensor_scale!r}"
                )
        u256 = self.four_over_six_use_256
        if u256 is not None:
            if not isinstance(u256, bool):
                raise TypeError(f"four_over_six_use_256 must be a bool or None, got {u256!r}")
            if fos is None:
                raise ValueError(
                    f"four_over_six_use_256={u256} means nothing without four_over_six "
                    "('mae' or 'mse')"
                )
        if self.rht:
            need_nvfp4("rht", True)
            if block not in ((1, 16), (16, 1)):
                raise ValueError(
                    f"rht=True transforms 16-element blocks along one axis: it needs 1x16 "
                    f"('nvfp4') or 16x1 ('nvfp4_col') blocks, got {where}"
                )
            if fos is not None:
                raise ValueError(
                    f"rht=True with four_over_six={fos!r} on one spec: Transformer Engine does "
                    "not combine them; pick one"
                )
        if self.row_scaled:
            need_nvfp4("row_scaled", True)
            if block not in ((1, 16), (16, 1)):
                raise ValueError(
                    f"row_scaled=True needs 1x16 ('nvfp4') or 16x1 ('nvfp4_col') blocks, "
                    f"got {where}"
                )
            if self.tensor_scale is not None:
                raise ValueError("row_scaled=True computes per-row amaxes: not with tensor_scale")
        h = self.hadamard
        if h is not None:
            if isinstance(h, bool) or not isinstance(h, int) or h < 2 or h & (h - 1):
                raise ValueError(f"hadamard must be a power of two >= 2 (e.g. 32), got {h!r}")
            if block[0] != 1 and block[1] != 1:
                raise ValueError(
                    f"hadamard={h} transforms along one axis: it needs blocks of one row or "
                    f"one column (e.g. 'mx', 'mx_col'), got {where}"
                )
            if self.rht:
                raise ValueError(f"rht=True and hadamard={h} on one spec: pick one transform")

    @property
    def four_over_six_bound(self) -> float | None:
        """The 4over6 global E4M3 bound in force: 256.0 or 448.0 (None without 4over6)."""
        if self.four_over_six is None:
            return None
        return 448.0 if self.four_over_six_use_256 is False else 256.0

    @property
    def transform_axis(self) -> int | None:
        """The axis of the ``[R, C]`` view that ``rht``/``hadamard`` transform along (1: the
        block runs along a row; 0: down a column), None without a transform."""
        if not (self.rht or self.hadamard):
            return None
        return 0 if self.block[1] == 1 and self.block[0] != 1 else 1

    # ------------------------------------------------------------------ derived
    @property
    def fmt(self) -> FloatFormat:
        return get_format(self.format)

    @property
    def block(self) -> tuple[int, int]:
        """Normalised block shape ``(m, k)`` (-1 = full extent)."""
        return normalize_granularity(self.granularity)

    @property
    def is_delayed(self) -> bool:
        """Delayed scaling, as configuration or bound to a state (`DelayedScaling.bind`)."""
        return isinstance(self.scaling, DelayedScaling | DelayedScalingConfig)

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    def fresh(self) -> QuantSpec:
        """Deprecated: this spec with a new zero delayed-scaling state when it is bound to one
        (``DelayedScaling.bind``), else ``self`` (configuration holds no state)."""
        warnings.warn(
            "QuantSpec.fresh() is deprecated: specs hold configuration; a quantizing module owns "
            "its state (DelayedScaling.bind(spec.scaling, spec.format))",
            DeprecationWarning,
            stacklevel=2,
        )
        if isinstance(self.scaling, DelayedScaling):
            return dataclasses.replace(self, scaling=DelayedScaling.bind(self.scaling))
        return self

    def transposed(self) -> QuantSpec:
        """The spec with the block axes swapped (for the transposed direction)."""
        return dataclasses.replace(self, granularity=transpose_granularity(self.granularity))

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        """The one text form of a spec: ``format:granularity:scaling``, then the fields that
        differ from their defaults in parentheses, e.g. ``e4m3:1x128:pow2_down``,
        ``e4m3:tensor:delayed(h=1024, max)``, ``e2m1:nvfp4:nvfp4 (scale_format=e5m2)``,
        ``e4m3:tensor:1`` (a fixed multiplier). ``str(spec)`` is the same text."""
        g = self.granularity
        gran = g if isinstance(g, str) else f"{g[0]}x{g[1]}"
        sc = self.scaling
        if isinstance(sc, float):
            sc_s = f"{sc:g}"
        elif isinstance(sc, str):
            sc_s = sc
        else:  # delayed scaling: its configuration (a bound state shows the same)
            cfg = getattr(sc, "cfg", sc)
            algo = cfg.algorithm if isinstance(cfg.algorithm, str) else "callable"
            parts = [f"h={cfg.history_len}", algo]
            for name, default in (("margin", 0), ("interval", 1), ("nguard", 0)):
                if getattr(cfg, name) != default:
                    parts.append(f"{name}={getattr(cfg, name)}")
            if cfg.first_step != "unit":
                parts.append(f"first={cfg.first_step}")
            if getattr(cfg, "update_path", "fused") != "fused":
                parts.append(f"path={cfg.update_path}")
            sc_s = f"delayed({', '.join(parts)})"
        extra = []
        if self.rounding != default_rounding(self.format):
            extra.append(f"rounding={self.rounding}")
        for name, default in (
            ("saturate", True), ("pad", True), ("margin", 0), ("epsilon", 0.0),
            ("scale_format", "e4m3"), ("two_level", True), ("tensor_scale", None),
            *_LATER_FIELDS,
        ):  # fmt: skip
            v = getattr(self, name)
            if v != default:
                extra.append(f"{name}={v:g}" if isinstance(v, float) else f"{name}={v}")
        text = f"{self.format}:{gran}:{sc_s}"
        return f"{text} ({', '.join(extra)})" if extra else text

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain data (str/int/float/bool/list/dict): TOML/JSON friendly."""
        sc = self.scaling
        sc_plain: Any = {"delayed": sc.to_dict()} if self.is_delayed else sc
        return {
            "format": self.format,
            "granularity": granularity_to_plain(self.granularity),
            "scaling": sc_plain,
            "rounding": self.rounding,
            "saturate": self.saturate,
            "pad": self.pad,
            "margin": self.margin,
            "epsilon": self.epsilon,
            "scale_format": self.scale_format,
            "two_level": self.two_level,
            # only when set: specs written before it existed keep their exact dict
            **({} if self.tensor_scale is None else {"tensor_scale": self.tensor_scale}),
            **{k: getattr(self, k) for k, d in _LATER_FIELDS if getattr(self, k) != d},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        check_keys(d, (f.name for f in dataclasses.fields(cls)), "QuantSpec")
        kw = dict(d)
        g = kw.get("granularity")
        if isinstance(g, list):
            kw["granularity"] = tuple(g)
        sc = kw.get("scaling")
        if isinstance(sc, dict):
            if set(sc) != {"delayed"}:
                raise ValueError(f"scaling dict must be {{'delayed': {{...}}}}, got {sc!r}")
            kw["scaling"] = DelayedScalingConfig.from_dict(sc["delayed"])
        return cls(**kw)


def split_state(spec: QuantSpec) -> tuple[QuantSpec, DelayedScaling | None]:
    """``(configuration-only spec, its DelayedScaling or None)``: a spec of the deprecated form
    ``QuantSpec(scaling=DelayedScaling(...))`` split into the spec with ``ds.cfg`` and ``ds``;
    any other spec is returned as is, with None."""
    sc = spec.scaling
    if isinstance(sc, DelayedScaling):
        return dataclasses.replace(spec, scaling=sc.cfg), sc
    return spec, None


def _spec_from_args(
    fmt: str | FloatFormat | QuantSpec,
    granularity: GranularityLike | None,
    scaling: ScalingLike,
    rounding: str | None,
    saturate: bool | None,
    pad: bool | None,
    **kw: Any,
) -> QuantSpec:
    if isinstance(fmt, QuantSpec):
        changes: dict[str, Any] = {}
        for name, v in (
            ("granularity", granularity),
            ("scaling", scaling),
            ("rounding", rounding),
            ("saturate", saturate),
            ("pad", pad),
        ):
            if v is not None:
                changes[name] = v
        changes.update({k: v for k, v in kw.items() if v is not None})
        return dataclasses.replace(fmt, **changes) if changes else fmt
    if not isinstance(fmt, str | FloatFormat):
        raise TypeError(f"fmt must be a format name, FloatFormat or QuantSpec, got {type(fmt)}")
    args: dict[str, Any] = {
        "format": fmt.name if isinstance(fmt, FloatFormat) else fmt,
        "granularity": "tensor" if granularity is None else granularity,
        "scaling": scaling,
    }
    if rounding is not None:
        args["rounding"] = rounding
    if saturate is not None:
        args["saturate"] = saturate
    if pad is not None:
        args["pad"] = pad
    args.update({k: v for k, v in kw.items() if v is not None})
    return QuantSpec(**args)
