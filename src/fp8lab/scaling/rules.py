"""Scale rules: block amax -> scale. One function per rule.

Conventions (Transformer Engine's):

* ``scale`` is the **quantization multiplier**: the cast is ``values = cast(x * scale)``.
* ``scale_inv = 1 / scale`` is the **dequantization multiplier**, the number `QTensor.scales`
  stores (TE's ``scale_inv``; for power-of-two rules it is exact).

Every rule takes a float32 tensor of block amaxes (any shape) and the element format, and returns
the float32 ``scale`` tensor of the same shape. The MX rules are computed on the bits of the FP32
amax (no float ``log2``, which is off by one just below powers of two); `mx_exponent` returns their
biased E8M0 codes.

Rules
-----
``max``        TE current scaling (``compute_scale_from_amax``): ``amax = max(amax, epsilon)``;
               amax of 0, inf or NaN -> scale 1.0; else ``fmt_max * 2**-margin / amax`` with one
               correctly rounded float32 division; an infinite result (tiny amax) -> FLT_MAX.
``pow2_down``  ``max`` then the scale's FP32 mantissa zeroed (TE ``use_power_2_scales``,
               Float8BlockScaling's default): the multiplier is rounded *down*, so nothing clips.
``pow2_up``    ``max`` then the multiplier rounded *up* to a power of two (more resolution, the
               block amax may saturate). Directions refer to the multiplier ``scale``.
``mx_floor``   OCP MX v1.0 §6.3: ``X = 2**(floor(log2 amax) - emax_elem)`` (torchao FLOOR,
               microxcaling). Blocks whose amax mantissa exceeds the element max clip.
``mx_ceil``    torchao CEIL: ``X = 2**(ceil(log2 amax) - emax_elem)``.
``mx_even``    torchao EVEN: amax's mantissa rounded to the element's mantissa width, then floor.
               A finite amax whose rounding carries past 2**127 (FLT_MAX) takes exponent 128:
               the finite code ``128 - emax_elem + 127`` (247 for E4M3).
``mx_rceil``   cuBLAS / TE MXFP8 / DeepGEMM ``ceil_to_ue8m0``: ``X = 2**ceil(log2(amax/fmt_max))``,
               never clips. The quotient is formed as TE does, ``fl32(amax * fl32(1/fmt_max))``
               (``divide=True`` uses a correctly rounded division, as DeepGEMM's reference does).
``nvfp4``      two-level NVFP4 (TE ``reference_nvfp4.py``): see `nvfp4_scales`; its "4 over 6"
               block-scale choice: `nvfp4_4over6_candidates`.
``quest``      QuEST's forward rule as Quartet uses it (arXiv 2505.14669 §3): an E8M0 scale
               ``X = 2**floor(log2(c * std + 1e-8))`` from the block's standard deviation, not
               its amax (`quest_scale`; ``c = 2.92247856 / fmt_max``).

Every MX rule gives code 255 (NaN) for a NaN amax only, plus ``inf`` for all but ``mx_rceil``
(TE: inf -> 254); a finite amax always gets a finite code.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from fp8lab.formats import FloatFormat, cast, get_format

FLT_MAX = torch.finfo(torch.float32).max
_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF

__all__ = [
    "FLT_MAX",
    "RULE_NAMES",
    "SCALE_RULES",
    "e8m0_to_scale",
    "e8m0_to_scale_inv",
    "get_rule",
    "max_scale",
    "mx_ceil",
    "mx_even",
    "mx_exponent",
    "mx_floor",
    "mx_rceil",
    "nvfp4_scales",
    "pow2_down",
    "pow2_up",
    "quest_code",
    "quest_scale",
    "scale_inv_of",
]


def _f32(t: torch.Tensor | float) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        return torch.tensor(float(t), dtype=torch.float32)
    return t.to(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


def scale_inv_of(scale: torch.Tensor) -> torch.Tensor:
    """Dequantization multiplier ``1/scale``, correctly rounded (TE ``__frcp_rn``)."""
    return torch.reciprocal(_f32(scale))


# --------------------------------------------------------------------------- per-tensor family
def max_scale(
    amax: torch.Tensor,
    fmt: str | FloatFormat,
    *,
    margin: int = 0,
    epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """TE current scaling: ``scale = fmt_max * 2**-margin / amax`` (see module doc)."""
    f = get_format(fmt)
    return scale_from_max(_f32(amax), f.max * 2.0 ** (-int(margin)), epsilon, value_for_inf)


def scale_from_max(
    amax: torch.Tensor, scaled_max: float, epsilon: float, value_for_inf: float
) -> torch.Tensor:
    """`max_scale` from its float32 constants (``scaled_max = fmt_max * 2**-margin``): float32,
    ``amax``'s shape and device; the one definition the fused kernels are tested against."""
    amax = _f32(amax)
    dev = amax.device
    if epsilon > 0:
        eps = torch.tensor(float(epsilon), dtype=torch.float32, device=dev)
        amax = torch.where(amax < eps, eps, amax)  # NaN < eps is False: NaN stays NaN
    scale = torch.div(torch.tensor(scaled_max, dtype=torch.float32, device=dev), amax)  # IEEE
    good = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(good, scale, torch.ones((), dtype=torch.float32, device=dev))
    vinf = torch.tensor(float(value_for_inf), dtype=torch.float32, device=dev)
    return torch.where(torch.isinf(scale), vinf, scale)


def _bits_down(b: torch.Tensor) -> torch.Tensor:
    return b & -8388608  # 0xFF800000


def _bits_up(b: torch.Tensor) -> torch.Tensor:
    has_mant = (b & _MANT_MASK) != 0
    up = (b & -8388608) + 0x00800000
    up = torch.where((up & _EXP_MASK) == _EXP_MASK, torch.full_like(up, 0x7F000000), up)
    return torch.where(has_mant, up, b)


def _pow2_rule(
    name: str, to_pow2: Callable[[torch.Tensor], torch.Tensor], doc: str
) -> Callable[..., torch.Tensor]:
    """A rule with `max_scale`'s signature whose multiplier bits are then mapped by ``to_pow2``."""

    def rule(amax: torch.Tensor, fmt: str | FloatFormat, **kw: Any) -> torch.Tensor:
        return _from_bits(to_pow2(_bits(max_scale(amax, fmt, **kw))))

    rule.__signature__ = inspect.signature(max_scale)  # type: ignore[attr-defined]
    rule.__name__ = rule.__qualname__ = name
    rule.__doc__ = doc
    return rule


pow2_down = _pow2_rule(
    "pow2_down",
    _bits_down,
    "``max`` with the multiplier rounded down to a power of two (``bits &= 0xFF800000``).",
)
pow2_up = _pow2_rule(
    "pow2_up",
    _bits_up,
    "``max`` with the multiplier rounded up to a power of two (capped at 2**127).",
)


# --------------------------------------------------------------------------- MX (E8M0) family
def _exp_field(amax: torch.Tensor) -> torch.Tensor:
    return (_bits(amax) >> 23) & 0xFF


def _clamp_code(unbiased: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # torchao: clamp the unbiased exponent to [-127, 128] (128 encodes NaN), +127 -> code.
    code = unbiased.clamp(-127, 128) + 127
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, 255))


def mx_exponent(
    amax: torch.Tensor, fmt: str | FloatFormat, mode: str = "floor", *, divide: bool = False
) -> torch.Tensor:
    """Biased E8M0 code (int32, 0..255; 255 = NaN) of the MX shared scale ``X = 2**(code-127)``.

    ``mode`` is ``floor`` | ``ceil`` | ``even`` | ``rceil`` (see the module doc). ``X`` is the
    dequantization multiplier; elements are quantized as ``cast(x * 2**(127-code))``.
    """
    f = get_format(fmt)
    amax = _f32(amax).abs()
    if mode == "rceil":
        fmax = torch.tensor(f.max, dtype=torch.float32, device=amax.device)
        # TE forms fl32(amax * fl32(1/fmt_max)); DeepGEMM's reference divides
        return rceil_code(torch.div(amax, fmax) if divide else amax * torch.reciprocal(fmax))
    return mx_code(amax, mode, f.emax, f.mbits)


def mx_code(amax: torch.Tensor, mode: str, emax: int, mbits: int) -> torch.Tensor:
    """`mx_exponent` of ``|amax|`` (float32) for ``mode`` floor | ceil | even, from the element
    format's ``emax`` and ``mbits``: int32 codes, ``amax``'s shape and device."""
    amax = _f32(amax).abs()
    if mode == "floor":
        return _clamp_code(_exp_field(amax) - 127 - emax, amax)
    if mode == "ceil":
        b = _bits(amax)
        e = ((b >> 23) & 0xFF) - 127 + ((b & _MANT_MASK) != 0).to(torch.int32)
        return _clamp_code(e - emax, amax)
    if mode == "even":
        mbits_diff = 23 - mbits
        b = _bits(amax)
        b = (b + (1 << (mbits_diff - 1))) & 0x7F800000 if mbits_diff > 0 else b & 0x7F800000
        # a finite amax whose rounding carries past the largest exponent (FLT_MAX, 1.9375 *
        # 2**127 for e4m3) gets exponent 128: a finite code (128 - emax_elem + 127, e.g. 247
        # for e4m3); only a non-finite amax gives 255 (_clamp_code)
        e = ((b >> 23) & 0xFF) - 127
        return _clamp_code(e - emax, amax)
    raise ValueError(f"unknown MX scale mode {mode!r}; use floor, ceil, even or rceil")


def rceil_code(r: torch.Tensor) -> torch.Tensor:
    """The ``mx_rceil`` code of the quotient ``r = amax / fmt_max`` (float32, formed by the
    caller): ``ceil(log2 r)`` on its bits (inf -> 254, NaN -> 255, 0 -> 0); int32."""
    b = _bits(r)
    e = (b >> 23) & 0xFF
    mant = b & _MANT_MASK
    bump = (mant > 0) & (e != 0xFE) & ~((e == 0) & (mant <= 0x400000))
    code = e + bump.to(torch.int32)
    code = torch.where(torch.isinf(r), torch.full_like(code, 0xFE), code)
    code = torch.where(torch.isnan(r), torch.full_like(code, 0xFF), code)
    return torch.where(r == 0, torch.zeros_like(code), code)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for an int32 tensor ``e``, built on the bits (exact on every device):
    subnormal below -126, 0 below -149, inf above 127."""
    normal = ((e.clamp(-126, 128) + 127) << 23).view(torch.float32)
    sub = (1 << (e.clamp(-149, -127) + 149)).view(torch.float32)
    out = torch.where(e >= -126, normal, sub)
    return torch.where(e < -149, torch.zeros_like(out), out)


def e8m0_to_scale_inv(code: torch.Tensor) -> torch.Tensor:
    """``2**(code-127)`` as float32 (code 255 -> NaN). The dequantization multiplier."""
    code = code.to(torch.int32)
    out = _pow2(code - 127)
    return torch.where(code == 255, torch.full_like(out, float("nan")), out)


def e8m0_to_scale(code: torch.Tensor) -> torch.Tensor:
    """``2**(127-code)`` as float32 (code 254 -> 2**-127, a subnormal; 255 -> NaN)."""
    code = code.to(torch.int32)
    out = _pow2(127 - code)
    return torch.where(code == 255, torch.full_like(out, float("nan")), out)


def _mx_rule(mode: str) -> Callable[..., torch.Tensor]:
    def rule(
        amax: torch.Tensor, fmt: str | FloatFormat, *, divide: bool = False, **_: object
    ) -> torch.Tensor:
        return e8m0_to_scale(mx_exponent(amax, fmt, mode, divide=divide))

    rule.__name__ = f"mx_{mode}"
    rule.__doc__ = f"MX shared scale, mode {mode!r}: the multiplier ``2**(127 - mx_exponent)``."
    return rule


mx_floor = _mx_rule("floor")
mx_ceil = _mx_rule("ceil")
mx_even = _mx_rule("even")
mx_rceil = _mx_rule("rceil")


# --------------------------------------------------------------------------- NVFP4 two-level
def _to_scale_grid(x: torch.Tensor, sf: FloatFormat) -> torch.Tensor:
    """RNE onto the block-scale format with saturation (TE's ``static_cast<fp8e4m3>``)."""
    return cast(x, sf, rounding="nearest_even", saturate=True)


def nvfp4_scales(
    block_amax: torch.Tensor,
    tensor_amax: torch.Tensor | float | None,
    fmt: str | FloatFormat = "e2m1",
    *,
    scale_format: str | FloatFormat = "e4m3",
    tensor_scale: float | None = None,
    block_order: str = "kernel",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 two-level scales with ``fmt_max`` = 6 (E2M1) and ``scale_max`` = 448 (E4M3).

    Returns ``(s_blk, s_dec, enc)``; dequantization is ``q * s_blk * s_dec``:

    1. ``s_enc = (scale_max * fmt_max) / tensor_amax`` (one FP32 division), capped at FLT_MAX,
       and 1 where that gives 0 (amax inf) or the amax is 0; ``s_dec = 1 / s_enc``: the FP32
       tensor-level dequantization scale. [TE kernel ``compute_global_encode_scaling_factor_FP4``
       (``common/cast/nvfp4/core_nvfp4.cuh``); TE's Python reference
       (``pytorch/custom_recipes/quantization_nvfp4.py``) differs only at amax 0: FLT_MAX.]
    2. ``s_blk = cast(clamp(block_amax * (s_enc * fl32(1/fmt_max)), +-scale_max))`` onto
       ``scale_format`` (RNE, saturating): the block-level dequantization scale. [TE kernel
       ``compute_decoding_scaling_factor`` and the current TE reference, which folds 1/6 into
       the tensor scale. Older TE references and the transpose kernel's emulation path compute
       ``(block_amax / fmt_max) * s_enc``; torchao (``prototype/mx_formats/nvfp4_tensor.py``)
       computes ``(block_amax / fmt_max) / per_tensor_scale`` and clamps below at E4M3's
       smallest subnormal: each can differ from this by one rounding of the pre-cast value.]
    3. ``enc = min(1 / (s_blk * s_dec), FLT_MAX)``: the per-block quantization multiplier, the
       elements being ``cast(x * enc)``. [TE kernel and reference. torchao instead divides,
       ``x / (per_tensor_scale * s_blk)``, and fp8lab does not emulate that division.]

    ``tensor_scale``: a user-chosen static FP32 tensor-level *dequantization* scale (torchao's
    ``per_tensor_scale``, typically ``calibrated_amax / (448 * 6)``) used as ``s_dec`` instead of
    step 1; then ``s_enc = fl32(1 / tensor_scale)`` in step 2 and ``tensor_amax`` is ignored.
    Blocks whose amax exceeds ``tensor_scale * 448 * 6`` saturate their E4M3 scale (and then
    their elements).

    ``block_order`` picks step 2's ordering: ``"kernel"`` (default, as above) or ``"divide"``,
    ``(block_amax / fmt_max) * s_enc`` with two roundings (the older TE reference and the
    emulation path of TE's quantize-transpose kernel).

    With ``tensor_amax=None`` and no ``tensor_scale`` (single level):
    ``s_blk = cast(clamp(block_amax / fmt_max, smallest positive, scale_max))``, ``s_dec = 1``,
    ``enc = 1 / s_blk``.
    """
    if block_order not in ("kernel", "divide"):
        raise ValueError(f"block_order must be 'kernel' or 'divide', got {block_order!r}")
    f = get_format(fmt)
    sf = get_format(scale_format)
    block_amax = _f32(block_amax)
    dev = block_amax.device
    fmax = torch.tensor(f.max, dtype=torch.float32, device=dev)
    smax = torch.tensor(sf.max, dtype=torch.float32, device=dev)
    flt_max = torch.tensor(FLT_MAX, dtype=torch.float32, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)
    if tensor_scale is not None:
        ts = float(tensor_scale)
        if not (math.isfinite(ts) and ts > 0):
            raise ValueError(f"tensor_scale must be a positive finite float, got {tensor_scale!r}")
        s_dec = torch.tensor(ts, dtype=torch.float32, device=dev)
        s_enc = torch.minimum(torch.reciprocal(s_dec), flt_max)
    elif tensor_amax is None:
        s_blk = _to_scale_grid(torch.div(block_amax, fmax).clamp(sf.min_subnormal, sf.max), sf)
        return s_blk, one, torch.reciprocal(s_blk)
    else:
        tensor_amax = _f32(tensor_amax).to(dev)
        s_enc = torch.minimum(torch.div(smax * fmax, tensor_amax), flt_max)
        s_enc = torch.where((tensor_amax == 0) | (s_enc == 0), one, s_enc)
        s_dec = torch.reciprocal(s_enc)
    if block_order == "kernel":
        pre = block_amax * (s_enc * torch.reciprocal(fmax))  # fl32(1/6) folded into s_enc
    else:
        pre = torch.div(block_amax, fmax) * s_enc
    # a scale format without zero (e.g. E8M0) cannot hold an all-zero block's 0: its smallest value
    lo = -sf.max if sf.has_zero else sf.min_subnormal
    s_blk = _to_scale_grid(pre.clamp(lo, sf.max), sf)
    enc = torch.minimum(torch.reciprocal(s_blk * s_dec), flt_max)
    return s_blk, s_dec, enc


# --------------------------------------------------------------------------- QuEST (Quartet)
# QuEST's Gaussian-optimal clipping point for the 4-bit grid, in units of the standard deviation
# (Quartet's QuestMXFP4 quantizer: gaussian_scale = 2.92247856 / 6, IST-DASLab/Quartet)
QUEST_CLIP = 2.92247856
QUEST_EPS = 1e-8


def quest_code(block_std: torch.Tensor, fmt: str | FloatFormat = "e2m1") -> torch.Tensor:
    """Biased E8M0 code (int32) of QuEST's forward scale from per-block standard deviations.

    ``s = fl32(fl32(c * std) + fl32(1e-8))`` with ``c = fl32(QUEST_CLIP / fmt_max)``
    (``2.92247856 / 6`` for E2M1: the Gaussian-optimal clip over the grid's largest value), and
    ``X = 2**floor(log2 s)``: the code is ``s``'s FP32 exponent field (``s >= 1e-8`` is normal).
    A NaN or infinite std gives 255 (NaN), as the MX rules do. The block's elements are then
    ``cast(x / X)`` (saturating: values past ``fmt_max * X`` clip, QuEST's trust region)."""
    f = get_format(fmt)
    std = _f32(block_std)
    dev = std.device
    c = torch.tensor(QUEST_CLIP / f.max, dtype=torch.float32, device=dev)
    s = c * std + torch.tensor(QUEST_EPS, dtype=torch.float32, device=dev)
    code = _exp_field(s)
    return torch.where(torch.isfinite(s), code, torch.full_like(code, 255))


def quest_scale(
    block_std: torch.Tensor, fmt: str | FloatFormat = "e2m1", **_: object
) -> torch.Tensor:
    """QuEST's quantization multiplier ``2**(127 - quest_code)`` (float32): see `quest_code`.
    Takes per-block standard deviations, not amaxes (`fp8lab.quantize` computes them)."""
    return e8m0_to_scale(quest_code(block_std, fmt))


# --------------------------------------------------------------------------- registry
SCALE_RULES: dict[str, Callable[..., torch.Tensor]] = {
    "max": max_scale,
    "amax": max_scale,
    "pow2_down": pow2_down,
    "pow2_up": pow2_up,
    "mx_floor": mx_floor,
    "mx_ceil": mx_ceil,
    "mx_even": mx_even,
    "mx_rceil": mx_rceil,
}
RULE_NAMES = (*SCALE_RULES, "nvfp4", "quest")


def get_rule(name: str) -> Callable[..., torch.Tensor]:
    """The per-block rule function ``(amax, fmt, **knobs) -> scale`` (``nvfp4``: `nvfp4_scales`;
    ``quest``: `quest_scale`, which takes block standard deviations)."""
    key = name.strip().lower()
    if key == "nvfp4":
        return nvfp4_scales
    if key == "quest":
        return quest_scale
    if key not in SCALE_RULES:
        raise ValueError(
            f"unknown scaling rule {name!r}; valid: {', '.join(RULE_NAMES)}, a fixed float "
            "multiplier, or a DelayedScaling object"
        )
    return SCALE_RULES[key]
