"""Rounding onto a number format, exact to the bit: `cast`.

Everything is done on the integer fields of the input (sign, exponent, significand) in one numba
pass: no floating-point ``log2``, no double rounding. Two kernel families:

* the fast float32 kernels (`_det_one`, `_sr_one`): round inside the float32 bit pattern (add the
  rounding increment, clear the bits below the grid spacing; the position follows from the
  exponent field, tapered for HiF8), 32-bit arithmetic, parallel above 64k elements;
* the generic kernel (`_generic_one`, for float32 and float64 bit patterns alike): integer
  significand times a power of two, with the grid given as a table ``binade -> exponent of the
  grid spacing`` (`_Params.qtab`); used for float64 input and for formats the fast kernel cannot
  describe, and as the cross-check of the fast one in the tests.

Each kernel has a device-generic twin in `fp8lab.formats.rounding_torch` (torch ops on the same
integer bit patterns, same bits; one compiled pass where torch.compile works), which `cast` runs
for tensors off the CPU and under ``FP8LAB_KERNELS=torch`` (`fp8lab.kernels.use_torch`).

A format's constants reach the kernels as one record (`_GenericGrid` / `_FastGrid`, built once
per format and overflow rule by `_grids`), runtime values rather than compile-time ones, so each
kernel compiles once (cached on disk) for every format.

Semantics (see also the README section "formats"):

* ``nearest_even`` / ``nearest_away`` round to the nearest grid value, ties to the even significand
  / away from zero. Where the significand has no stored bit (E8M0, HiF8's DML binades) the kept
  significand is the implicit 1, so "even" ties go up, as in ml_dtypes and torch.
* ``toward_zero`` truncates. As in IEEE 754, it never overflows a finite input to Inf/NaN: finite
  inputs beyond max give ±max even with ``saturate=False`` (only ±Inf inputs stay infinite).
* ``stochastic`` rounds up with probability (distance to the lower neighbour) / (grid spacing).
  The random numbers are a counter-based hash (splitmix64) of a 64-bit seed drawn from
  ``generator`` (or torch's default generator) and the element index: reproducible, independent
  of the thread count, no random tensor. The probability is exact for float32 input of magnitude
  above about 2**-9 grid steps; below that, and for float64 remainders deeper than 32 bits, it is
  truncated to 32 bits (bias < 2**-32 of a grid step).
* ``hybrid`` (HiF8 only) is Ascend's HR rule (CANN's ``Hybrid`` round mode; docs/formats.md):
  TA for binades 2^-3..2^3, SSR elsewhere. SSR rounds up iff the 14 bits just below the kept
  mantissa (f14) are >= the lowest 14 bits of the fp32 fraction (t14); for float16 input, iff
  the 2 bits below the kept mantissa are >= 2 * (fp16 mantissa LSB) + 1. bfloat16 input uses the
  fp32 rule on its exact fp32 value. An exact remainder is never rounded; |x| >= 40960 overflows;
  |x| < 2^-23 gives 0.
* Overflow: a result is an overflow when the rounded value (the grid continued above max with the
  top binade's spacing) exceeds max. ``saturate=True`` gives ±max (also for ±Inf inputs);
  ``saturate=False`` gives the format's Inf, or NaN where it has no Inf (e4m3: |x| > 464 -> NaN).
  Formats with neither Inf nor NaN (FP4/FP6) accept only ``saturate=True``.
* NaN stays NaN (also for FP4/FP6, whose `encode` maps NaN to the -0 code as ml_dtypes does).
  Formats without -0 give +0 for -0 and for negative underflow.
* E8M0 (unsigned, no zero): nearest power of two, ties up; 0, negative and NaN inputs give NaN;
  values below 2^-127 give 2^-127 (as ml_dtypes); overflow gives NaN, or 2^127 if saturating.
* Input dtypes: float32, bfloat16, float16 (both exact in float32) and float64, which is rounded
  directly from its own 53-bit significand (never via float32: that would round twice). The
  result is always float32. Other dtypes raise ``ValueError``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from fp8lab.formats import hif8 as _hif8
from fp8lab.formats import rounding_torch as _rt
from fp8lab.formats._grid import BITS32 as _BITS32
from fp8lab.formats._grid import BITS64 as _BITS64
from fp8lab.formats._grid import F_HAS_ZERO as _F_HAS_ZERO
from fp8lab.formats._grid import F_SIGNED as _F_SIGNED
from fp8lab.formats._grid import F_SIGNED_ZERO as _F_SIGNED_ZERO
from fp8lab.formats._grid import HYB_OVF_BITS as _HYB_OVF_BITS
from fp8lab.formats._grid import NAN_BITS as _NAN_BITS
from fp8lab.formats._grid import TAB_LO as _TAB_LO
from fp8lab.formats._grid import TAB_N as _TAB_N
from fp8lab.formats._grid import FastGrid as _FastGrid
from fp8lab.formats._grid import GenericGrid as _GenericGrid
from fp8lab.formats._grid import fast_grid
from fp8lab.formats.spec import FloatFormat, get_format
from fp8lab.formats.straight_through import straight_through
from fp8lab.kernels import parallel, use_torch

ROUNDING_MODES: tuple[str, ...] = (
    "nearest_even",
    "nearest_away",
    "toward_zero",
    "stochastic",
    "hybrid",
)
_MODE_ID = {name: i for i, name in enumerate(ROUNDING_MODES)}

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class _Params:
    qtab: np.ndarray  # int64[_TAB_N]: exponent of the grid spacing per binade
    stab: np.ndarray  # float64[_TAB_N]: 2.0**qtab
    max: float
    tiny: float  # value for a non-zero input that rounds to 0 in a format without zero
    flags: int
    inf: bool
    has_nan: bool
    # fast float32 kernel: shift of the rounding position in the float32 bits, per exponent field
    fast: bool = False
    is_hif8: int = 0
    s_norm: int = 0  # shift for binades >= emin
    emin_field: int = 0  # float32 exponent field of the format's smallest normal binade
    lowq: int = 0  # exponent of the grid spacing below emin
    s_e0: int = 0  # shift for float32 subnormal inputs


def default_rounding(fmt: str | FloatFormat) -> str:
    """The format's native rounding: TA (``nearest_away``) for HiF8, ``nearest_even`` otherwise."""
    return "nearest_away" if get_format(fmt).kind == "hif8" else "nearest_even"


@functools.lru_cache(maxsize=256)
def _params(fmt: FloatFormat) -> _Params:
    ebs = np.arange(_TAB_LO, _TAB_LO + _TAB_N, dtype=np.int64)
    if fmt.kind == "hif8":
        q = np.array([_hif8.quantum_exponent(int(e)) for e in ebs], dtype=np.int64)
        flags = _F_HAS_ZERO | _F_SIGNED
        return _Params(q, np.ldexp(1.0, q), _hif8.MAX, 0.0, flags, True, True, fast=True, is_hif8=1)
    emin, mb = fmt.emin, fmt.mbits
    lowest = emin - mb if fmt.subnormals else emin
    if lowest < -149 or fmt.emax > 127:
        raise ValueError(
            f"{fmt.name}: its range (quantum 2**{lowest}, emax {fmt.emax}) is not representable "
            "in float32, the result type of cast"
        )
    q = np.where(ebs >= emin, ebs - mb, lowest).astype(np.int64)
    flags = (
        (_F_SIGNED_ZERO if fmt.signed_zero else 0)
        | (_F_HAS_ZERO if fmt.has_zero else 0)
        | (_F_SIGNED if fmt.signed else 0)
    )
    tiny = 0.0 if fmt.has_zero else fmt.min_subnormal
    # the fast kernel needs one spacing for all float32 subnormal inputs (binades <= -127)
    q_sub = q[ebs <= -127]
    fast = bool((q_sub == q_sub[0]).all())
    return _Params(
        q,
        np.ldexp(1.0, q),
        float(fmt.max),
        tiny,
        flags,
        fmt.inf,
        fmt.has_nan,
        fast=fast,
        s_norm=23 - mb,
        emin_field=emin + 127,
        lowq=lowest,
        s_e0=int(q_sub[0]) + 149,
    )


# ----------------------------------------------------------------------------------- kernels
@njit(cache=True, inline="always")
def _rand32(seed, i):
    z = np.uint64(seed) + np.uint64(i) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z >> np.uint64(32))


@njit(cache=True, inline="always")
def _round_mag(sig, e0, eb, i, qtab, stab, mode, seed, hyb16):
    """Round |x| = sig * 2**e0 (eb = floor(log2 |x|)) onto the grid; returns a float64 magnitude.

    The result may exceed the format's max (the caller turns that into overflow) and is 0.0 on
    underflow. ``mode == 4`` (hybrid) returns +inf for |x| >= 40960.
    """
    k = eb - _TAB_LO
    if k < 0:
        k = 0
    elif k >= _TAB_N:
        k = _TAB_N - 1
    if mode == 4:
        if eb < -23:
            return 0.0
        if eb > 15 or (eb == 15 and sig >= 0xA00000):
            return math.inf
    q = qtab[k]
    shift = q - e0
    if shift <= 0:
        return math.ldexp(float(sig), e0)
    if shift > 62:
        kept = 0
        rem = sig
    else:
        kept = sig >> shift
        rem = sig - (kept << shift)
    if rem == 0:
        return float(kept) * stab[k]
    up = False
    if mode == 0:
        if shift <= 62:
            half = np.int64(1) << (shift - 1)
            up = rem > half or (rem == half and (kept & 1) == 1)
    elif mode == 1:
        if shift <= 62:
            up = rem >= (np.int64(1) << (shift - 1))
    elif mode == 3:
        if shift <= 32:
            thresh = rem << (32 - shift)
        elif shift - 32 < 63:
            thresh = rem >> (shift - 32)
        else:
            thresh = 0
        up = _rand32(seed, i) < thresh
    elif mode == 4:
        if -3 <= eb <= 3:
            up = rem >= (np.int64(1) << (shift - 1))
        elif hyb16 == 0:
            f14 = rem >> (shift - 14)
            t14 = sig & 0x3FFF
            up = f14 >= t14
        else:
            f2 = rem >> (shift - 2)
            lsb = 13
            if eb < -14:
                lsb = 13 - 14 - eb
            t2 = ((sig >> lsb) & 1) * 2 + 1
            up = f2 >= t2
    if up:
        kept += 1
    return float(kept) * stab[k]


@njit(cache=True, inline="always")
def _finish(mag, neg, is_zero_in, maxval, ovfval, tinyval, flags):
    if is_zero_in:
        if (flags & _F_HAS_ZERO) == 0:
            return np.nan
        if neg and (flags & _F_SIGNED_ZERO) != 0:
            return -0.0
        return 0.0
    if mag > maxval:
        mag = ovfval
    elif mag == 0.0:
        mag = tinyval
    if mag != mag:
        return np.nan
    if neg:
        if (flags & _F_SIGNED) == 0:
            return np.nan
        if mag == 0.0 and (flags & _F_SIGNED_ZERO) == 0:
            return 0.0
        return -mag
    return mag


@njit(cache=True, inline="always")
def _generic_one(a, neg, inf_bits, mbits, i, g, mode, seed, hyb16):
    """One element from its IEEE fields: ``a`` = |x| bits (int64) of a binary32 (``mbits`` 23,
    ``inf_bits`` 0x7F800000) or binary64 (52, 0x7FF0000000000000) input; float64 result."""
    if a >= inf_bits:
        if a > inf_bits:
            return np.nan
        return _finish(g.infval, neg, False, math.inf, 0.0, g.tinyval, g.flags)
    if a == 0:
        return _finish(0.0, neg, True, g.maxval, g.ovfval, g.tinyval, g.flags)
    bias = inf_bits >> (mbits + 1)  # 127 / 1023
    ex = a >> mbits
    if ex == 0:  # subnormal input: eb = floor(log2 |x|) from the bit length
        sig = a
        e0 = 1 - bias - mbits
        eb = e0 - 1
        m = a
        while m != 0:
            m >>= 1
            eb += 1
    else:
        sig = (a & ((np.int64(1) << mbits) - 1)) | (np.int64(1) << mbits)
        e0 = ex - bias - mbits
        eb = ex - bias
    mag = _round_mag(sig, e0, eb, i, g.qtab, g.stab, mode, seed, hyb16)
    return _finish(mag, neg, False, g.maxval, g.ovfval, g.tinyval, g.flags)


@njit(cache=True, inline="always")
def _generic_bits_one(u, i, g, mode, seed, hyb16, sign, inf_bits, mbits):
    """One binary32 (``sign`` 31, ``inf_bits`` 0x7F800000, ``mbits`` 23) or binary64 (63,
    0x7FF0000000000000, 52) bit pattern ``u`` (uint32 / uint64): its fields to `_generic_one`."""
    v = np.uint64(u)
    a = np.int64(v & ((np.uint64(1) << np.uint64(sign)) - np.uint64(1)))
    neg = (v >> np.uint64(sign)) != 0
    return _generic_one(a, neg, inf_bits, mbits, i, g, mode, seed, hyb16)


@njit(parallel=True, cache=True)
def _cast_bits(src, dst, g, mode, seed, hyb16, sign, inf_bits, mbits):
    for i in prange(src.shape[0]):
        dst[i] = _generic_bits_one(src[i], i, g, mode, seed, hyb16, sign, inf_bits, mbits)


@njit(cache=True)
def _cast_bits_serial(src, dst, g, mode, seed, hyb16, sign, inf_bits, mbits):
    for i in range(src.shape[0]):
        dst[i] = _generic_bits_one(src[i], i, g, mode, seed, hyb16, sign, inf_bits, mbits)


_U = np.uint32
_I = np.int32


@njit(cache=True, inline="always")
def _shift_of(a, g):
    """(float32 exponent field, rounding position s) of |x| bits ``a``: the number of float32
    bits below the grid spacing (tapered per binade for HiF8)."""
    ex = _I(a >> _U(23))
    if g.is_hif8:
        eb = ex - _I(127)
        ab = abs(eb)
        sh = _I(20) + _I(ab >= 4) + _I(ab >= 8)
        sl = max(_I(23), _I(1) - eb)
        s = sl if eb < -15 else sh
    else:
        sx = g.lowq150 - ex
        s = g.s_norm if ex >= g.emin_field else sx
        s = g.s_e0 if ex == 0 else s
    return ex, s


@njit(cache=True, inline="always")
def _finish_bits(u, a, r, g):
    """Overflow, zero, Inf/NaN and sign handling of a rounded magnitude ``r`` (float32 bits)."""
    o = g.ovfb if r > g.maxb else r
    if r == 0 and g.no_zero:
        o = _U(_NAN_BITS) if a == 0 else g.tinyb
    if a >= _U(0x7F800000):
        o = g.infb if a == _U(0x7F800000) else _U(_NAN_BITS)
    sgn = u & _U(0x80000000)
    sgn = sgn if ((o != 0) | g.signed_zero) else _U(0)
    if g.signed:
        out = _U(_NAN_BITS) if o > _U(0x7F800000) else (o | sgn)
    else:
        out = _U(_NAN_BITS) if (o > _U(0x7F800000)) | ((u >> _U(31)) != 0) else o
    return out


@njit(cache=True, inline="always")
def _sr_one(u, i, g, mode, seed, hyb16):
    """One element for ``stochastic`` (3) and ``hybrid`` (4); see `_det_one`."""
    a = u & _U(0x7FFFFFFF)
    ex, s = _shift_of(a, g)
    eb = ex - _I(127)
    sc = _U(min(max(s, _I(1)), _I(23)))
    low = (_U(1) << sc) - _U(1)
    if mode == 3:
        add = _U(_rand32(seed, i)) & low
    else:  # hybrid: TA for binades 2^-3..2^3, SSR elsewhere; an exact remainder stays
        rem = a & low
        if -3 <= eb <= 3:
            add = (low >> _U(1)) + _U(1)
        elif hyb16 == 0:
            up = (rem != 0) & ((rem >> (sc - _U(14))) >= (a & _U(0x3FFF)))
            add = (low + _U(1)) if up else _U(0)
        else:
            lsb = _U(13) if eb >= -14 else _U(-1 - eb)
            t2 = ((a >> lsb) & _U(1)) * _U(2) + _U(1)
            up = (rem != 0) & ((rem >> (sc - _U(2))) >= t2)
            add = (low + _U(1)) if up else _U(0)
    r = (a + add) & ~low
    r = a if s <= 0 else r
    if s >= 24:  # below half a grid step: 0 or one step
        q = s + max(ex, _I(1)) - _I(150)
        qb = _U(q + 127) << _U(23) if q >= -126 else _U(1) << _U(max(q + 149, 0))
        sig = np.int64(a) if ex == 0 else np.int64((a & _U(0x7FFFFF)) | _U(0x800000))
        if mode == 3:
            if s <= 32:
                thresh = sig << (32 - s)
            elif s < 56:
                thresh = sig >> (s - 32)
            else:
                thresh = np.int64(0)
            up = _rand32(seed, i) < thresh
        else:
            up = (eb == -23) & ((sig >> 10) >= np.int64(a & _U(0x3FFF)))
        r = qb if up else _U(0)
    if mode == 4 and a >= _U(_HYB_OVF_BITS):
        r = _U(0x7F800000)
    return _finish_bits(u, a, r, g)


@njit(parallel=True, cache=True)
def _cast_fast(src, dst, g, mode, seed, hyb16):
    for i in prange(src.shape[0]):
        dst[i] = _sr_one(src[i], i, g, mode, seed, hyb16)


@njit(cache=True)
def _cast_fast_serial(src, dst, g, mode, seed, hyb16):
    for i in range(src.shape[0]):
        dst[i] = _sr_one(src[i], i, g, mode, seed, hyb16)


@njit(cache=True, inline="always")
def _det_one(u, g, mode):
    """One element, float32 bits -> float32 bits, for the deterministic modes (0, 1, 2).

    For a rounding position ``s`` (float32 bits below the grid spacing) in 1..23, adding the
    rounding increment to the bit pattern and clearing the low ``s`` bits is exact rounding, carry
    into the exponent included. ``s >= 24`` (|x| below half a grid step) gives 0 or one step;
    ``s <= 0`` is already on the grid. 32-bit arithmetic, few branches: about 1 ns per element.
    """
    a = u & _U(0x7FFFFFFF)
    ex, s = _shift_of(a, g)
    sc = _U(min(max(s, _I(1)), _I(23)))
    low = (_U(1) << sc) - _U(1)
    if mode == 0:
        odd = ((a >> sc) & _U(1)) | _U((sc == _U(23)) & (ex != 0))
        add = (low >> _U(1)) + odd
    elif mode == 1:
        add = (low >> _U(1)) + _U(1)
    else:
        add = _U(0)
    r = (a + add) & ~low
    r = a if s <= 0 else r
    if s >= 24:  # below half a grid step: 0 or one step
        q = s + max(ex, _I(1)) - _I(150)
        qb = _U(q + 127) << _U(23) if q >= -126 else _U(1) << _U(max(q + 149, 0))
        up = (s == 24) & (ex != 0) & ((mode == 1) | ((mode == 0) & ((a & _U(0x7FFFFF)) != 0)))
        r = qb if up else _U(0)
    return _finish_bits(u, a, r, g)


@njit(parallel=True, cache=True)
def _cast_fast_det(src, dst, g, mode):
    for i in prange(src.shape[0]):
        dst[i] = _det_one(src[i], g, mode)


@njit(cache=True)
def _cast_fast_det_serial(src, dst, g, mode):
    for i in range(src.shape[0]):
        dst[i] = _det_one(src[i], g, mode)


@functools.lru_cache(maxsize=512)
def _grids(fmt: FloatFormat, saturate: bool, mode: int) -> tuple[_GenericGrid, _FastGrid | None]:
    """The kernel records of ``fmt`` for an overflow rule (``saturate``, toward_zero or not)."""
    p = _params(fmt)
    infval = p.max if saturate else (math.inf if p.inf else math.nan)
    ovf = p.max if mode == 2 else infval  # toward_zero never overflows a finite input
    generic = _GenericGrid(p.qtab, p.stab, p.max, ovf, infval, p.tiny, p.flags)
    if not p.fast:
        return generic, None
    fast = fast_grid(
        p.max,
        ovf,
        infval,
        p.tiny,
        p.flags,
        is_hif8=p.is_hif8 != 0,
        s_norm=p.s_norm,
        emin_field=p.emin_field,
        lowq150=p.lowq + 150,
        s_e0=p.s_e0,
    )
    return generic, fast


# ----------------------------------------------------------------------------------- public
def _check_tensor(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"cast needs a float32, bfloat16, float16 or float64 tensor, got {x.dtype}"
        )


def _resolve(fmt: FloatFormat, rounding: str | None, saturate: bool) -> int:
    if rounding is None:
        rounding = default_rounding(fmt)
    if rounding not in _MODE_ID:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_MODES)}")
    if rounding == "hybrid" and fmt.kind != "hif8":
        raise ValueError(f"rounding 'hybrid' is defined only for hif8, not {fmt.name}")
    if not saturate and not fmt.inf and not fmt.has_nan:
        raise ValueError(
            f"{fmt.name} has neither Inf nor NaN, so overflow can only saturate: use saturate=True"
        )
    return _MODE_ID[rounding]


def _seed(generator: torch.Generator | None) -> int:
    """The stochastic seed: one int64 draw from ``generator`` (torch's default CPU generator if
    None), whichever kernels then run, so numba and torch round the same elements up."""
    device = generator.device if generator is not None else "cpu"
    return int(
        torch.randint(
            -(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator, device=device
        ).item()
    )


def _cast_torch(
    x: torch.Tensor,
    fmt: FloatFormat,
    mode: int,
    saturate: bool,
    generator: torch.Generator | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`cast` by the device-generic kernels (`fp8lab.formats.rounding_torch`), on x's device."""
    seed = _seed(generator) if mode == 3 else 0
    hyb16 = 1 if x.dtype == torch.float16 else 0
    if x.numel() == 0:
        return out if out is not None else torch.empty(x.shape, device=x.device)
    src = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x  # exact
    flat = src.reshape(-1)
    generic, fast = _grids(fmt, saturate, mode)
    if fast is not None and src.dtype == torch.float32 and not _force_generic:
        bits = _rt.cast_f32_fast(flat.view(torch.int32), fast, mode, seed, hyb16)
    else:
        wide = src.dtype == torch.float64
        _, inf_bits, mbits = _BITS64 if wide else _BITS32
        ints = flat.view(torch.int64 if wide else torch.int32)
        bits = _rt.cast_generic(ints, generic, mode, seed, hyb16, inf_bits, mbits)
    result = bits.view(torch.float32).view(x.shape)
    return result if out is None else out.copy_(result)


_force_generic = False  # tests flip this to cross-check the fast kernel against the generic one


def cast(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    rounding: str | None = None,
    saturate: bool = True,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` onto the grid of ``fmt``; returns a float32 tensor of ``x``'s shape.

    Args:
        x: float32, bfloat16, float16 or float64 tensor on any device; the result is on the
            same device (numba kernels on the CPU, the device-generic torch kernels of
            `fp8lab.formats.rounding_torch` elsewhere or under ``FP8LAB_KERNELS=torch``: same
            bits, `fp8lab.kernels`). Gradients pass straight through
            (the rounding counts as the identity in backward, `fp8lab.formats.straight_through`)
            when ``x`` requires grad and grad mode is on.
        fmt: a format name (`fp8lab.format_names()`, or any ``eXmY``) or a `FloatFormat`.
        rounding: one of `ROUNDING_MODES`; ``None`` = the format's native rule
            (``nearest_even``; ``nearest_away``, i.e. TA, for HiF8).
        saturate: clamp overflow and ±Inf to ±max (True) or give the format's Inf/NaN (False).
        generator: torch.Generator for ``stochastic`` rounding (one 64-bit draw per call, on
            the generator's device; torch's default CPU generator if None, whatever ``x``'s).
        out: optional contiguous float32 tensor of the same shape and device to write into (may
            be ``x``).
    """
    fmt = get_format(fmt)
    _check_tensor(x)
    mode = _resolve(fmt, rounding, saturate)
    if mode == 4 and x.dtype == torch.float64:
        raise ValueError("hybrid rounding follows the input dtype: use float32, bf16 or fp16 input")
    _params(fmt)  # raises for a format float32 cannot hold (also for empty input)
    if x.requires_grad and torch.is_grad_enabled():
        return straight_through(x, cast(x.detach(), fmt, rounding, saturate, generator, out))
    x = x.detach()
    if out is not None:
        if out.dtype != torch.float32 or out.shape != x.shape or not out.is_contiguous():
            raise ValueError("out must be a contiguous float32 tensor of the input's shape")
        dst = out
    if use_torch(x, out, what="cast"):
        return _cast_torch(x, fmt, mode, saturate, generator, out)
    if x.dtype in (torch.bfloat16, torch.float16):
        src = x.float().contiguous()  # exact; the kernel then works in place on this buffer
        if out is None:
            dst = src
    else:
        src = x.contiguous()
        if out is None:
            dst = torch.empty(x.shape, dtype=torch.float32)
    seed = _seed(generator) if mode == 3 else 0
    hyb16 = 1 if x.dtype == torch.float16 else 0
    n = src.numel()
    if n == 0:
        return dst
    generic, fast = _grids(fmt, saturate, mode)
    small = not parallel(n)  # the thread policy of fp8lab.kernels
    if fast is not None and src.dtype == torch.float32 and not _force_generic:
        s32 = src.view(-1).numpy().view(np.uint32)
        d32 = dst.view(-1).numpy().view(np.uint32)
        if mode <= 2:
            (_cast_fast_det_serial if small else _cast_fast_det)(s32, d32, fast, mode)
        else:
            (_cast_fast_serial if small else _cast_fast)(s32, d32, fast, mode, seed, hyb16)
        return dst
    d = dst.view(-1).numpy()
    wide = src.dtype == torch.float64
    s = src.view(-1).numpy().view(np.uint64 if wide else np.uint32)
    kernel = _cast_bits_serial if small else _cast_bits
    kernel(s, d, generic, mode, seed, hyb16, *(_BITS64 if wide else _BITS32))
    return dst


__all__ = ["ROUNDING_MODES", "cast", "default_rounding"]
