"""HiFloat8: worked decode/encode values (arXiv 2409.16626 layout; Ascend TA and hybrid rounding as
docs/formats.md describes them), exhaustive sweeps, and grid properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from formats_reference import (
    all_bf16,
    all_fp16,
    assert_same,
    hif8_hybrid_ref,
    hif8_ta_codebook,
    random_fp32,
    tie_points,
)

from fp8lab import cast, decode, encode, get_format
from fp8lab.formats import hif8

# worked decode table: code -> value
WORKED_CODES = {
    0x08: 1.0,
    0x0C: 1.5,
    0x0F: 1.875,
    0x10: 2.0,
    0x17: 3.75,
    0x18: 0.5,
    0x20: 4.0,
    0x28: 8.0,
    0x2F: 15.0,
    0x30: 0.25,
    0x38: 0.125,
    0x40: 16.0,
    0x4C: 128.0,
    0x4F: 224.0,
    0x50: 1 / 16,
    0x5C: 1 / 128,
    0x60: 256.0,
    0x6E: 32768.0,
    0x70: 2.0**-8,
    0x7E: 2.0**-15,
    0x7F: 1.5 * 2.0**-15,
    0x01: 2.0**-22,
    0x07: 2.0**-16,
    0x88: -1.0,
    0xEE: -32768.0,
    0x00: 0.0,
    0x6F: math.inf,
    0xEF: -math.inf,
}

# worked encodings under TA, non-saturating
WORKED_TA = [
    (1.0625, 0x09),
    (1.1875, 0x0A),
    (0.1, 0x52),
    (100.0, 0x4A),
    (1000.0, 0x64),
    (0.3, 0x32),
    (40959.0, 0x6E),
    (40960.0, 0x6F),
    (1.5 * 2.0**-16, 0x7E),
    (2.0**-23, 0x01),
    (0.99 * 2.0**-23, 0x00),
]


def test_decode_worked_codes():
    codes = torch.tensor(list(WORKED_CODES), dtype=torch.uint8)
    assert decode(codes, "hif8").tolist() == list(WORKED_CODES.values())
    assert math.isnan(decode(torch.tensor([0x80], dtype=torch.uint8), "hif8").item())


def test_table_counts_and_extremes():
    t = hif8.DECODE_TABLE.astype(np.float64)
    assert np.isfinite(t).sum() == 253
    assert ((t > 0) & np.isfinite(t)).sum() == 126
    assert len(np.unique(t[np.isfinite(t) & (t > 0)])) == 126  # one code per value
    f = get_format("hif8")
    g = hif8.positive_grid()
    assert (g[0], g[-1]) == (f.min_subnormal, f.max) == (2.0**-22, 32768.0)
    assert f.binades == 38 and f.eps == 0.125
    # the code order is not monotone in value
    assert t[0x18] < t[0x10] and t[0x70] > t[0x07]


@pytest.mark.parametrize(("x", "code"), WORKED_TA)
def test_worked_ta_encodings(x, code, kernels):
    got = encode(torch.tensor([x, -x]), "hif8", rounding="nearest_away", saturate=False).tolist()
    neg = code | 0x80 if code else 0  # no -0: negative underflow is 0x00
    assert got == [code, neg]


def test_default_rounding_is_ta_and_saturation():
    x = torch.tensor([1.0625, 40960.0, -math.inf, math.inf, math.nan, -0.0, -1e-9])
    got = cast(x, "hif8")  # default rounding for HiF8 is TA, saturating
    assert got[:5].tolist()[:4] == [1.125, 32768.0, -32768.0, 32768.0]
    assert math.isnan(got[4].item())
    assert [v for v in got[5:].tolist()] == [0.0, 0.0]
    assert all(math.copysign(1, v) == 1 for v in got[5:].tolist())
    nonsat = cast(x, "hif8", saturate=False)
    assert nonsat[1].item() == math.inf and nonsat[2].item() == -math.inf


def _sweep():
    x = np.concatenate([all_fp16(), all_bf16(), tie_points("hif8"), random_fp32(10**6, "hif8")])
    return x


def test_ta_equals_codebook_search(kernels):
    x = _sweep()
    for saturate in (True, False):
        got = cast(torch.from_numpy(x), "hif8", rounding="nearest_away", saturate=saturate)
        assert_same(got.numpy(), hif8_ta_codebook(x, saturate), x, f"TA sat={saturate}")


def _neighbours(x: np.ndarray):
    """Lower and upper HiF8 grid neighbours of |x| (0 and the Inf slot included)."""
    grid = np.concatenate([[0.0], hif8.positive_grid(), [1.5 * 2.0**15]])
    a = np.abs(x.astype(np.float64))
    i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 2)
    return grid[i], grid[i + 1]


def test_properties_nearest_modes_and_truncation():
    rng = np.random.default_rng(7)
    x = np.exp2(rng.uniform(-25, 15.3, 200_000)).astype(np.float32)
    x = np.concatenate([x, tie_points("hif8")])
    x = x[np.isfinite(x) & (np.abs(x) < 40960)]
    lo, hi = _neighbours(x)
    a = np.abs(x.astype(np.float64))
    grid_or_zero = set(hif8.positive_grid().tolist()) | {0.0}
    for mode in ("nearest_even", "nearest_away", "toward_zero"):
        r = np.abs(cast(torch.from_numpy(x), "hif8", rounding=mode).numpy().astype(np.float64))
        assert set(np.unique(r).tolist()) <= grid_or_zero, mode  # on the grid
        if mode == "toward_zero":
            assert (r == lo).all()
            continue
        d = np.minimum(a - lo, hi - a)
        assert (np.abs(r - a) == d).all(), mode  # a nearest neighbour
        tie = (a - lo) == (hi - a)
        if mode == "nearest_away":
            assert (r[tie] == hi[tie]).all()


@pytest.mark.parametrize("mode", ["nearest_even", "nearest_away", "toward_zero"])
def test_monotone(mode):
    x = np.sort(np.concatenate([np.linspace(-50000, 50000, 300_001), tie_points("hif8")]))
    x = x[np.isfinite(x)].astype(np.float32)
    x = np.sort(x)
    r = cast(torch.from_numpy(x), "hif8", rounding=mode).numpy()
    assert (np.diff(r.astype(np.float64)) >= 0).all()


@pytest.mark.parametrize(
    "mode", ["nearest_even", "nearest_away", "toward_zero", "stochastic", "hybrid"]
)
def test_idempotent_and_grid_fixed(mode):
    x = torch.from_numpy(random_fp32(100_000, "hif8", seed=5))
    once = cast(x, "hif8", rounding=mode, generator=torch.Generator().manual_seed(0))
    twice = cast(once, "hif8", rounding=mode, generator=torch.Generator().manual_seed(1))
    assert_same(twice.numpy(), once.numpy(), what=mode)
    # every finite code value is a fixed point
    vals = torch.from_numpy(hif8.DECODE_TABLE.copy())
    fixed = cast(vals, "hif8", rounding=mode, saturate=False)
    assert_same(fixed.numpy(), vals.numpy(), what=mode)


def test_round_trip_all_codes(kernels):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = decode(codes, "hif8")
    back = encode(vals, "hif8", saturate=False)
    keep = codes != 0x80
    assert torch.equal(back[keep], codes[keep])
    assert back[~keep].tolist() == [0x80]


# ------------------------------------------------------------------------------------ hybrid
def test_hybrid_worked_rules(kernels):
    def h(vals, dtype=torch.float32, saturate=True):
        return cast(torch.tensor(vals, dtype=dtype), "hif8", rounding="hybrid", saturate=saturate)

    # |E| < 4: TA (ties away)
    assert h([1.0625, 1.1875, 3.1875]).tolist() == [1.125, 1.25, 3.25]
    # SSR, fp32: binade 2^4 (2 mantissa bits, spacing 4). 17 = 16 + 1: f14 = 0x1000, t14 = 0 ->
    # round up to 20; 16 exact -> stays; 16 + 1 ulp: f14 = 0 < t14 = 1 -> stays.
    assert h([16.0, 17.0, 16.0 + 2.0**-19]).tolist() == [16.0, 20.0, 16.0]
    # bf16 input uses the fp32 rule on its value: t14 = 0, so every inexact value rounds up
    assert h([16.125], torch.bfloat16).tolist() == [20.0]
    # t14 > f14 keeps: 17 + (low bits 0x3FFF) has f14 = 0x1000 (+ tiny) < t14 = 0x3FFF
    x = np.array([17.0], dtype=np.float32)
    x = (x.view(np.uint32) | np.uint32(0x3FFF)).view(np.float32)
    assert h(x.tolist()).tolist() == [16.0]
    # overflow threshold as TA; an SSR carry out of 2^15 is the Inf slot
    assert h([40959.0, 40960.0], saturate=False).tolist() == [32768.0, math.inf]
    assert h([36864.0], saturate=False).tolist() == [math.inf]  # f14 = 4096 >= t14 = 0: carry
    assert h([36864.0, 32769.0]).tolist() == [32768.0, 32768.0]
    assert h([40960.0, -1e9]).tolist() == [32768.0, -32768.0]
    # underflow: below 2^-23 -> 0; the e = -23 binade uses f14 = (frac >> 10) + 2^13
    assert h([2.0**-24 * 1.9, 2.0**-23]).tolist() == [0.0, 2.0**-22]
    # fp16 rule: f2 (2 bits below the kept mantissa) >= 2 * lsb + 1
    # 17 in fp16: mantissa 0b0001000000, f2 = 0b01 = 1, lsb = 0 -> t2 = 1 -> up
    assert h([17.0], torch.float16).tolist() == [20.0]
    # 16.5: f2 = 0b00 -> stays at 16; 18 (f2 = 0b10 >= 1) -> 20; 16 + 2^-6 (lsb 1, f2 0) -> 16
    assert h([16.5, 18.0, 16.0 + 2.0**-6], torch.float16).tolist() == [16.0, 20.0, 16.0]


def test_hybrid_exhaustive_fp16_rule(kernels):
    x = all_fp16().astype(np.float16)
    for saturate in (True, False):
        got = cast(torch.from_numpy(x), "hif8", rounding="hybrid", saturate=saturate).numpy()
        assert_same(got, hif8_hybrid_ref(x, saturate), x, f"fp16 hybrid sat={saturate}")


def test_hybrid_exhaustive_bf16_and_random_fp32(kernels):
    xb = all_bf16()
    got = cast(torch.from_numpy(xb).bfloat16(), "hif8", rounding="hybrid").numpy()
    assert_same(got, hif8_hybrid_ref(xb), xb, "bf16 hybrid")
    x = np.concatenate([random_fp32(10**6, "hif8", seed=11), tie_points("hif8")])
    for saturate in (True, False):
        got = cast(torch.from_numpy(x), "hif8", rounding="hybrid", saturate=saturate).numpy()
        assert_same(got, hif8_hybrid_ref(x, saturate), x, f"fp32 hybrid sat={saturate}")


def test_hybrid_float64_rejected():
    with pytest.raises(ValueError, match="hybrid"):
        cast(torch.ones(2, dtype=torch.float64), "hif8", rounding="hybrid")


def test_hybrid_roughly_unbiased_on_fp32_noise():
    # SSR draws its threshold from the input's own low bits: over smooth inputs it is unbiased.
    rng = np.random.default_rng(0)
    x = (100.0 + rng.uniform(0, 16, 10**6)).astype(np.float32)  # binade 2^6, spacing 16
    r = cast(torch.from_numpy(x), "hif8", rounding="hybrid").numpy().astype(np.float64)
    assert abs((r - x).mean()) < 0.05
