"""The study through GEMM accumulator models (``accumulator="limited"`` / GPU names): the chunk
plumbing against an exact-rational reference of the ``limited`` model, and the hardware models
against one ``qmatmul`` per dot product (the gemm layer tests the models themselves)."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from fp8lab.gemm import qmatmul
from fp8lab.lab import snr
from fp8lab.lab.snr import SnrConfig
from fp8lab.lab.snr.tensorcore import ROWS_PER_CALL, chunk_sums, row_dots
from fp8lab.qtensor import QuantSpec, quantize


def _rz(v: Fraction, bits: int) -> Fraction:
    """``v`` truncated toward zero to ``bits`` fraction bits below its leading one."""
    if v == 0:
        return v
    e = math.floor(math.log2(abs(v)))
    while Fraction(2) ** e > abs(v):
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(v):
        e += 1
    q = Fraction(2) ** (e - bits)
    n = abs(v) // q
    return (n * q) if v > 0 else -(n * q)


def _limited_ref(a: np.ndarray, b: np.ndarray, group: int = 32, bits: int = 13) -> float:
    """The ``limited`` model of `fp8lab.gemm` for one dot product, in exact rationals: exact sums
    of ``group`` consecutive products, the accumulator cut to ``bits`` after each group."""
    acc = Fraction(0)
    for g0 in range(0, len(a), group):
        s = sum(
            Fraction(float(x)) * Fraction(float(y))
            for x, y in zip(a[g0 : g0 + group], b[g0 : g0 + group], strict=True)
        )
        acc = _rz(acc + s, bits)
    return float(acc)


def _grid_values(rows: int, k: int, seed: int, positive: bool = False) -> tuple[np.ndarray, ...]:
    """E4M3 values spanning the whole range (subnormals to 448), signed or all positive."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        x = torch.randn(rows, k, generator=g, dtype=torch.float64) * torch.exp2(
            torch.randint(-12, 8, (rows, k), generator=g).double()
        )
        if positive:
            x = x.abs()
        v = quantize(x.float(), QuantSpec(format="e4m3", scaling=1.0)).values
        out.append(v.double().numpy())
    return tuple(out)


def test_row_dots_is_limited_model_exactly() -> None:
    # more rows than one GEMM call, K not a multiple of the 32-product group
    va, vb = _grid_values(ROWS_PER_CALL + 5, 100, seed=1)
    got = row_dots(va, vb, "limited", "e4m3")
    ref = [_limited_ref(va[r], vb[r]) for r in range(va.shape[0])]
    np.testing.assert_array_equal(got, np.array(ref))
    # same-sign products: the truncation is biased, so it differs from the exact sum
    pa, pb = _grid_values(4, 1024, seed=2, positive=True)
    got = row_dots(pa, pb, "limited", "e4m3")
    exact = np.einsum("ij,ij->i", pa, pb)
    assert np.all(got <= exact) and np.any(got < exact)
    np.testing.assert_array_equal(got, [_limited_ref(pa[r], pb[r]) for r in range(4)])


def test_chunk_sums_split_ragged_chunks() -> None:
    va, vb = _grid_values(3, 200, seed=3)
    got = chunk_sums(va, vb, 64, "limited", "e4m3")  # 64, 64, 64, 8
    assert got.shape == (3, 4)
    for r in range(3):
        for j, k0 in enumerate(range(0, 200, 64)):
            assert got[r, j] == _limited_ref(va[r, k0 : k0 + 64], vb[r, k0 : k0 + 64])


@pytest.mark.parametrize(
    "kw",
    [{}, {"promote_every": 96}, {"block": 64}, {"scaling": 64.0, "promote_every": 128}],
    ids=["whole", "promote96", "block64", "fixed64-promote128"],
)
def test_run_descales_and_promotes_model_chunks(kw: dict) -> None:
    cfg = SnrConfig(length=256, samples=5, seed=4, accumulator="limited", **kw)
    res = snr.run(cfg)
    a, b = snr.generate_vectors(cfg)
    target = cfg.target
    chunk = cfg.block or cfg.promote_every or cfg.length
    for i in range(cfg.samples):
        total = 0.0
        for k0 in range(0, cfg.length, chunk):
            sl = slice(k0, k0 + chunk)
            if cfg.scaling == "auto":
                fa = target / np.abs(a[i, sl if cfg.block else slice(None)]).max()
                fb = target / np.abs(b[i, sl if cfg.block else slice(None)]).max()
            else:
                fa = fb = cfg.scaling
            qa = snr.cast_array(a[i, sl] * fa, "e4m3", "nearest_even", True)
            qb = snr.cast_array(b[i, sl] * fb, "e4m3", "nearest_even", True)
            part = _limited_ref(qa, qb)
            total += part / (fa * fb) if cfg.block else part
        if not cfg.block:
            total /= fa * fb
        assert res.result[i] == pytest.approx(total, rel=1e-15, abs=0)
    assert res.acc_overflow_fraction == 0.0
    assert res.config.to_dict()["acc_rounding"] is None


def test_model_runs_beside_format_runs() -> None:
    base = SnrConfig(length=512, samples=8, seed=5)
    cfgs = [replace(base, accumulator="limited"), replace(base, accumulator="fp64"), base]
    together = snr.run_many(cfgs)
    for c, r in zip(cfgs, together, strict=True):
        np.testing.assert_array_equal(r.result, snr.run(c).result)
        np.testing.assert_array_equal(r.reference, together[1].reference)


@pytest.mark.parametrize("name", ["h100", "h200", "ada", "l40s", "b200", "b200-tcgen05"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_hardware_rows_equal_one_qmatmul_per_dot_product(name: str, fmt: str) -> None:
    va, vb = _grid_values(ROWS_PER_CALL + 3, 96, seed=6)
    va = quantize(torch.from_numpy(va).float(), QuantSpec(format=fmt, scaling=1.0)).values
    vb = quantize(torch.from_numpy(vb).float(), QuantSpec(format=fmt, scaling=1.0)).values
    got = row_dots(va.double().numpy(), vb.double().numpy(), name, fmt)
    spec = QuantSpec(format=fmt, scaling=1.0)
    for r in range(va.shape[0]):
        y = qmatmul(
            quantize(va[r : r + 1], spec), quantize(vb[r : r + 1].t().contiguous(), spec), name
        )
        assert got[r] == float(y[0, 0])


def test_hardware_model_runs_the_study() -> None:
    cfg = SnrConfig(length=1024, samples=20, seed=7, accumulator="h100")
    r = snr.run(cfg)
    exact = snr.run(replace(cfg, accumulator="fp64"))
    # zero-mean operands: the element quantisation dominates, the tensor core adds little
    assert abs(r.median_db - exact.median_db) < 3.0
    with pytest.raises(ValueError, match="no model for e4m3-ieee"):
        snr.run(replace(cfg, format="e4m3-ieee"))  # no H100 row for this format
    # a format alias picks the same row
    np.testing.assert_array_equal(snr.run(replace(cfg, format="E4M3")).result, r.result)
