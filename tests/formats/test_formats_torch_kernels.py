"""The device-generic torch kernels of cast / encode / decode / round_bf16 against numba, bit for bit.

Which inputs are exhaustive and which sampled:

* exhaustive: all 65,536 16-bit patterns, as bfloat16 and as float16 input, every format, every
  rounding (stochastic with the same generator seed), both overflow rules; all codes of every
  format of 8 bits or fewer (decode, and encode of every decoded value);
* edge sets: float32 every exponent field x edge mantissas (0, 1, 2, 3, each single bit, each
  bit minus one and plus one, all ones: subnormals, +-0, +-Inf and NaN payloads among them), each
  format's tie points with their float32 neighbours (every tie, max +- 1 ulp, the subnormal and
  overflow boundaries); float64 the same per exponent field (0..2047) and ties moved by 2**-40;
* sampled: 10**6 random float32 bit patterns and log-uniform magnitudes per format, 2 * 10**5
  random float64.

Under ``FP8LAB_KERNELS=torch`` the numba side is skipped (``numba_only``) and the oracle tests
(which take the ``kernels`` fixture) check the torch kernels against the references.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats_reference import KERNEL_FORMATS as FORMATS
from formats_reference import assert_same, random_fp32, tie_points

from fp8lab import cast, decode, encode, get_format
from fp8lab.formats import rounding, rounding_torch
from fp8lab.kernels import kernel_counts, using_kernels
from fp8lab.nn._kernels import round_bf16

EIGHT_BIT = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e4m3-ieee", "e3m4", "e8m0", "hif8", "e2m5"]
SMALL = ["e2m1", "e2m3", "e3m2", "e3m3"]

numba_only = pytest.mark.numba_only  # every test here compares with numba


def _modes(fmt: str, dtype: torch.dtype = torch.float32) -> list[tuple[str, bool]]:
    """Every (rounding, saturate) pair ``cast`` accepts for ``fmt`` and the input dtype."""
    f = get_format(fmt)
    modes = ["nearest_even", "nearest_away", "toward_zero", "stochastic"]
    if f.kind == "hif8" and dtype != torch.float64:
        modes.append("hybrid")
    sats = (True, False) if (f.inf or f.has_nan) else (True,)
    return [(m, s) for m in modes for s in sats]


def _both(x: torch.Tensor, fmt: str, mode: str, saturate: bool) -> tuple[np.ndarray, np.ndarray]:
    """cast by numba and by torch; stochastic draws from two generators with the same seed."""
    res = []
    for name in ("numba", "torch"):
        gen = torch.Generator().manual_seed(1234) if mode == "stochastic" else None
        with using_kernels(name):
            res.append(cast(x, fmt, rounding=mode, saturate=saturate, generator=gen).numpy())
    return res[0], res[1]


def _compare(x: torch.Tensor, fmt: str, what: str) -> None:
    for mode, sat in _modes(fmt, x.dtype):
        a, b = _both(x, fmt, mode, sat)
        assert_same(b, a, x.float().numpy(), f"{what} {fmt} {mode} sat={sat}")


def _f32_edges() -> np.ndarray:
    """Every float32 exponent field with edge mantissas, both signs (see the module docstring)."""
    bits = [0, 1, 2, 3, 0x7FFFFF]
    for k in range(23):
        bits += [1 << k, (1 << k) - 1, (1 << k) + 1]
    mant = np.unique(np.array(bits, dtype=np.uint32) & 0x7FFFFF)
    ex = np.arange(256, dtype=np.uint32)
    pat = ((ex[:, None] << 23) | mant[None, :]).reshape(-1)
    return np.concatenate([pat, pat | np.uint32(0x80000000)]).view(np.float32)


def _f64_edges(fmt: str) -> np.ndarray:
    bits = [0, 1, 2, 3, (1 << 52) - 1]
    for k in range(0, 52, 3):
        bits += [1 << k, (1 << k) - 1, (1 << k) + 1]
    mant = np.unique(np.array(bits, dtype=np.uint64) & np.uint64((1 << 52) - 1))
    ex = np.arange(2048, dtype=np.uint64)
    pat = ((ex[:, None] << np.uint64(52)) | mant[None, :]).reshape(-1)
    pat = np.concatenate([pat, pat | np.uint64(1 << 63)]).view(np.float64)
    ties = tie_points(fmt).astype(np.float64)
    return np.concatenate([pat, ties, ties * (1 + 2.0**-40), ties * (1 - 2.0**-40)])


@numba_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_exhaustive_16bit_inputs(fmt):
    """Exhaustive: all 65,536 bf16 and all 65,536 fp16 bit patterns as input."""
    codes = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    _compare(codes.view(torch.bfloat16), fmt, "all bf16")
    _compare(codes.view(torch.float16), fmt, "all fp16")


@numba_only
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2fnuz", "hif8", "e8m0", "e2m1", "bf16"])
def test_eager_torch_kernel_equals_numba(fmt, monkeypatch):
    """The torch kernel run eagerly (as below `COMPILE_MIN` elements or where compiling fails)
    rather than compiled: exhaustive over the 16-bit patterns, plus the float32 edge set."""
    monkeypatch.setattr(rounding_torch, "COMPILE_MIN", 1 << 62)
    codes = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    _compare(codes.view(torch.bfloat16), fmt, "eager all bf16")
    _compare(codes.view(torch.float16), fmt, "eager all fp16")
    _compare(torch.from_numpy(np.concatenate([_f32_edges(), tie_points(fmt)])), fmt, "eager")


def test_a_compiled_kernel_that_disagrees_is_not_used(monkeypatch):
    """A compiled kernel is used only after it gave the eager kernel's bits on the probe (inductor's
    AVX2 code did not, 2026-11-27): a wrong one here is caught, warned about, and never used."""

    def wrong(u, k, seed, family):
        return rounding_torch._fast_kernel(u, k, seed, family) ^ 1

    monkeypatch.setattr(rounding_torch, "_compiled", {"fast": wrong})
    x = torch.randn(rounding_torch.COMPILE_MIN * 2, generator=torch.Generator().manual_seed(3))
    with using_kernels("torch"), pytest.warns(RuntimeWarning, match="different bits"):
        got = cast(x, "e4m3")
    assert rounding_torch._compiled[("verified", "cpu", 0)] is False
    with using_kernels("torch"):
        again = cast(x, "e4m3")  # remembered: no second check, still the eager kernel
    eager = rounding_torch._fast_kernel(
        x.view(torch.int32),
        rounding_torch._consts(rounding._grids(get_format("e4m3"), True, 0)[1], 0, 0, x.device),
        torch.tensor(0),
        0,
    ).view(torch.float32)
    assert torch.equal(got.view(torch.int32), eager.view(torch.int32))
    assert torch.equal(again.view(torch.int32), eager.view(torch.int32))


@numba_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_edges_and_random(fmt):
    """Edge set (every exponent x edge mantissas, ties, max +- ulp) and 10**6 random float32."""
    x = np.concatenate([_f32_edges(), tie_points(fmt), random_fp32(1_000_000, fmt, seed=11)])
    _compare(torch.from_numpy(x), fmt, "float32")


@numba_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_float64_edges_and_random(fmt):
    """Edge set per float64 exponent field, ties +- 2**-40, and 2 * 10**5 random float64."""
    rng = np.random.default_rng(5)
    rand = rng.integers(0, 2**64, 200_000, dtype=np.uint64).view(np.float64)
    x = torch.from_numpy(np.concatenate([_f64_edges(fmt), rand]))
    _compare(x, fmt, "float64")


@numba_only
@pytest.mark.parametrize("fmt", ["e4m3", "hif8", "e8m0", "e2m1", "e5m6"])
def test_generic_torch_kernel_equals_numba(fmt):
    """The torch integer-significand kernel (any format; float64's) on float32 input, sampled."""
    x = torch.from_numpy(np.concatenate([_f32_edges(), tie_points(fmt), random_fp32(100_000, fmt)]))
    rounding._force_generic = True
    try:
        _compare(x, fmt, "generic")
    finally:
        rounding._force_generic = False


@numba_only
def test_stochastic_same_draws_both_kernels():
    """Same generator seed -> the same random numbers on both: identical outputs, sampled."""
    numba_draws = np.array([rounding._rand32(2**63 - 25, i) for i in range(1000)], dtype=np.int64)
    assert (
        rounding_torch.rand32(2**63 - 25, 1000, torch.device("cpu")).numpy() == numba_draws
    ).all()
    assert (rounding_torch.rand32(-7, 1000, torch.device("cpu")).numpy() >= 0).all()
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(0)) * 3
    a, b = _both(x, "e4m3", "stochastic", True)
    assert_same(b, a, x.numpy(), "stochastic")
    with using_kernels("torch"):
        c = cast(x, "e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(9))
    assert not np.array_equal(c.numpy(), a)  # another seed, other draws


@numba_only
@pytest.mark.parametrize("fmt", EIGHT_BIT + SMALL)
def test_codec_all_codes(fmt):
    """Exhaustive: decode of every code, encode of every decoded value and of random floats."""
    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)[: 1 << f.bits]
    res = {}
    for name in ("numba", "torch"):
        with using_kernels(name):
            vals = decode(codes, fmt)
            x = torch.cat([vals, torch.from_numpy(random_fp32(20_000, fmt, seed=3))])
            sat = not f.inf and not f.has_nan
            res[name] = (vals.numpy(), encode(x, fmt, saturate=sat).numpy())
    assert_same(res["torch"][0], res["numba"][0], what=f"decode {fmt}")
    assert np.array_equal(res["torch"][1], res["numba"][1])


@numba_only
def test_round_bf16_torch_equals_numba():
    """round_bf16: all 2**16 high halves x edge low halves (ties, NaN payloads), exhaustive over
    the rounding bits that matter."""
    hi = np.arange(65536, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    x = torch.from_numpy((hi[:, None] | lo[None, :]).reshape(-1).view(np.float32))
    with using_kernels("numba"):
        a = round_bf16(x)
    with using_kernels("torch"):
        b = round_bf16(x)
        y = x.clone()
        assert round_bf16(y, out=y) is y
    assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
    assert np.array_equal(y.numpy().view(np.uint32), b.numpy().view(np.uint32))


def test_torch_kernels_dispatch_out_and_shapes():
    """The torch kernels run under "torch" (counted), write ``out`` (also in place), keep shapes."""
    x = torch.randn(3, 5) * 100
    ref = torch.from_numpy(_torch_e4m3(x))
    with using_kernels("torch"):
        kernel_counts(reset=True)
        out = torch.empty(3, 5)
        assert cast(x, "e4m3", out=out) is out
        assert kernel_counts()["torch"] == 1 and kernel_counts()["numba"] == 0
        assert torch.equal(out, ref)
        y = x.clone()
        cast(y, "e4m3", out=y)
        assert torch.equal(y, ref)
        assert cast(x.t(), "e4m3").shape == (5, 3)
        assert cast(torch.tensor(3.3), "e4m3").shape == ()
        assert cast(torch.empty(0, 4), "e4m3").shape == (0, 4)
        assert encode(torch.empty(0), "e4m3").shape == (0,)


def _torch_e4m3(x: torch.Tensor) -> np.ndarray:
    """e4m3 RNE saturating of float32 ``x`` by torch's own cast (an independent reference)."""
    return x.to(torch.float8_e4m3fn).float().numpy()


def test_meta_device_follows_input():
    """A non-CPU tensor (the meta device: shapes only) runs the torch kernels and every temporary
    lives on its device: a stray CPU tensor in the kernels would raise here."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.empty(7, 3, dtype=dtype, device="meta")
        for mode, sat in _modes("hif8", dtype) + _modes("e8m0") + _modes("e4m3"):
            fmt = "hif8" if mode == "hybrid" else "e4m3"
            r = cast(x, fmt, rounding=mode, saturate=sat, generator=torch.Generator())
            assert r.device.type == "meta" and r.shape == x.shape and r.dtype == torch.float32
    x = torch.empty(5, device="meta")
    assert cast(x, "e8m0").device.type == "meta"
    assert round_bf16(x).device.type == "meta"
    assert decode(torch.empty(4, dtype=torch.uint8, device="meta"), "e4m3").device.type == "meta"
    with pytest.raises(ValueError, match="numba"), using_kernels("numba"):
        cast(x, "e4m3")
    with pytest.raises(ValueError, match="different devices"):
        cast(x, "e4m3", out=torch.empty(5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8", "e8m0", "e2m1", "bf16"])
def test_cuda_equals_cpu(fmt):
    """On a GPU: the CUDA result equals the CPU torch kernels' (and so numba's), sampled + edges."""
    x = torch.from_numpy(np.concatenate([_f32_edges(), tie_points(fmt), random_fp32(200_000, fmt)]))
    for t in (x, x.double(), x.half(), x.bfloat16()):
        for mode, sat in _modes(fmt, t.dtype):
            kw = dict(rounding=mode, saturate=sat)
            with using_kernels("torch"):
                cpu = cast(t, fmt, generator=torch.Generator().manual_seed(1), **kw)
            gpu = cast(t.cuda(), fmt, generator=torch.Generator().manual_seed(1), **kw)
            assert gpu.device.type == "cuda"
            assert_same(gpu.cpu().numpy(), cpu.numpy(), what=f"cuda {fmt} {t.dtype} {mode}")
        if get_format(fmt).bits <= 8:
            assert torch.equal(encode(x.cuda(), fmt).cpu(), encode(x, fmt))
