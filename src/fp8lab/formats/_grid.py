"""The constants of a cast kernel, shared by the numba kernels (`fp8lab.formats.rounding`) and the
device-generic torch kernels (`fp8lab.formats.rounding_torch`): one definition for both.

A format's grid reaches a kernel as one record per kernel family, built once per format and
overflow rule by ``rounding._grids``: `GenericGrid` for the integer-significand kernel (any input
width, any format), `FastGrid` for the float32 bit kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# binade table: entry k describes binade eb = k + TAB_LO (inputs outside are clamped to the ends,
# where every format's table is flat below and overflowing above)
TAB_LO = -192
TAB_N = 400

F_SIGNED_ZERO = 1
F_HAS_ZERO = 2
F_SIGNED = 4

NAN_BITS = 0x7FC00000  # the quiet NaN every cast writes
INF_BITS = 0x7F800000  # float32 +Inf
HYB_OVF_BITS = 0x47200000  # 40960.0f: HiF8 hybrid overflows from here

#: (sign bit, Inf bit pattern, stored mantissa bits) of binary32 and binary64 inputs
BITS32 = (31, 0x7F800000, 23)
BITS64 = (63, 0x7FF0000000000000, 52)


# Format constants travel as ONE record per kernel family (a NamedTuple, which numba passes by
# value as a struct).
class GenericGrid(NamedTuple):
    qtab: np.ndarray  # int64[TAB_N]: exponent of the grid spacing per binade
    stab: np.ndarray  # float64[TAB_N]: 2.0**qtab
    maxval: float  # the format's max
    ovfval: float  # what an overflowing finite input becomes
    infval: float  # what an infinite input becomes
    tinyval: float  # a non-zero input rounding to 0 in a format without zero
    flags: int  # F_SIGNED_ZERO | F_HAS_ZERO | F_SIGNED


class FastGrid(NamedTuple):
    is_hif8: bool
    s_norm: np.int32  # rounding shift for binades >= emin
    emin_field: np.int32  # float32 exponent field of the smallest normal binade
    lowq150: np.int32  # exponent of the grid spacing below emin, + 150
    s_e0: np.int32  # rounding shift for float32 subnormal inputs
    maxb: np.uint32  # float32 bits of max, of the overflow result, inf result, tiny result
    ovfb: np.uint32
    infb: np.uint32
    tinyb: np.uint32
    no_zero: bool
    signed: bool
    signed_zero: bool


def _f32_bits(v: float) -> np.uint32:
    return np.array([v], dtype=np.float32).view(np.uint32)[0]


def fast_grid(
    maxval: float,
    ovfval: float,
    infval: float,
    tinyval: float,
    flags: int,
    *,
    is_hif8: bool = False,
    s_norm: int = 0,
    emin_field: int = 0,
    lowq150: int = 0,
    s_e0: int = 0,
) -> FastGrid:
    """The `FastGrid` of the float32 bit kernels: the overflow, zero and sign constants (the
    `GenericGrid` fields of the same names) as float32 bits and flags, with the rounding-position
    fields (zero where only the finishing step is used, as by the torch kernel's
    integer-significand path)."""
    return FastGrid(
        is_hif8,
        np.int32(s_norm),
        np.int32(emin_field),
        np.int32(lowq150),
        np.int32(s_e0),
        _f32_bits(maxval),
        _f32_bits(ovfval),
        _f32_bits(infval),
        _f32_bits(tinyval),
        (flags & F_HAS_ZERO) == 0,
        (flags & F_SIGNED) != 0,
        (flags & F_SIGNED_ZERO) != 0,
    )
