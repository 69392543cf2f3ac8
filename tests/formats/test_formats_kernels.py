"""The fast float32 kernel against the generic (integer significand) kernel, all formats and modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats_reference import KERNEL_FORMATS as FORMATS
from formats_reference import all_bf16, all_fp16, assert_same, random_fp32, tie_points

from fp8lab import cast, get_format
from fp8lab.formats import rounding


def _both(x, fmt, **kw):
    fast = cast(x, fmt, **kw)
    rounding._force_generic = True
    try:
        slow = cast(x, fmt, **kw)
    finally:
        rounding._force_generic = False
    return fast.numpy(), slow.numpy()


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_kernel_equals_generic(fmt):
    f = get_format(fmt)
    assert rounding._params(f).fast
    x = torch.from_numpy(
        np.concatenate([all_fp16(), all_bf16(), tie_points(fmt), random_fp32(200_000, fmt, 2)])
    )
    modes = ["nearest_even", "nearest_away", "toward_zero", "stochastic"]
    if f.kind == "hif8":
        modes.append("hybrid")
    for mode in modes:
        for saturate in (True, False):
            if not saturate and not f.inf and not f.has_nan:
                continue
            kw = dict(rounding=mode, saturate=saturate)
            if mode == "stochastic":
                # same draws only where both kernels take the same random path; compare laws instead
                continue
            fast, slow = _both(x, fmt, **kw)
            assert_same(fast, slow, x.numpy(), f"{fmt} {mode} sat={saturate}")
    if f.kind == "hif8":
        x16 = torch.from_numpy(all_fp16()).half()
        fast, slow = _both(x16, fmt, rounding="hybrid")
        assert_same(fast, slow, what="hif8 hybrid fp16 rule")


@pytest.mark.parametrize("fmt", ["e4m3", "hif8", "e8m0", "e2m1"])
def test_fast_stochastic_same_law_as_generic(fmt):
    # both kernels round up with probability (x - lo) / (hi - lo): compare the frequencies
    x = torch.full((400_000,), 1.0 + 0.37 * get_format(fmt).eps, dtype=torch.float32)
    fast, slow = _both(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    pf, ps = (fast > 1.0).mean(), (slow > 1.0).mean()
    assert abs(pf - ps) < 6 * np.sqrt(0.37 * 0.63 / 400_000) * 1.5


@pytest.mark.parametrize("fmt", ["e4m3", "hif8", "e8m0", "e5m6"])
def test_serial_and_parallel_paths_agree(fmt):
    x = torch.from_numpy(random_fp32(150_000, fmt, seed=8))
    x64 = x.double() * (1 + 2.0**-30)
    modes = ["nearest_even", "nearest_away", "toward_zero"] + (["hybrid"] if fmt == "hif8" else [])
    for mode in modes:
        for t in (x, x64) if mode != "hybrid" else (x,):
            whole = cast(t, fmt, rounding=mode)  # parallel kernels
            parts = torch.cat([cast(c, fmt, rounding=mode) for c in t.split(5000)])  # serial
            assert_same(whole.numpy(), parts.numpy(), what=f"{fmt} {mode} {t.dtype}")
