"""`SnrConfig`: one point of the dot-product SNR study (frozen, validated configuration)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fp8lab.formats import ROUNDING_MODES, get_format

__all__ = [
    "CORRELATION_MODELS",
    "EXACT_ACCUMULATOR",
    "PLOT_CAP_DB",
    "SCALE_RULE_CHOICES",
    "SnrConfig",
    "is_model_accumulator",
]

#: plots draw infinite SNR (an exact result) at this value; JSON writes null instead
PLOT_CAP_DB = 150.0

CORRELATION_MODELS = ("exact", "simple")
EXACT_ACCUMULATOR = "fp64"
#: ``scale_rule`` values: the study's own float64 rule, or a per-block rule of `fp8lab.scaling`
SCALE_RULE_CHOICES = ("exact", "max", "pow2_down", "pow2_up", "mx_floor", "mx_ceil", "mx_even",
                      "mx_rceil")  # fmt: skip


def is_model_accumulator(name: str | None) -> bool:
    """True when ``name`` is a GEMM accumulator model of `fp8lab.gemm` (``"limited"``, a GPU such
    as ``"h100"``) rather than a number format (``"e4m3"``, ``"fp32"``) or ``"fp64"``."""
    if name is None or name == EXACT_ACCUMULATOR:
        return False
    try:
        get_format(name)
        return False
    except ValueError:
        pass
    from fp8lab.gemm import Accumulator

    try:
        return Accumulator.parse(name).kind != "fp32"
    except (ValueError, TypeError):
        return False


@dataclass(frozen=True)
class SnrConfig:
    """One point of the study. Validated on construction (``ValueError`` naming the field).

    Attributes:
        length: vector length (elements); with ``block`` a multiple of it.
        samples: number of vector pairs (dot products).
        seed: RNG seed; runs with the same ``(seed, samples, length, sigma)`` share ``z1, z2``.
        sigma: standard deviation of the vector elements.
        rho: correlation parameter in ``[0, 1)``.
        correlation_model: ``"exact"`` or ``"simple"`` (see `fp8lab.lab.snr`).
        format: element format name (any fp8lab format).
        rounding: rounding mode of the element cast.
        scaling: ``"auto"`` or a fixed positive factor.
        block: per-block dynamic scaling block size, or None.
        scale_target: value the (block) amax is mapped to; None = the format's max.
        accumulator: how the products are summed. A format name (products and running sum
            rounded to it after every addition; None = the element format), ``"fp64"`` (exact),
            or a tensor-core model of `fp8lab.gemm` (``"limited"``, or a GPU name that
            ``fp8lab.gemm.Accumulator.parse`` accepts, e.g. ``"h100"``).
        acc_rounding: rounding of a format accumulator; None = ``rounding``.
        promote_every: promotion interval in elements, or None (no promotion; with ``block``: the
            block size).
        saturate: clamp overflow to +-max (else Inf/NaN as the format defines).
        scale_rule: how ``"auto"`` turns an amax into a multiplier: ``"exact"`` (the notebook's
            ``scale_target / amax`` in float64) or a rule of `fp8lab.scaling.rules` (``max``,
            ``pow2_down``, ``pow2_up``, ``mx_floor``, ``mx_ceil``, ``mx_even``, ``mx_rceil``)
            applied to the amax rounded to float32, as a quantizer of that rule computes it
            (``max`` is TE's current scaling; ``mx_*`` with ``block=32`` is MX).
    """

    length: int = 1024
    samples: int = 200
    seed: int = 0
    sigma: float = 0.01
    rho: float = 0.0
    correlation_model: str = "exact"
    format: str = "e4m3"
    rounding: str = "nearest_even"
    scaling: float | str = "auto"
    block: int | None = None
    scale_target: float | None = None
    accumulator: str | None = None
    acc_rounding: str | None = None
    promote_every: int | None = None
    saturate: bool = True
    scale_rule: str = "exact"

    def __post_init__(self) -> None:
        _positive_int("length", self.length)
        _positive_int("samples", self.samples)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not (
            isinstance(self.sigma, int | float) and math.isfinite(self.sigma) and self.sigma > 0
        ):
            raise ValueError(f"sigma must be a positive finite number, got {self.sigma!r}")
        if not (isinstance(self.rho, int | float) and 0.0 <= self.rho < 1.0):
            raise ValueError(f"rho must be in [0, 1), got {self.rho!r}")
        if self.correlation_model not in CORRELATION_MODELS:
            raise ValueError(
                f"correlation_model must be one of {CORRELATION_MODELS}, "
                f"got {self.correlation_model!r}"
            )
        get_format(self.format)  # raises ValueError listing the valid names
        self._check_scaling()
        self._check_accumulator()
        self._check_promotion()
        for name in ("rounding", "acc_rounding"):
            mode = getattr(self, name)
            if mode is not None and mode not in ROUNDING_MODES:
                raise ValueError(f"unknown {name} {mode!r}; valid: {', '.join(ROUNDING_MODES)}")

    def _check_scaling(self) -> None:
        if self.scaling != "auto":
            if isinstance(self.scaling, bool) or not isinstance(self.scaling, int | float):
                raise ValueError(f"scaling must be 'auto' or a number, got {self.scaling!r}")
            if not (math.isfinite(self.scaling) and self.scaling > 0):
                raise ValueError(f"scaling must be positive and finite, got {self.scaling!r}")
            object.__setattr__(self, "scaling", float(self.scaling))
        if self.block is not None:
            _positive_int("block", self.block)
            if self.scaling != "auto":
                raise ValueError(
                    f"a fixed scaling ({self.scaling:g}) cannot be combined with block={self.block}: "
                    "block scaling is dynamic (each block's amax maps to scale_target); "
                    "use scaling='auto' or drop block"
                )
            if self.length % self.block:
                raise ValueError(f"length {self.length} is not divisible by block {self.block}")
        if self.scale_target is not None:
            st = self.scale_target
            if not (isinstance(st, int | float) and math.isfinite(st) and st > 0):
                raise ValueError(f"scale_target must be positive and finite, got {st!r}")
            fmt = get_format(self.format)
            if st > fmt.max:
                raise ValueError(f"scale_target {st:g} exceeds the max of {fmt.name} ({fmt.max:g})")
            object.__setattr__(self, "scale_target", float(st))
        if self.scale_rule not in SCALE_RULE_CHOICES:
            raise ValueError(
                f"unknown scale_rule {self.scale_rule!r}; valid: {', '.join(SCALE_RULE_CHOICES)}"
            )
        if self.scale_rule != "exact":
            if self.scaling != "auto":
                raise ValueError(
                    f"scale_rule={self.scale_rule!r} computes the scale from the amax: use "
                    f"scaling='auto', not {self.scaling:g}"
                )
            if self.scale_target is not None:
                raise ValueError(
                    f"scale_rule={self.scale_rule!r} maps the amax to the format's max (its own "
                    f"rule); scale_target={self.scale_target:g} applies to scale_rule='exact' only"
                )

    def _check_accumulator(self) -> None:
        acc = self.accumulator
        if acc is None or acc == EXACT_ACCUMULATOR:
            return
        if is_model_accumulator(acc):
            from fp8lab.gemm import Accumulator

            fmt = get_format(self.format).name
            Accumulator.parse(acc, (fmt, fmt))  # a GPU without a row for the format: ValueError
            if self.acc_rounding is not None:
                raise ValueError(
                    f"acc_rounding={self.acc_rounding!r} does not apply to the {acc!r} "
                    "accumulator model: the model fixes its own rounding"
                )
            return
        try:
            get_format(acc)
        except ValueError as exc:
            raise ValueError(
                f"{exc}; or an accumulator model of fp8lab.gemm (e.g. 'limited', 'h100'), "
                f"or {EXACT_ACCUMULATOR!r} (exact)"
            ) from None

    def _check_promotion(self) -> None:
        if self.promote_every is not None:
            _positive_int("promote_every", self.promote_every)
            if self.block is not None and self.promote_every % self.block:
                raise ValueError(
                    f"promote_every {self.promote_every} must be a multiple of block {self.block}"
                )
        elif self.block is not None:
            object.__setattr__(self, "promote_every", self.block)
        if self.uses_model and self.block is not None and self.promote_every != self.block:
            raise ValueError(
                f"the {self.accumulator!r} accumulator model promotes every block (its scales "
                f"change along K): promote_every {self.promote_every} must equal block "
                f"{self.block}"
            )

    # resolved views -------------------------------------------------------------------------
    @property
    def uses_model(self) -> bool:
        """True when a tensor-core model of `fp8lab.gemm` sums the products."""
        return is_model_accumulator(self.accumulator)

    @property
    def accumulator_name(self) -> str:
        return self.accumulator if self.accumulator is not None else get_format(self.format).name

    @property
    def accumulator_rounding(self) -> str:
        """``acc_rounding``, else the element rounding (HiF8's ``hybrid`` only on HiF8, else
        ``nearest_even``)."""
        if self.acc_rounding is not None:
            return self.acc_rounding
        if self.rounding == "hybrid" and self.accumulator_name != "hif8":
            return "nearest_even"
        return self.rounding

    @property
    def accumulator_max(self) -> float:
        """Largest finite value of the accumulator: its format's max; FP32's for a tensor-core
        model (its accumulator and output are FP32); inf for ``"fp64"``."""
        if self.accumulator == EXACT_ACCUMULATOR:
            return math.inf
        return float(get_format("fp32" if self.uses_model else self.accumulator_name).max)

    @property
    def target(self) -> float:
        if self.scale_target is not None:
            return self.scale_target
        return float(get_format(self.format).max)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the defaults resolved (accumulator, scale_target, acc_rounding;
        ``acc_rounding`` is None for an accumulator model, which fixes its own rounding)."""
        d = asdict(self)
        d["accumulator"] = self.accumulator_name
        d["scale_target"] = self.target
        d["acc_rounding"] = None if self.uses_model else self.accumulator_rounding
        d["format"] = get_format(self.format).name
        return d


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
