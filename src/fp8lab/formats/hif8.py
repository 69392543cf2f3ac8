"""HiFloat8 (HiF8, Huawei Ascend; arXiv 2409.16626): a tapered-precision 8-bit format.

Layout (arXiv 2409.16626; docs/formats.md, "HiFloat8"):
``S | Dot (prefix code) | exponent (D bits) | mantissa``.
Binades 2^-3..2^3 carry 3 mantissa bits, 2^±4..2^±7 carry 2, 2^±8..2^±15 carry 1, and seven
"denormal" (DML) binades 2^-22..2^-16 are bare powers of two. One zero (0x00), one NaN (0x80),
±Inf at 0x6F/0xEF (the would-be 1.5*2^15), max finite 2^15, min positive 2^-22.

Rounding onto the grid is done by the same bit-level kernel as every ExMy format
(`fp8lab.formats.rounding`): this module only supplies the grid as a table "binade -> exponent of
the quantum" (`quantum_exponents`), the 256-entry decode table and the code-ordering helpers.
The Ascend ``hybrid`` rule (TA in the 3-bit binades, SSR elsewhere) lives in the kernel too.
"""

from __future__ import annotations

import math

import numpy as np

#: HiF8 overflow threshold: |x| >= 1.25 * 2**15 rounds to the Inf slot (or saturates).
OVERFLOW_THRESHOLD = 40960.0
MAX = 32768.0
MIN_POSITIVE = 2.0**-22
INF_CODE = 0x6F
NAN_CODE = 0x80
MAX_CODE = 0x6E


def mantissa_bits(e: int) -> int:
    """Stored mantissa bits of the HiF8 binade ``[2**e, 2**(e+1))`` (0 in the DML binades)."""
    a = abs(e)
    if e < -15:
        return 0
    if a <= 3:
        return 3
    if a <= 7:
        return 2
    return 1


def quantum_exponent(e: int) -> int:
    """Exponent of the grid spacing for a value in binade ``e`` (unbounded above, as for rounding).

    Below 2**-22 the grid is {0, 2**-22}, so the spacing is 2**-22 (|x| >= 2**-23 rounds up under
    TA). Above 2**15 the 1-bit binade continues: its next point, 1.5*2**15, is the Inf slot.
    """
    if e < -22:
        return -22
    if e < -15:
        return e
    if e > 15:
        return e - 1
    return e - mantissa_bits(e)


def _decode_one(b: int) -> float:
    """Decode one code (the layout above; checked on all 256 codes in tests/formats)."""
    if b == 0x00:
        return 0.0
    if b == NAN_CODE:
        return math.nan
    sign = -1.0 if b & 0x80 else 1.0
    p = b & 0x7F
    if p == INF_CODE:
        return sign * math.inf
    if p >> 3 == 0:
        return sign * 2.0 ** ((p & 7) - 23)
    if p >> 3 == 1:
        return sign * (1.0 + (p & 7) / 8.0)
    if p >> 4 == 1:
        e = -1 if (p >> 3) & 1 else 1
        return sign * 2.0**e * (1.0 + (p & 7) / 8.0)
    dot = p >> 5
    if dot == 1:
        em, mag, m, mb = (p >> 3) & 3, 2 | ((p >> 3) & 1), p & 7, 3
        neg = em >> 1
    elif dot == 2:
        em, mag, m, mb = (p >> 2) & 7, 4 | ((p >> 2) & 3), p & 3, 2
        neg = em >> 2
    else:
        em, mag, m, mb = (p >> 1) & 15, 8 | ((p >> 1) & 7), p & 1, 1
        neg = em >> 3
    e = -mag if neg else mag
    return sign * 2.0**e * (1.0 + m / 2.0**mb)


#: float32 value of each of the 256 codes (0x80 -> NaN, 0x6F/0xEF -> ±Inf).
DECODE_TABLE: np.ndarray = np.array([_decode_one(b) for b in range(256)], dtype=np.float32)


def positive_grid() -> np.ndarray:
    """The 126 positive finite HiF8 values, ascending (float64)."""
    v = DECODE_TABLE[:128].astype(np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    return np.sort(v)


def order_key(codes: np.ndarray) -> np.ndarray:
    """A sort key for codes by decoded value (the code order is not monotone in value)."""
    return DECODE_TABLE[np.asarray(codes, dtype=np.uint8)]
