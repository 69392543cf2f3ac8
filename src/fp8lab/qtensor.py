"""Quantized tensors: `QuantSpec`, `QTensor`, `quantize`, `fake_quant`, `retile`.

Quantization follows Transformer Engine: for every scale block, a rule turns the block amax into
a quantization multiplier ``scale`` and the elements become ``values = cast(x * scale)``
(``cast`` = `fp8lab.cast`, round-to-nearest-even and saturating by default). `QTensor.scales`
stores the **dequantization multipliers** ``scale_inv = 1/scale`` (TE's ``scale_inv``), so
``dequantize() = values * scales`` (times the FP32 tensor scale for NVFP4's second level).

amax is ``max |x|`` over the block with NaN ignored (TE's ``fmaxf`` reductions); NaN elements stay
NaN through the cast. See `fp8lab.scaling.rules` for what each rule does with an amax of 0, inf or
NaN, and `fp8lab.scaling.granularity` for block shapes and ragged edges.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab._bits import f32_to_u32 as _f32_to_u32
from fp8lab._bits import u32_to_f32 as _u32_to_f32
from fp8lab.formats import FloatFormat, get_format
from fp8lab.scaling import rules as _rules
from fp8lab.scaling.delayed import DelayedScaling
from fp8lab.scaling.granularity import (
    GranularityLike,
    as_2d,
    canonical_granularity,
    check_fit,
    expand_blocks,
    granularity_to_plain,
    normalize_granularity,
    num_blocks,
    resolve_block,
    shape_2d,
    transpose_granularity,
)

__all__ = [
    "QTensor",
    "QuantSpec",
    "fake_quant",
    "quantize",
    "retile",
    "retile_counts",
]

_MX_RULES = ("mx_floor", "mx_ceil", "mx_even", "mx_rceil")
_MX_MODE = {"mx_floor": 0, "mx_ceil": 1, "mx_even": 2, "mx_rceil": 3}
ScalingLike = str | float | int | DelayedScaling | None


def _default_scaling(block: tuple[int, int]) -> str:
    if block in ((1, 32), (32, 1)):
        return "mx_floor"
    if block in ((1, 16), (16, 1)):
        return "nvfp4"
    return "max"


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor. Frozen, hashable, serialisable with `to_dict`/`from_dict`.

    Attributes:
        format: element format name (`fp8lab.get_format`), e.g. ``"e4m3"``, ``"e5m2"``, ``"e2m1"``.
        granularity: ``"tensor"``, ``"row"``, ``"col"``, ``"mx"``, ``"mx_col"``, ``"nvfp4"``,
            ``"nvfp4_col"`` or a block ``(m, k)`` (-1 = full extent); stored canonically (a name
            if the block has one, else a tuple).
        scaling: a rule name (``max``, ``pow2_down``, ``pow2_up``, ``mx_floor``, ``mx_ceil``,
            ``mx_even``, ``mx_rceil``, ``nvfp4``), a fixed float quantization multiplier
            (``values = cast(x * scaling)``), or a `DelayedScaling` object (per-tensor only).
            ``None`` picks the granularity's natural rule: ``mx_floor`` for MX blocks (OCP),
            ``nvfp4`` for NVFP4 blocks, ``max`` otherwise.
        rounding: rounding mode of the element cast (`fp8lab.ROUNDING_MODES`); ``None`` = the
            format's native rule (``nearest_even``; ``nearest_away`` = TA for HiF8).
        saturate: clamp out-of-range values to ±max (TE's ``__NV_SATFINITE``) instead of Inf/NaN.
        pad: ragged edge blocks are treated as zero-padded (True) or raise (False).
        margin: power-of-two margin for the ``max`` family: ``scale = fmt_max * 2**-margin / amax``.
        epsilon: floor on amax for the ``max`` family (TE ``amax_epsilon``).
        scale_format: the NVFP4 block-scale format (E4M3).
        two_level: NVFP4 with the FP32 per-tensor second-level scale (True) or block scales only.
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
            raise TypeError("scaling must be a rule name, a float or a DelayedScaling, not a bool")
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
        elif isinstance(sc, DelayedScaling):
            if block != (-1, -1):
                raise ValueError("DelayedScaling is per-tensor: use granularity='tensor'")
        else:
            raise TypeError(
                f"scaling must be a rule name, a float or a DelayedScaling, got {type(sc).__name__}"
            )
        object.__setattr__(self, "scaling", sc)
        from fp8lab.formats import ROUNDING_MODES, default_rounding

        if self.rounding is None:
            object.__setattr__(self, "rounding", default_rounding(fmt))
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(
                f"unknown rounding {self.rounding!r}; valid: {', '.join(ROUNDING_MODES)}"
            )
        get_format(self.scale_format)
        object.__setattr__(self, "margin", int(self.margin))
        object.__setattr__(self, "epsilon", float(self.epsilon))
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

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
        return isinstance(self.scaling, DelayedScaling)

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)

    def fresh(self) -> QuantSpec:
        """This spec with a fresh `DelayedScaling` state (one per tensor); else ``self``."""
        if isinstance(self.scaling, DelayedScaling):
            return dataclasses.replace(self, scaling=self.scaling.fresh())
        return self

    def transposed(self) -> QuantSpec:
        """The spec with the block axes swapped (for the transposed direction)."""
        return dataclasses.replace(self, granularity=transpose_granularity(self.granularity))

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain data (str/int/float/bool/list/dict): TOML/JSON friendly."""
        sc = self.scaling
        sc_plain: Any = {"delayed": sc.config()} if isinstance(sc, DelayedScaling) else sc
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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown QuantSpec keys: {sorted(unknown)}")
        kw = dict(d)
        g = kw.get("granularity")
        if isinstance(g, list):
            kw["granularity"] = tuple(g)
        sc = kw.get("scaling")
        if isinstance(sc, dict):
            if set(sc) != {"delayed"}:
                raise ValueError(f"scaling dict must be {{'delayed': {{...}}}}, got {sc!r}")
            kw["scaling"] = DelayedScaling.from_config(sc["delayed"])
        return cls(**kw)


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


@dataclass(eq=False)
class QTensor:
    """A quantized tensor.

    Attributes:
        values: float32, the original shape, every element on the format's grid (the *scaled*
            values: ``x * scale`` after the cast).
        scales: float32 ``[nr, nc]`` per-block dequantization multipliers (TE ``scale_inv``;
            for MX exact powers of two, for NVFP4 the E4M3 block scales). Blocks tile the 2-D
            view ``[R, C]`` of the tensor (`fp8lab.scaling.granularity`).
        spec: the `QuantSpec` used.
        global_scale: NVFP4's FP32 tensor-level dequantization scale (``None`` otherwise).
        retiled: how many re-tilings led to this tensor (0 for a direct quantization).
        meta: free-form notes (re-tiling source and added error).
        scale_multipliers: the per-block *quantization* multipliers actually used
            (``values = cast(x * scale_multipliers)``; TE's ``scale``), same layout as ``scales``.
    """

    values: torch.Tensor
    scales: torch.Tensor
    spec: QuantSpec
    global_scale: torch.Tensor | None = None
    retiled: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    scale_multipliers: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def block(self) -> tuple[int, int]:
        return self.spec.block

    @property
    def fmt(self) -> FloatFormat:
        return self.spec.fmt

    def scale_tensor(self) -> torch.Tensor:
        """Per-block dequantization multipliers including the NVFP4 tensor scale."""
        if self.global_scale is None:
            return self.scales
        return self.scales * self.global_scale

    def dequantize(self) -> torch.Tensor:
        """``values * scales`` broadcast over the blocks (float32, the original shape)."""
        s2 = shape_2d(self.values.shape)
        sc = self.scales
        v2 = as_2d(self.values)
        if sc.numel() == 1:
            out = v2 * sc.reshape(())
        elif v2.dtype == torch.float32 and v2.is_contiguous() and v2.numel():
            # one vectorised pass, no expanded scale tensor
            out = torch.empty(s2, dtype=torch.float32)
            m, k = resolve_block(self.block, s2)
            _mul_blocks(
                v2.view(-1).numpy(), s2[0], s2[1], m, k,
                np.ascontiguousarray(sc.to(torch.float32).numpy()), out.view(-1).numpy(),
            )  # fmt: skip
        else:
            out = v2 * expand_blocks(sc, self.block, s2)
        if self.global_scale is not None:
            out = out * self.global_scale
        return out.reshape(self.values.shape)

    def codes(self) -> torch.Tensor:
        """uint8 bit codes of the element values (`fp8lab.encode`)."""
        from fp8lab.formats import encode

        return encode(self.values, self.fmt)

    def scale_codes(self) -> torch.Tensor:
        """E8M0 codes (uint8) of power-of-two scales (MX): ``exponent(scale) + 127``."""
        b = self.scales.contiguous().view(torch.int32)
        if bool(((b & 0x007FFFFF) != 0).any()):
            raise ValueError("scales are not all powers of two; E8M0 codes need an MX rule")
        code = (b >> 23) & 0xFF
        return torch.where(torch.isnan(self.scales), 255, code).to(torch.uint8)

    def t(self) -> QTensor:
        """The transpose of a 2-D quantized tensor (values, scales and block shape swapped)."""
        if self.values.dim() != 2:
            raise ValueError(f"t() needs a 2-D QTensor, got shape {tuple(self.values.shape)}")
        return QTensor(
            values=self.values.t(),
            scales=self.scales.t(),
            spec=self.spec.transposed(),
            global_scale=self.global_scale,
            retiled=self.retiled,
            meta=dict(self.meta),
            scale_multipliers=None
            if self.scale_multipliers is None
            else self.scale_multipliers.t(),
        )

    @property
    def T(self) -> QTensor:
        return self.t()

    def __repr__(self) -> str:
        return (
            f"QTensor(shape={tuple(self.values.shape)}, format={self.spec.format!r}, "
            f"granularity={self.spec.granularity!r}, scales={tuple(self.scales.shape)}, "
            f"retiled={self.retiled})"
        )


# ---------------------------------------------------------------------------------- kernels
# Two passes over x, no full-size temporaries: (1) block amax, NaN ignored; (2) multiply by the
# block's multiplier in float32 and round onto the grid (fast RNE+saturate path for ExMy formats
# with subnormals; any other mode writes x*scale and then runs fp8lab.cast in place).
# The kernels are serial numba loops over contiguous row segments, which LLVM vectorises (AVX2):
# measured here, a serial pass runs ~5x faster than the same loop under prange, whose thread pool
# competes with torch's OpenMP threads on this 2-core machine.
# Blocks taller than one row take their amax in a row-major sweep (one running max per column);
# blocks narrower than `_NARROW` columns are cast with the block row's multipliers expanded per
# column, so every row stays one vectorised sweep. The scale rules `max` and MX run as one numba
# pass over the block amaxes (a dozen small threaded torch ops cost more than the data pass on a
# busy 2-core machine). Pass (2) can also write the dequantized copy (``dequantized_out``), and
# both outputs can be caller-owned buffers (``out``): a fresh 32 MB tensor costs ~20 ms in page
# faults here, the pass into a warm buffer ~5 ms.
_AMAX_CHUNK = 64


@njit(cache=True)
def _seg_amax_bits(xs):  # pragma: no cover - numba
    """max |x| of a contiguous segment, on the uint32 bits; NaN (bits > 0x7F800000) counts as 0."""
    m = np.uint32(0)
    for i in range(xs.shape[0]):
        a = xs[i] & np.uint32(0x7FFFFFFF)
        ok = np.uint32(a <= np.uint32(0x7F800000))
        m = np.uint32(max(m, a * ok))
    return m


@njit(cache=True)
def _partial_amax(xu, rows, cols, bm, bk, chunk, out):  # pragma: no cover - numba
    """out[t, cb] = bits of max |x| over rows [t*chunk, (t+1)*chunk) and column block cb.

    |x| orders like its bits, so this is an integer max; NaN is ignored as TE's ``fmaxf`` does.
    """
    nt, nc = out.shape
    for t in range(nt):
        r0 = t * chunk
        r1 = min(r0 + chunk, rows)
        for cb in range(nc):
            c0 = cb * bk
            c1 = min(c0 + bk, cols)
            m = np.uint32(0)
            for r in range(r0, r1):
                m = np.uint32(max(m, _seg_amax_bits(xu[r * cols + c0 : r * cols + c1])))
            out[t, cb] = m


@njit(cache=True)
def _acc_amax_bits(xs, acc):  # pragma: no cover - numba
    """acc[i] = max(acc[i], bits of |xs[i]|), NaN counted as 0 (a vectorisable row sweep)."""
    for i in range(xs.shape[0]):
        a = xs[i] & np.uint32(0x7FFFFFFF)
        ok = np.uint32(a <= np.uint32(0x7F800000))
        acc[i] = np.uint32(max(acc[i], a * ok))


@njit(cache=True)
def _row_block_amax(xu, rows, cols, bm, bk, acc, out):  # pragma: no cover - numba
    """out[br, cb] = bits of max |x| over block (br, cb), NaN ignored; ``acc``: [cols] scratch.

    Walks rows in memory order: ``acc[c]`` holds the running max of column c over the block row.
    """
    nr, nc = out.shape
    for br in range(nr):
        acc[:] = 0
        for r in range(br * bm, min((br + 1) * bm, rows)):
            _acc_amax_bits(xu[r * cols : (r + 1) * cols], acc)
        for cb in range(nc):
            m = np.uint32(0)
            for c in range(cb * bk, min((cb + 1) * bk, cols)):
                m = np.uint32(max(m, acc[c]))
            out[br, cb] = m


@njit(cache=True, error_model="numpy")  # IEEE division: x / 0 -> inf, no exception
def _max_rule_scales(amax, scaled_max, eps, value_for_inf, s_out, inv_out):  # pragma: no cover
    """`fp8lab.scaling.rules.max_scale` and its reciprocal in one pass over the block amaxes.

    Same float32 operations as the torch version: ``amax = max(amax, eps)`` (eps > 0 only),
    one correctly rounded division, amax of 0/inf/NaN -> 1, an infinite scale -> value_for_inf;
    ``inv = 1 / scale`` correctly rounded (``torch.reciprocal``).
    """
    one = np.float32(1.0)
    for i in range(amax.shape[0]):
        a = amax[i]
        if eps > np.float32(0.0) and a < eps:
            a = eps
        sc = np.float32(scaled_max / a)
        if not (np.isfinite(a) and a > np.float32(0.0)):
            sc = one
        if np.isinf(sc):
            sc = value_for_inf
        s_out[i] = sc
        inv_out[i] = np.float32(one / sc)


@njit(cache=True, inline="always")
def _pow2(e):  # pragma: no cover - numba
    """2**e as float32 for integer e in [-149, 127] (exact; subnormal below -126)."""
    if e >= -126:
        return _u32_to_f32(np.uint32((e + 127) << 23))
    return _u32_to_f32(np.uint32(1 << (e + 149)))


@njit(cache=True)
def _mx_rule_scales(amax_bits, mode, emax, mbits, fmax_recip, s_out, inv_out):  # pragma: no cover
    """The MX rules of `fp8lab.scaling.rules` (`mx_exponent` then `e8m0_to_scale` and
    `e8m0_to_scale_inv`) in one pass over the block amaxes' bits, with the same integer steps.

    mode: 0 floor, 1 ceil, 2 even, 3 rceil (``fl32(amax * fmax_recip)``). Code 255 -> NaN.
    """
    nan = _u32_to_f32(np.uint32(0x7FC00000))
    for i in range(amax_bits.shape[0]):
        b = np.int64(amax_bits[i] & np.uint32(0x7FFFFFFF))  # |amax|
        finite = (b & 0x7F800000) != 0x7F800000
        bb = np.int64(0)
        if mode == 3:
            r = _f32_to_u32(np.float32(_u32_to_f32(np.uint32(b)) * fmax_recip))
            e = np.int64((r >> np.uint32(23)) & np.uint32(0xFF))
            mant = np.int64(r & np.uint32(0x007FFFFF))
            code = e
            if mant > 0 and e != 0xFE and not (e == 0 and mant <= 0x400000):
                code = e + 1
            if e == 0xFF:
                code = 0xFE if mant == 0 else 0xFF  # inf -> 0xFE, NaN -> 0xFF
            if r == np.uint32(0):
                code = 0
        else:
            if mode == 0:
                e = ((b >> 23) & 0xFF) - 127
            elif mode == 1:
                e = ((b >> 23) & 0xFF) - 127 + (1 if (b & 0x007FFFFF) != 0 else 0)
            else:
                d = 23 - mbits
                bb = (b + (1 << (d - 1))) & 0x7F800000 if d > 0 else b & 0x7F800000
                e = ((bb >> 23) & 0xFF) - 127
            code = min(max(e - emax, -127), 128) + 127
            if not finite:
                code = 255
            if mode == 2 and ((bb >> 23) & 0xFF) == 255:
                code = 255
        if code == 255:
            s_out[i] = nan
            inv_out[i] = nan
        else:
            s_out[i] = _pow2(127 - code)
            inv_out[i] = _pow2(code - 127)


@njit(cache=True)
def _max_abs_diff(a, b):  # pragma: no cover - numba
    """max |a - b| over two float32 vectors with NaN -> 0 and inf -> FLT_MAX (torch.nan_to_num)."""
    big = np.float32(3.4028234663852886e38)
    m = np.float32(0.0)
    for i in range(a.shape[0]):
        d = np.float32(abs(a[i] - b[i]))
        d = np.float32(0.0) if d != d else d
        d = big if d > big else d
        m = max(m, d)
    return m


@njit(cache=True)
def _seg_mul(xs, os, s):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = xs[i] * s


@njit(cache=True)
def _scale_mul(x, rows, cols, bm, bk, mult, of):  # pragma: no cover - numba
    for r in range(rows):
        br = r // bm
        base = r * cols
        for cb in range(mult.shape[1]):
            c0 = base + cb * bk
            c1 = base + min((cb + 1) * bk, cols)
            _seg_mul(x[c0:c1], of[c0:c1], mult[br, cb])


@njit(cache=True, inline="always")
def _rne_sat(y, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero):
    """RNE + saturate of a float32 onto an ExMy grid with subnormals (see `_fast_params`).

    Branch-free (selects only) so that the loop around it vectorises.
    """
    u = _f32_to_u32(y)
    a = u & np.uint32(0x7FFFFFFF)
    sign = u ^ a
    # normal binades: round the fp32 significand to mbits bits (carry may bump the exponent);
    # +inf lands on 0x7F800000 and saturates with everything else above max
    an = min((a + half_m1 + ((a >> shift) & np.uint32(1))) & lowmask, maxbits)
    # below the smallest normal the quantum is fixed: RNE by the magic-number add
    asub = _f32_to_u32((abs(y) + magic) - magic)
    r = an if a >= emin_bits else asub
    r = a if a > np.uint32(0x7F800000) else r  # NaN stays NaN
    keep_sign = signed_zero or r != np.uint32(0)
    sign = sign if keep_sign else np.uint32(0)
    return _u32_to_f32(np.uint32(sign | r))


@njit(cache=True)
def _seg_cast(
    xs, os, s, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = _rne_sat(xs[i] * s, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero)


@njit(cache=True, inline="always")
def _rne_consts(mbits, emin_biased):  # pragma: no cover - numba
    """Bit constants of `_rne_sat` for an ExMy grid: rounding shift, half-ulp - 1, kept-bits
    mask, and the float32 bits of the smallest normal's exponent."""
    shift = np.uint32(23 - mbits)
    half_m1 = (np.uint32(1) << (shift - np.uint32(1))) - np.uint32(1)
    lowmask = ~((np.uint32(1) << shift) - np.uint32(1))
    emin_bits = np.uint32(emin_biased) << np.uint32(23)
    return shift, half_m1, lowmask, emin_bits


@njit(cache=True)
def _scale_cast_rne(
    x, rows, cols, bm, bk, mult, of, mbits, emin_biased, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    """of = RNE_saturate(x * mult[block]) onto an ExMy grid with subnormals."""
    shift, half_m1, lowmask, emin_bits = _rne_consts(mbits, emin_biased)
    for r in range(rows):
        br = r // bm
        base = r * cols
        for cb in range(mult.shape[1]):
            c0 = base + cb * bk
            c1 = base + min((cb + 1) * bk, cols)
            _seg_cast(
                x[c0:c1], of[c0:c1], mult[br, cb], shift, half_m1, lowmask, emin_bits, maxbits,
                magic, signed_zero,
            )  # fmt: skip


@njit(cache=True)
def _seg_cast_deq(
    xs, os, ds, s, inv, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        v = _rne_sat(xs[i] * s, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero)
        os[i] = v
        ds[i] = v * inv


@njit(cache=True)
def _scale_cast_rne_deq(
    x, rows, cols, bm, bk, mult, inv, of, df, mbits, emin_biased, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    """`_scale_cast_rne` that also writes ``df = of * inv[block]`` (the dequantized tensor,
    bit for bit `QTensor.dequantize`) in the same pass."""
    shift, half_m1, lowmask, emin_bits = _rne_consts(mbits, emin_biased)
    for r in range(rows):
        br = r // bm
        base = r * cols
        for cb in range(mult.shape[1]):
            c0 = base + cb * bk
            c1 = base + min((cb + 1) * bk, cols)
            _seg_cast_deq(
                x[c0:c1], of[c0:c1], df[c0:c1], mult[br, cb], inv[br, cb], shift, half_m1,
                lowmask, emin_bits, maxbits, magic, signed_zero,
            )  # fmt: skip


@njit(cache=True)
def _expand_row(mult_row, bk, cols, out):  # pragma: no cover - numba
    for c in range(cols):
        out[c] = mult_row[c // bk]


@njit(cache=True)
def _segv_cast(
    xs, os, sv, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = _rne_sat(
            xs[i] * sv[i], shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero
        )


@njit(cache=True)
def _segv_cast_deq(
    xs, os, ds, sv, iv, shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        v = _rne_sat(xs[i] * sv[i], shift, half_m1, lowmask, emin_bits, maxbits, magic, signed_zero)
        os[i] = v
        ds[i] = v * iv[i]


@njit(cache=True)
def _scale_cast_rne_narrow(
    x, rows, cols, bm, bk, mult, inv, of, df, deq, mbits, emin_biased, maxbits, magic, signed_zero
):  # pragma: no cover - numba
    """`_scale_cast_rne(_deq)` for narrow blocks (``bk`` of a few columns, e.g. (128, 1)):
    the block row's multipliers are expanded to one per column once, so each row is one
    vectorisable sweep instead of ``cols / bk`` tiny segments."""
    shift, half_m1, lowmask, emin_bits = _rne_consts(mbits, emin_biased)
    sv = np.empty(cols, dtype=np.float32)
    iv = np.empty(cols, dtype=np.float32)
    for br in range(mult.shape[0]):
        _expand_row(mult[br], bk, cols, sv)
        if deq:
            _expand_row(inv[br], bk, cols, iv)
        for r in range(br * bm, min((br + 1) * bm, rows)):
            a, b = r * cols, (r + 1) * cols
            if deq:
                _segv_cast_deq(
                    x[a:b], of[a:b], df[a:b], sv, iv, shift, half_m1, lowmask, emin_bits,
                    maxbits, magic, signed_zero,
                )  # fmt: skip
            else:
                _segv_cast(
                    x[a:b], of[a:b], sv, shift, half_m1, lowmask, emin_bits, maxbits, magic,
                    signed_zero,
                )  # fmt: skip


@njit(cache=True)
def _segv_mul(xs, os, sv):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = xs[i] * sv[i]


@njit(cache=True)
def _scale_mul_narrow(x, rows, cols, bm, bk, mult, of):  # pragma: no cover - numba
    """`_scale_mul` for narrow blocks (see `_scale_cast_rne_narrow`)."""
    sv = np.empty(cols, dtype=np.float32)
    for br in range(mult.shape[0]):
        _expand_row(mult[br], bk, cols, sv)
        for r in range(br * bm, min((br + 1) * bm, rows)):
            _segv_mul(x[r * cols : (r + 1) * cols], of[r * cols : (r + 1) * cols], sv)


# blocks narrower than this many columns use the expanded-multiplier kernels
_NARROW = 32


def _mul_blocks(x, rows: int, cols: int, m: int, k: int, mult, of) -> None:
    """of = x * mult[block] over flat float32 arrays (numba; narrow blocks swept per row)."""
    if k < _NARROW and k < cols:
        _scale_mul_narrow(x, rows, cols, m, k, mult, of)
    else:
        _scale_mul(x, rows, cols, m, k, mult, of)


def _fast_params(spec: QuantSpec) -> tuple[int, int, int, np.float32, bool] | None:
    """Kernel constants of the fast RNE + saturate path, or None if the spec needs `cast`."""
    return _fast_params_for(spec.format, spec.rounding, spec.saturate)


@functools.lru_cache(maxsize=64)
def _fast_params_for(
    fmt_name: str, rounding: str, saturate: bool
) -> tuple[int, int, int, np.float32, bool] | None:
    f = get_format(fmt_name)
    if (
        rounding != "nearest_even"
        or not saturate
        or f.kind != "exmy"
        or not f.subnormals
        or not f.signed
        or not f.has_zero
        or f.mbits >= 23
        or f.emin < -126
        or f.emin - f.mbits < -149
    ):
        return None
    maxbits = int(np.array(f.max, dtype=np.float32).view(np.uint32))
    magic = np.float32(2.0 ** (f.emin - f.mbits + 23))
    return f.mbits, f.emin + 127, maxbits, magic, f.signed_zero


def _block_amax_fast(x2: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block NaN-ignoring amax of a contiguous float32 [R, C] tensor (numba)."""
    rows, cols = x2.shape
    m, k = resolve_block(block, (rows, cols))
    nr, nc = num_blocks((rows, cols), (m, k))
    if x2.numel() == 0:
        return torch.zeros((nr, nc), dtype=torch.float32)
    if m > 1:
        # blocks taller than one row: a row-major sweep keeping one running max per column
        # (a column-wise walk over (128, 1) blocks measured 40 ms on 2048 x 4096, this 2 ms)
        out = np.empty((nr, nc), dtype=np.uint32)
        acc = np.empty(cols, dtype=np.uint32)
        _row_block_amax(x2.view(-1).numpy().view(np.uint32), rows, cols, m, k, acc, out)
        return torch.from_numpy(out.view(np.float32))
    chunk = m if m <= _AMAX_CHUNK else math.gcd(m, _AMAX_CHUNK)
    nt = -(-rows // chunk)
    part = np.empty((nt, nc), dtype=np.uint32)
    _partial_amax(x2.view(-1).numpy().view(np.uint32), rows, cols, m, k, chunk, part)
    pt = torch.from_numpy(part.view(np.float32))
    per = m // chunk
    if per == 1:
        return pt
    if nt != nr * per:
        pt = torch.cat([pt, pt.new_zeros((nr * per - nt, nc))])
    return pt.reshape(nr, per, nc).amax(dim=1)


def _scale_cast(
    x2: torch.Tensor,
    mult: torch.Tensor,
    block: tuple[int, int],
    spec: QuantSpec,
    generator: torch.Generator | None,
    out: torch.Tensor | None = None,
    deq: torch.Tensor | None = None,
    inv: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """values = cast(x * mult[block]) for a contiguous float32 [R, C] tensor; float32 [R, C].

    ``out``: a contiguous float32 [R, C] buffer for the values (else allocated). ``deq``: a
    second buffer that receives ``values * inv[block] (* global_scale)``, bit for bit what
    `QTensor.dequantize` computes, fused into the cast pass on the fast path.
    """
    rows, cols = x2.shape
    m, k = resolve_block(block, (rows, cols))
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32)
    if x2.numel() == 0:
        return out
    mult_np = np.ascontiguousarray(mult.to(torch.float32).numpy())
    xf = x2.view(-1).numpy()
    of = out.view(-1).numpy()
    fp = _fast_params(spec)
    if fp is not None:
        mbits, emin_b, maxbits, magic, signed_zero = fp
        if k < _NARROW and k < cols:
            inv_np = (
                mult_np
                if deq is None
                else np.ascontiguousarray(inv.to(torch.float32).reshape(mult_np.shape).numpy())
            )
            dfl = of if deq is None else deq.view(-1).numpy()
            _scale_cast_rne_narrow(
                xf, rows, cols, m, k, mult_np, inv_np, of, dfl, deq is not None, mbits,
                np.uint32(emin_b), np.uint32(maxbits), magic, signed_zero,
            )  # fmt: skip
            if deq is not None and global_scale is not None:
                deq.mul_(global_scale)
            return out
        if deq is not None:
            inv_np = np.ascontiguousarray(inv.to(torch.float32).reshape(mult_np.shape).numpy())
            _scale_cast_rne_deq(
                xf, rows, cols, m, k, mult_np, inv_np, of, deq.view(-1).numpy(), mbits,
                np.uint32(emin_b), np.uint32(maxbits), magic, signed_zero,
            )  # fmt: skip
            if global_scale is not None:
                deq.mul_(global_scale)
            return out
        _scale_cast_rne(
            xf, rows, cols, m, k, mult_np, of, mbits, np.uint32(emin_b), np.uint32(maxbits), magic, signed_zero,
        )  # fmt: skip
        return out
    _mul_blocks(xf, rows, cols, m, k, mult_np, of)
    from fp8lab.formats import cast

    cast(
        out, spec.fmt, rounding=spec.rounding, saturate=spec.saturate, generator=generator, out=out
    )
    if deq is not None:
        inv_np = np.ascontiguousarray(inv.to(torch.float32).reshape(mult_np.shape).numpy())
        _mul_blocks(of, rows, cols, m, k, inv_np, deq.view(-1).numpy())
        if global_scale is not None:
            deq.mul_(global_scale)
    return out


def _scales_for(
    x2: torch.Tensor, spec: QuantSpec, value_for_inf: float = _rules.FLT_MAX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-block quantization multiplier, per-block scale_inv, global dequant scale)."""
    sc = spec.scaling
    block = spec.block
    nb = num_blocks(tuple(x2.shape), block)
    if isinstance(sc, float):
        s = torch.full(nb, sc, dtype=torch.float32)
        return s, torch.reciprocal(s), None
    if isinstance(sc, DelayedScaling):
        amax = _block_amax_fast(x2, (-1, -1)).reshape(())
        s = sc.scale_for(amax, spec.fmt)
        sc.observe(amax)
        s = s.reshape(1, 1)
        return s, torch.reciprocal(s), None
    amax = _block_amax_fast(x2, block)
    if sc == "nvfp4":
        tensor_amax = amax.amax() if (spec.two_level and amax.numel()) else None
        if spec.two_level and tensor_amax is None:
            tensor_amax = torch.zeros(())
        s_blk, s_dec, enc = _rules.nvfp4_scales(
            amax, tensor_amax, spec.fmt, scale_format=spec.scale_format
        )
        return enc, s_blk, (s_dec if spec.two_level else None)
    if sc in _MX_RULES:
        # fused: the torch version is ~15 small ops over the block scales
        f = spec.fmt
        a = np.ascontiguousarray(amax.to(torch.float32).numpy()).reshape(-1).view(np.uint32)
        s_np = np.empty(a.shape[0], dtype=np.float32)
        inv_np = np.empty(a.shape[0], dtype=np.float32)
        recip = np.float32(1.0) / np.float32(f.max)  # TE's fl32(1/fmt_max), correctly rounded
        _mx_rule_scales(a, _MX_MODE[sc], f.emax, f.mbits, recip, s_np, inv_np)
        return (
            torch.from_numpy(s_np).reshape(amax.shape),
            torch.from_numpy(inv_np).reshape(amax.shape),
            None,
        )
    if sc == "max":
        # the `max` rule and its reciprocal fused (a handful of torch ops on the block scales
        # cost more than the amax pass itself on a loaded 2-core machine)
        a = np.ascontiguousarray(amax.to(torch.float32).numpy()).reshape(-1)
        s_np = np.empty(a.shape[0], dtype=np.float32)
        inv_np = np.empty(a.shape[0], dtype=np.float32)
        _max_rule_scales(
            a, np.float32(spec.fmt.max * 2.0 ** (-spec.margin)), np.float32(spec.epsilon),
            np.float32(value_for_inf), s_np, inv_np,
        )  # fmt: skip
        return (
            torch.from_numpy(s_np).reshape(amax.shape),
            torch.from_numpy(inv_np).reshape(amax.shape),
            None,
        )
    s = _rules.get_rule(sc)(
        amax, spec.fmt, margin=spec.margin, epsilon=spec.epsilon, value_for_inf=value_for_inf
    )
    return s, torch.reciprocal(s), None


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat | QuantSpec = "e4m3",
    granularity: GranularityLike | None = None,
    scaling: ScalingLike = None,
    rounding: str | None = None,
    *,
    saturate: bool | None = None,
    pad: bool | None = None,
    margin: int | None = None,
    epsilon: float | None = None,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    dequantized_out: torch.Tensor | None = None,
) -> QTensor:
    """Quantize ``x`` (float tensor, any shape) under a spec.

    ``fmt`` is a format name / `FloatFormat` (then the other arguments build a `QuantSpec`) or a
    `QuantSpec` (then non-None arguments override its fields). Returns a `QTensor` whose
    ``values = cast(x * scale)`` per block and ``scales = 1/scale``. With a `DelayedScaling`
    the current scale is used and this tensor's amax is recorded (call its ``update()`` once per
    step). ``generator`` feeds stochastic rounding. float16/bfloat16/float64 inputs are first
    converted to float32 (float64 rounds once there; TE multiplies in FP32 as well).

    Buffers (no allocation of full-size outputs): ``out`` receives the values and becomes
    ``QTensor.values``; ``dequantized_out`` receives ``QTensor.dequantize()`` (bit for bit),
    computed in the same pass as the values where the fast kernel applies. Each must be a
    contiguous float32 CPU tensor of ``x``'s shape; they must not overlap each other (``out``
    may be ``x`` itself when ``x`` is contiguous float32). The caller owns both buffers.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"fp8lab quantizes on the CPU; got a tensor on {x.device}")
    spec = _spec_from_args(
        fmt, granularity, scaling, rounding, saturate, pad, margin=margin, epsilon=epsilon
    )
    x = x.detach()
    s2 = shape_2d(x.shape)
    check_fit(s2, spec.block, spec.pad)
    x2 = x.reshape(s2).to(torch.float32).contiguous()
    # TE: an infinite scale (tiny amax) becomes FLT_MAX per tensor, but the input dtype's max in
    # the block-scaling kernels (compute_scale_from_types<IType>)
    vinf = _rules.FLT_MAX
    if spec.block != (-1, -1) and x.dtype in (torch.bfloat16, torch.float16):
        vinf = torch.finfo(x.dtype).max
    out2 = _check_buffer(out, x, "out")
    deq2 = _check_buffer(dequantized_out, x, "dequantized_out")
    if out2 is not None and deq2 is not None and _overlap(out2, deq2):
        raise ValueError("out and dequantized_out must not overlap")
    s, s_inv, g = _scales_for(x2, spec, vinf)
    values = _scale_cast(x2, s, spec.block, spec, generator, out2, deq2, s_inv, g)
    values = values.reshape(x.shape)
    nb = num_blocks(s2, spec.block)
    return QTensor(
        values=values,
        scales=s_inv.reshape(nb),
        spec=spec,
        global_scale=g,
        scale_multipliers=s.reshape(nb),
    )


def _check_buffer(buf: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """``buf`` as a 2-D [R, C] view after validating it as an output buffer for ``x``."""
    if buf is None:
        return None
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32 or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 CPU tensor, got {buf.dtype} on {buf.device}"
            + ("" if buf.is_contiguous() else " (not contiguous)")
        )
    if tuple(buf.shape) != tuple(x.shape):
        raise ValueError(f"{name} has shape {tuple(buf.shape)}, expected {tuple(x.shape)}")
    if buf.requires_grad:
        raise ValueError(f"{name} must not require grad")
    return buf.view(shape_2d(x.shape))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


def fake_quant(
    x: torch.Tensor,
    fmt: str | FloatFormat | QuantSpec = "e4m3",
    granularity: GranularityLike | None = None,
    scaling: ScalingLike = None,
    rounding: str | None = None,
    **kw: Any,
) -> torch.Tensor:
    """``quantize(x, ...).dequantize()``: float32, ``x``'s shape."""
    return quantize(x, fmt, granularity, scaling, rounding, **kw).dequantize()


# ---------------------------------------------------------------------------------- retile
_RETILE_COUNTS = {"from_quantized": 0, "from_source": 0}


def retile_counts(reset: bool = False) -> dict[str, int]:
    """How many re-tilings ran in this process, by source; ``reset=True`` zeroes the counters."""
    out = dict(_RETILE_COUNTS)
    if reset:
        for k in _RETILE_COUNTS:
            _RETILE_COUNTS[k] = 0
    return out


def retile(
    q: QTensor,
    to: GranularityLike | None = None,
    *,
    source: torch.Tensor | None = None,
    spec: QuantSpec | None = None,
    measure_error: bool = True,
    dequantized: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dequantized_out: torch.Tensor | None = None,
) -> QTensor:
    """Re-tile a quantized tensor for the other GEMM direction. Explicit and counted.

    Returns a `QTensor` of the *same* logical tensor (same shape) with granularity ``to``
    (default: the block transposed, (1, 128) -> (128, 1), ``mx`` -> ``mx_col``).

    * ``source=None``: from the quantized values, as DeepSeek-V3 does (dequantize, re-quantize
      into the new tiles). Power-of-two scales keep this nearly lossless; other rules add a second
      rounding, which `QTensor.meta["retile_added_error"]` reports (max |new - old dequantized|,
      NaN ignored). ``measure_error=False`` skips that extra pass over the tensor (the entry is
      then ``None``; the re-tiling is still counted). ``dequantized``: ``q.dequantize()`` if
      the caller already has it (saves recomputing it; it must be exactly that tensor's values).
    * ``source=x``: from the high-precision tensor, as TE's MXFP8 does (rowwise and columnwise
      copies quantized independently from the same source).

    ``spec`` overrides the whole target spec (default: ``q.spec`` with the new granularity).
    ``out`` / ``dequantized_out``: buffers for the new values and their dequantized copy, as in
    `quantize`.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"retile expects a QTensor, got {type(q).__name__}")
    target = spec or q.spec.replace(
        granularity=to if to is not None else transpose_granularity(q.spec.granularity)
    )
    if isinstance(target.scaling, DelayedScaling):
        raise ValueError("retile does not apply to DelayedScaling (per-tensor) QTensors")
    if source is not None:
        if tuple(source.shape) != tuple(q.shape):
            raise ValueError(
                f"source shape {tuple(source.shape)} does not match the QTensor {tuple(q.shape)}"
            )
        res = quantize(source, target, out=out, dequantized_out=dequantized_out)
        _RETILE_COUNTS["from_source"] += 1
        res.meta["retile_source"] = "source"
    else:
        if dequantized is None:
            deq = q.dequantize()
        else:
            if tuple(dequantized.shape) != tuple(q.shape) or dequantized.dtype != torch.float32:
                raise ValueError(
                    f"dequantized must be float32 of shape {tuple(q.shape)}, got "
                    f"{dequantized.dtype} {tuple(dequantized.shape)}"
                )
            deq = dequantized
        res = quantize(deq, target, out=out, dequantized_out=dequantized_out)
        _RETILE_COUNTS["from_quantized"] += 1
        res.meta["retile_source"] = "quantized"
        err: float | None = None
        if measure_error:
            new = res.dequantize() if dequantized_out is None else dequantized_out
            err = _added_error(new, deq)
        res.meta["retile_added_error"] = err
    res.retiled = q.retiled + 1
    return res


def _added_error(new: torch.Tensor, old: torch.Tensor) -> float:
    """max |new - old| with NaN ignored and inf counted as FLT_MAX, in one pass."""
    if old.numel() == 0:
        return 0.0
    a = new.reshape(-1).to(torch.float32).contiguous()
    b = old.reshape(-1).to(torch.float32).contiguous()
    return float(_max_abs_diff(a.numpy(), b.numpy()))
