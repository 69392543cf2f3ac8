"""Stochastic rounding: unbiased within statistical bounds, reproducible, on the grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8lab import cast, decode, get_format

N = 1_000_000


def _grid(fmt: str) -> np.ndarray:
    f = get_format(fmt)
    if f.bits <= 8:
        v = decode(torch.arange(1 << f.bits, dtype=torch.int32).to(torch.uint8), fmt).double()
        v = v[torch.isfinite(v) & (v >= 0)].numpy()
    else:  # bf16: every positive finite value
        v = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.unique(v)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8", "e2m1", "bf16", "e8m0", "e3m2"])
def test_unbiased(fmt, kernels):
    f = get_format(fmt)
    rng = np.random.default_rng(0)
    x = (np.abs(rng.standard_normal(N)) * min(f.max / 8, 1.0) + 1e-3).astype(np.float32)
    g = torch.Generator().manual_seed(123)
    r = cast(torch.from_numpy(x), fmt, rounding="stochastic", generator=g).numpy()
    grid = _grid(fmt)
    a = x.astype(np.float64)
    i = np.searchsorted(grid, a, side="right") - 1
    lo, hi = grid[i], grid[np.minimum(i + 1, len(grid) - 1)]
    exact = lo == a
    r = r.astype(np.float64)
    assert ((r == lo) | (r == hi)).all()  # one of the two neighbours
    assert (r[exact] == a[exact]).all()
    p = np.where(exact, 0.0, (a - lo) / np.where(exact, 1.0, hi - lo))
    var = (p * (1 - p) * (hi - lo) ** 2).sum()
    assert abs((r - a).sum()) < 5 * np.sqrt(var)  # mean error within 5 sigma
    up = (r == hi) & ~exact
    assert abs(up.sum() - p.sum()) < 5 * np.sqrt((p * (1 - p)).sum())


def test_single_value_probability():
    x = torch.full((N,), 1.0 + 0.3 * 0.125, dtype=torch.float32)  # 30% of an e4m3 step above 1
    r = cast(x, "e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(9))
    frac = (r == 1.125).double().mean().item()
    assert set(r.unique().tolist()) == {1.0, 1.125}
    assert abs(frac - 0.3) < 5 * np.sqrt(0.3 * 0.7 / N)


def test_negative_symmetric():
    x = torch.full((N,), -(1.0 + 0.75 * 0.125))
    r = cast(x, "e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(2))
    assert abs((r == -1.125).double().mean().item() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / N)


def test_reproducible_and_advancing():
    x = torch.randn(50_000)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a1 = cast(x, "e5m2", rounding="stochastic", generator=g1)
    a2 = cast(x, "e5m2", rounding="stochastic", generator=g2)
    assert torch.equal(a1, a2)
    b1 = cast(x, "e5m2", rounding="stochastic", generator=g1)  # generator advanced
    assert not torch.equal(a1, b1)
    torch.manual_seed(77)
    c1 = cast(x, "e5m2", rounding="stochastic")
    torch.manual_seed(77)
    c2 = cast(x, "e5m2", rounding="stochastic")
    assert torch.equal(c1, c2)


def test_exact_values_never_move_and_specials(kernels):
    vals = torch.tensor([0.0, 1.0, -448.0, 2.0**-9, float("inf"), float("nan")])
    r = cast(vals, "e4m3", rounding="stochastic", saturate=True)
    assert r[:5].tolist() == [0.0, 1.0, -448.0, 2.0**-9, 448.0] and torch.isnan(r[5])


def test_subnormal_and_tiny_probabilities(kernels):
    # far below the smallest e4m3 step: P(up) = x / 2^-9
    x = torch.full((N,), 2.0**-9 / 16)
    r = cast(x, "e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(4))
    assert abs((r > 0).double().mean().item() - 1 / 16) < 5 * np.sqrt(1 / 16 * 15 / 16 / N)
