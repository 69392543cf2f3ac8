"""The SIMD vector operations of the accumulator kernels (`fp8lab.gemm.simd`) lane by lane
against numpy: the bit-pattern cut, the int32 truncation, the lane masks. The kernels built on
them are checked bit for bit by the GEMM suites (tests/gemm/test_gemm.py, test_fused.py)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from fp8lab.gemm.simd import (
    vadd,
    vand_bits,
    vcut,
    vdiv,
    vfma,
    vload,
    vmask_outside,
    vmax,
    vmul,
    vsplat,
    vstore,
    vtrunc_i32,
)

pytestmark = pytest.mark.numba_only


@njit(cache=True)
def _f64_ops(x, y, out, drop, rne):  # pragma: no cover - numba
    """Per block of 4 lanes: out[0] = cut(x), out[1] = x * y + 1, out[2] = x + y."""
    one = vsplat(1.0)
    for j in range(0, x.shape[1], 4):
        a, b = vload(x, 0, j), vload(y, 0, j)
        vstore(out, 0, j, vcut(a, drop, rne))
        vstore(out, 1, j, vfma(a, b, one))
        vstore(out, 2, j, vadd(a, b))


@njit(cache=True)
def _f32_ops(x, y, out, masks, lo, hi, bits):  # pragma: no cover - numba
    """Per block of 8 lanes: trunc, max, mul, div, and-bits, and the outside mask."""
    for j in range(0, x.shape[1], 8):
        a, b = vload(x, 0, j), vload(y, 0, j)
        vstore(out, 0, j, vtrunc_i32(a))
        vstore(out, 1, j, vmax(a, b))
        vstore(out, 2, j, vmul(a, b))
        vstore(out, 3, j, vdiv(a, b))
        vstore(out, 4, j, vand_bits(a, bits))
        masks[j // 8] = vmask_outside(a, lo, hi)


def _cut_ref(x: np.ndarray, drop: int, rne: bool) -> np.ndarray:
    """Keep 52 - drop fraction bits of float64 x: RZ, or RNE, on the bit pattern (the
    `limited` model's documented cut), in numpy uint64."""
    u = x.view(np.uint64).copy()
    d = np.uint64(drop)
    if rne:
        u = u + (np.uint64(1) << (d - np.uint64(1))) - np.uint64(1) + ((u >> d) & np.uint64(1))
    return (u & ~((np.uint64(1) << d) - np.uint64(1))).view(np.float64)


@pytest.mark.parametrize("rne", [False, True])
def test_float64_lanes(rne):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, 64)) * 2.0 ** rng.integers(-30, 30, (1, 64))).astype(np.float64)
    x[0, :4] = [0.0, -0.0, 1.0 + 2.0**-13, -(1.0 + 3 * 2.0**-14)]  # ties and signed zeros
    y = np.where(rng.random((1, 64)) < 0.5, -1.0, 1.0) * 2.0 ** rng.integers(-5, 5, (1, 64))
    out = np.empty((3, 64))
    for drop in (1, 39, 51):
        _f64_ops(x, y, out, drop, rne)
        np.testing.assert_array_equal(out[0].view(np.uint64), _cut_ref(x[0], drop, rne).view(
            np.uint64))  # fmt: skip
    # y a power of two: the product is exact, so fused or not the sum rounds once
    np.testing.assert_array_equal(out[1], x[0] * y[0] + 1.0)
    np.testing.assert_array_equal(out[2], x[0] + y[0])


def test_float32_lanes():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((1, 32)) * 1000).astype(np.float32)
    x[0, :4] = [-0.75, 0.75, -0.0, 2.0**-110]
    x[0, 4] = np.float32(2.0**101)
    y = (rng.standard_normal((1, 32)) * 1000).astype(np.float32)
    out = np.empty((5, 32), dtype=np.float32)
    masks = np.zeros(4, dtype=np.int64)
    lo, hi = np.float32(2.0**-100), np.float32(2.0**100)
    bits = np.uint32(0xFFFFE000)
    _f32_ops(x, y, out, masks, lo, hi, bits)
    t = np.trunc(x[0]) + np.float32(0.0)  # an exact zero comes back +0
    inside = np.arange(32) != 4  # lane 4 (2**101) is outside int32: undefined there
    np.testing.assert_array_equal(out[0, inside].view(np.uint32), t[inside].view(np.uint32))
    np.testing.assert_array_equal(out[1], np.where(y[0] > x[0], y[0], x[0]))
    np.testing.assert_array_equal(out[2], x[0] * y[0])
    np.testing.assert_array_equal(out[3], x[0] / y[0])
    np.testing.assert_array_equal(out[4].view(np.uint32), x[0].view(np.uint32) & bits)
    outside = (x[0] <= lo) | (x[0] >= hi)
    want = [int(sum(1 << i for i in range(8) if outside[8 * b + i])) for b in range(4)]
    assert masks.tolist() == want
    assert want[0] & 0b11101 and not want[0] & 0b00010  # the edge lanes are really exercised
