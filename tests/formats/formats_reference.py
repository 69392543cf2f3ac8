"""Independent numpy references for the format tests (float64 arithmetic, no numba).

`ref_cast` rounds through float64 ``frexp``/``ldexp``/``rint`` (all exact here), unlike the
kernel's integer significand arithmetic; `hif8_ta_codebook` is a nearest-neighbour search over the
126 decoded HiF8 values; `hif8_hybrid_ref` follows the reference codec's field formulation of SSR.
"""

from __future__ import annotations

import ml_dtypes as md
import numpy as np

from fp8lab.formats import hif8
from fp8lab.formats.spec import FloatFormat, get_format

F32_MAX = float(np.finfo(np.float32).max)


def _hif8_q(e: np.ndarray) -> np.ndarray:
    a = np.abs(e)
    m = np.where(a <= 3, 3, np.where(a <= 7, 2, 1))
    return np.select([e < -22, e < -15, e > 15], [np.full_like(e, -22), e, e - 1], e - m)


def ref_cast(x, fmt: str | FloatFormat, mode: str = "nearest_even", saturate: bool = True):
    """Round float32/float64 ``x`` onto ``fmt``; returns float32. Deterministic modes only."""
    fmt = get_format(fmt)
    x = np.asarray(x)
    neg = np.signbit(x)
    with np.errstate(all="ignore"):
        a = np.abs(x.astype(np.float64))
        fin = np.isfinite(a) & (a > 0)
        safe = np.where(fin, a, 1.0)
        e = (np.frexp(safe)[1] - 1).astype(np.int64)
        if fmt.kind == "hif8":
            q = _hif8_q(e)
            fmax, has_inf, has_zero = hif8.MAX, True, True
        else:
            lowest = fmt.emin - fmt.mbits if fmt.subnormals else fmt.emin
            q = np.where(e >= fmt.emin, e - fmt.mbits, lowest)
            fmax, has_inf, has_zero = fmt.max, fmt.inf, fmt.has_zero
        y = np.ldexp(safe, -q)
        t = np.trunc(y)
        f = y - t
        if mode == "nearest_even":
            r = np.rint(y)
        elif mode == "nearest_away":
            r = t + (f >= 0.5)
        elif mode == "toward_zero":
            r = t
        else:
            raise ValueError(mode)
        res = np.ldexp(r, q)
        over_val = np.inf if has_inf else np.nan
        if saturate or mode == "toward_zero":
            res = np.where(res > fmax, fmax, res)
        else:
            res = np.where(res > fmax, over_val, res)
        if not has_zero:
            res = np.where(res == 0, fmt.min_subnormal, res)
        inf_val = fmax if saturate else over_val
        res = np.where(np.isinf(a), inf_val, res)
        res = np.where(a == 0, 0.0 if has_zero else np.nan, res)
        res = np.where(np.isnan(a), np.nan, res)
        signed_zero = fmt.kind != "hif8" and fmt.signed_zero
        if fmt.signed:
            res = np.where(neg & ((res != 0) | signed_zero), -res, res)
        else:
            res = np.where(neg, np.nan, res)
    return res.astype(np.float32)


def hif8_ta_codebook(x: np.ndarray, saturate: bool = True) -> np.ndarray:
    """HiF8 TA by codebook: nearest of the 126 positive values (and 0), ties to larger magnitude."""
    grid = np.concatenate([[0.0], hif8.positive_grid(), [1.5 * 2.0**15]])  # last: the Inf slot
    with np.errstate(invalid="ignore"):
        a = np.abs(x.astype(np.float64))
        i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 2)
        lo, hi = grid[i], grid[i + 1]
        res = np.where(a - lo >= hi - a, hi, lo)
        res = np.where(a >= hi, hi, res)  # beyond the Inf slot
    over = res > hif8.MAX
    res = np.where(over, hif8.MAX if saturate else np.inf, res)
    res = np.where(np.isnan(a), np.nan, res)
    res = np.where(np.signbit(x) & (res != 0), -res, res)
    return res.astype(np.float32)


def _mbits(e: np.ndarray) -> np.ndarray:
    a = np.abs(e)
    return np.where(e < -15, 0, np.where(a <= 3, 3, np.where(a <= 7, 2, 1)))


def hif8_hybrid_ref(x: np.ndarray, saturate: bool = True) -> np.ndarray:
    """Ascend HR (hybrid) as docs/formats.md states it: ``x`` float32 (fp32 rule) or float16
    (fp16 rule)."""
    is16 = x.dtype == np.float16
    with np.errstate(all="ignore"):
        a = np.abs(x.astype(np.float64))
    out = np.zeros(a.shape)
    with np.errstate(all="ignore"):
        ok = np.isfinite(a) & (a >= 2.0**-23) & (a < 40960)
        safe = np.where(ok, a, 1.0)
        e = (np.frexp(safe)[1] - 1).astype(np.int64)
        fb = 10 if is16 else 23
        frac = ((safe / np.ldexp(1.0, e) - 1.0) * 2.0**fb).astype(np.int64)
        m = _mbits(e)
        shift = fb - m
        keep = frac >> shift
        rem = frac - (keep << shift)
        if is16:
            t = 2 * (x.view(np.uint16).astype(np.int64) & 1) + 1
            f = np.where(e == -23, 2 + (frac >> 9), rem >> (shift - 2))
            exact = np.where(e == -23, False, rem == 0)
        else:
            t = frac & 0x3FFF
            f = np.where(e == -23, (frac >> 10) + 8192, rem >> (shift - 14))
            exact = np.where(e == -23, False, rem == 0)
        keep = np.where(e == -23, 0, keep)
        ssr_up = (f >= t) & ~exact
        ssr = np.where(
            e == -23,
            np.where(ssr_up, 2.0**-22, 0.0),
            np.ldexp(1.0 + (keep + ssr_up) / np.ldexp(1.0, m), e),
        )
    with np.errstate(invalid="ignore"):
        ta = np.abs(hif8_ta_codebook(a.astype(np.float32), saturate=False).astype(np.float64))
    res = np.where(np.abs(e) < 4, ta, ssr)
    res = np.where(ok, res, out)
    res = np.where(np.isfinite(a) & (a >= 40960) | np.isinf(a), np.inf, res)
    res = np.where(res > hif8.MAX, hif8.MAX if saturate else np.inf, res)
    res = np.where(np.isnan(a), np.nan, res)
    res = np.where(np.signbit(x) & (res != 0), -res, res)
    return res.astype(np.float32)


#: every format a cast kernel handles: the named ones, the wide ones and odd eXmY shapes
KERNEL_FORMATS = [
    "e4m3",
    "e5m2",
    "e4m3fnuz",
    "e5m2fnuz",
    "e4m3-ieee",
    "e3m4",
    "e8m0",
    "e2m1",
    "e2m3",
    "e3m2",
    "hif8",
    "bf16",
    "fp16",
    "tf32",
    "fp32",
    "e5m6",
    "e8m3",
    "e1m2",
    "e5m0",
    "e3m0",
]


# ------------------------------------------------------------------------------- input sets
def all_fp16() -> np.ndarray:
    return np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def all_bf16() -> np.ndarray:
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def specials() -> np.ndarray:
    tiny = np.finfo(np.float32).smallest_subnormal
    return np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, F32_MAX, -F32_MAX, 1.0, -1.0],
        dtype=np.float32,
    )


def _neighbours(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    with np.errstate(over="ignore"):
        up = np.nextafter(v, np.float32(np.inf))
        down = np.nextafter(v, np.float32(0))
    return np.concatenate([v, up, down])


def grid_points(fmt: str | FloatFormat) -> np.ndarray:
    """Positive grid values of ``fmt`` (for wide formats: a few per binade) plus the point beyond
    max, in float64."""
    fmt = get_format(fmt)
    if fmt.kind == "hif8":
        g = hif8.positive_grid()
        return np.concatenate([g, [1.5 * 2.0**15]])
    mb = min(fmt.mbits, 4)
    sig = np.arange(1 << mb)
    pts = []
    for e in range(fmt.emin, fmt.emax + 2):
        # all of the first 2**mb significands and the last few of the binade
        m_full = 1 << fmt.mbits
        ms = np.unique(np.concatenate([sig, m_full - 1 - sig]))
        pts.append(np.ldexp(1.0 + ms / m_full, e))
    if fmt.subnormals:
        ms = np.unique(np.concatenate([sig, (1 << fmt.mbits) - 1 - sig]))
        ms = ms[ms > 0]
        pts.append(np.ldexp(ms / float(1 << fmt.mbits), fmt.emin))
    g = np.unique(np.concatenate(pts))
    g = g[g <= fmt.max]
    # the grid continues above max with the top binade's spacing
    step = np.ldexp(1.0, fmt.emax - fmt.mbits) if fmt.emax >= fmt.emin else fmt.min_subnormal
    return np.concatenate([g, [fmt.max + step]])


def tie_points(fmt: str | FloatFormat) -> np.ndarray:
    """Grid values, midpoints of consecutive grid values (incl. 0 -> min and max -> beyond), both
    signs, each with its float32 neighbours: every tie of every binade and every boundary."""
    fmt = get_format(fmt)
    g = grid_points(fmt)
    lows = np.concatenate([[0.0], g[:-1]])
    mids = (lows + g) / 2
    pts = np.concatenate([g, mids])
    pts = pts[(pts > 0) & (pts <= F32_MAX)]
    pts = _neighbours(pts.astype(np.float32))
    return np.concatenate([pts, -pts, specials()])


def random_fp32(n: int, fmt: str | FloatFormat, seed: int = 0) -> np.ndarray:
    """``n`` random float32: half uniformly random bit patterns, half log-uniform magnitudes
    spanning the format's range and a little beyond, random signs."""
    fmt = get_format(fmt)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    lo = np.log2(fmt.min_subnormal) - 3
    hi = min(np.log2(fmt.max) + 3, 127.9)
    mag = np.exp2(rng.uniform(lo, hi, n - n // 2))
    sign = rng.choice([-1.0, 1.0], n - n // 2)
    return np.concatenate([bits, (mag * sign).astype(np.float32)])


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise: identical float32 bits, or both NaN (NaN sign and payload ignored)."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def assert_same(got, want, x=None, what: str = "") -> None:
    ok = same_bits(got, want)
    if not ok.all():
        i = np.flatnonzero(~ok)[:8]
        detail = f"inputs {np.asarray(x)[i].tolist()} " if x is not None else ""
        raise AssertionError(
            f"{what}: {(~ok).sum()} mismatches; {detail}got {np.asarray(got)[i].tolist()} "
            f"want {np.asarray(want)[i].tolist()}"
        )


# ml_dtypes oracles by fp8lab format name: its fp8 casts never saturate, its fp4/fp6 casts always do
ML_NONSAT = {
    "e4m3": md.float8_e4m3fn,
    "e5m2": md.float8_e5m2,
    "e4m3fnuz": md.float8_e4m3fnuz,
    "e5m2fnuz": md.float8_e5m2fnuz,
    "e4m3-ieee": md.float8_e4m3,
    "e3m4": md.float8_e3m4,
    "e8m0": md.float8_e8m0fnu,
    "bf16": md.bfloat16,
    "fp16": np.float16,
}
ML_SAT = {
    "e2m1": md.float4_e2m1fn,
    "e2m3": md.float6_e2m3fn,
    "e3m2": md.float6_e3m2fn,
}
