"""The device-generic torch GEMM kernels give numba's bits: every accumulator kind and GPU row,
random and edge operands (zeros, maxima, subnormals, NaN/Inf, cancellation, ragged K, K = 1).

Each test runs the same `qmatmul` / `fused_dot` under ``numba`` and under ``torch`` on the CPU
and compares bit patterns (NaN: the positions, not the payloads, which are the device's). They
need numba, so they are skipped in the ``FP8LAB_KERNELS=torch`` run (which runs the rest of
tests/gemm, the published tensor-core vectors included, on the torch kernels alone)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab import Accumulator, QuantSpec, qmatmul, quantize
from fp8lab.formats import get_format
from fp8lab.gemm import fused_dot
from fp8lab.gemm.fused_torch import exact_sum_rz, round_out
from fp8lab.gemm.matmul import fp32_matmul
from fp8lab.kernels import kernel_counts, using_kernels

pytestmark = pytest.mark.numba_only


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.shape == y.shape and x.dtype == y.dtype == torch.float32
    nx, ny = torch.isnan(x), torch.isnan(y)
    assert torch.equal(nx, ny), f"NaN positions differ: {int((nx != ny).sum())}"
    bx = x.masked_fill(nx, 0).view(torch.int32)
    by = y.masked_fill(ny, 0).view(torch.int32)
    bad = bx != by
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} differ, first: {x[bad][:4].tolist()} vs "
        f"{y[bad][:4].tolist()}"
    )


def _both(fn):
    """``fn()`` under numba, then under the torch kernels; the torch run must not use numba."""
    with using_kernels("numba"):
        want = fn()
    kernel_counts(reset=True)
    with using_kernels("torch"):
        got = fn()
    assert kernel_counts()["numba"] == 0
    return want, got


def _unit(x: torch.Tensor, fmt: str):
    return quantize(x, QuantSpec(fmt, scaling=1.0))


def _operand(shape, fmt: str, seed: int, special: bool = False) -> torch.Tensor:
    """Values on ``fmt``'s grid over its whole range: subnormals, maxima, zeros, both signs;
    ``special`` adds the format's NaN and (E5M2) infinities."""
    g = torch.Generator().manual_seed(seed)
    ff = get_format(fmt)
    hi = 40 if ff.emax > 20 else ff.emax + 1  # bf16: products stay finite
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(ff.emin - 3, hi, shape, generator=g).float()
    )
    x = fp8lab.cast(x, fmt)
    x[torch.rand(shape, generator=g) < 0.08] = 0.0
    x[torch.rand(shape, generator=g) < 0.03] = float(ff.max)
    x[torch.rand(shape, generator=g) < 0.03] = -float(ff.max)
    x[torch.rand(shape, generator=g) < 0.03] = float(ff.min_subnormal) * 3
    if special:
        x[torch.rand(shape, generator=g) < 0.01] = float("nan")
        if fmt == "e5m2":
            x[torch.rand(shape, generator=g) < 0.01] = float("inf")
            x[torch.rand(shape, generator=g) < 0.01] = float("-inf")
    return x


def _c(m: int, n: int, seed: int, special: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-30, 30, (m, n), generator=g))
    c.view(-1)[:5] = torch.tensor([0.0, -0.0, 2.0**-140, -3e38, 1e-30])
    if special:
        c.view(-1)[5:8] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    return c


FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")]
HARDWARE_CASES = [(hw, f) for hw in ("h100", "h200", "ada", "l40s", "b200", "b200-tcgen05")
                  for f in FP8_PAIRS] + [
    ("h100", ("bf16", "bf16")), ("h100", ("fp16", "fp16")), ("ada", ("bf16", "bf16")),
    ("ada", ("fp16", "fp16")), ("b200", ("bf16", "bf16")), ("b200", ("fp16", "fp16")),
]  # fmt: skip


@pytest.mark.parametrize(("hw", "fmts"), HARDWARE_CASES, ids=str)
def test_gpu_rows_bit_identical(hw, fmts):
    # K = 100: ragged last group; c (unit scales, never promoted) enters the chain
    m, k, n = 9, 100, 13
    fa, fb = fmts
    qa = _unit(_operand((m, k), fa, 1), fa)
    qb = _unit(_operand((k, n), fb, 2), fb)
    c = _c(m, n, 3)
    for pe in (None, 64):
        acc = Accumulator(hw, promote_every=pe)
        if pe is not None and pe % acc.resolve(fa, fb).group:
            continue
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc, c=c))
        _same_bits(got, want)
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc))
        _same_bits(got, want)


@pytest.mark.parametrize(("hw", "fmts"), [("h100", ("e4m3", "e5m2")), ("h100", ("e5m2", "e5m2")),
                                          ("b200", ("e5m2", "e4m3")), ("ada", ("e5m2", "e5m2"))])  # fmt: skip
def test_nan_inf_operands_and_accumulators(hw, fmts):
    m, k, n = 6, 64, 10
    fa, fb = fmts
    qa = _unit(_operand((m, k), fa, 4, special=True), fa)
    qb = _unit(_operand((k, n), fb, 5, special=True), fb)
    c = _c(m, n, 6, special=True)
    want, got = _both(lambda: qmatmul(qa, qb, hw, c=c))
    _same_bits(got, want)
    assert torch.isnan(got).any() and torch.isfinite(got).any()


@pytest.mark.parametrize("k", [1, 2, 31, 33, 257])
@pytest.mark.parametrize("hw", ["h100", "ada", "b200"])
def test_short_and_ragged_k(k, hw):
    qa = _unit(_operand((5, k), "e4m3", 7), "e4m3")
    qb = _unit(_operand((k, 7), "e5m2", 8), "e5m2")
    c = _c(5, 7, 9)
    want, got = _both(lambda: qmatmul(qa, qb, hw, c=c))
    _same_bits(got, want)


def test_cancellation_zeros_and_maxima():
    # rows that cancel exactly, rows of zeros (c alone through every step), all-maximum rows
    # (carries at the largest exponent), a row of tiny products under a huge c
    k = 96
    a = torch.zeros(5, k)
    a[0, :48], a[0, 48:] = 448.0, -448.0
    a[2] = 448.0
    a[3] = 2.0**-9
    a[4, ::2], a[4, 1::2] = 16.0, 2.0**-6
    b = torch.ones(k, 4)
    b[:, 1] = 448.0
    b[1::2, 2] = -1.0
    c = torch.tensor([[0.0, 1.0, -1e30, 2.0**-130]] * 5)
    qa, qb = _unit(a, "e4m3"), _unit(b, "e4m3")
    for acc in ("h100", "ada", "b200", "b200-tcgen05", Accumulator("h100", promote_every=32)):
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc, c=c))
        _same_bits(got, want)


FUSED_CONFIGS = [
    Accumulator("fused", group=16, align_bits=9, out_bits=11, c_entry="after"),
    Accumulator("fused", group=8, align_bits=20, out_bits=23, out_rounding="nearest_even"),
    Accumulator("fused", group=32, align_bits=None, out_bits=13),  # exact sum, c aligned
    Accumulator("fused", group=4, align_bits=3, out_bits=2, exp_floor=-149, promote_every=16),
    Accumulator("fused", group=64, align_bits=None, out_bits=23, c_entry="after"),
]


@pytest.mark.parametrize("acc", FUSED_CONFIGS, ids=lambda a: a.describe())
@pytest.mark.parametrize("fmts", [("e4m3", "e5m2"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_fused_configurations(acc, fmts):
    fa, fb = fmts
    qa = _unit(_operand((7, 150), fa, 10), fa)
    qb = _unit(_operand((150, 9), fb, 11), fb)
    c = None if acc.promote_every else _c(7, 9, 12)
    want, got = _both(lambda: qmatmul(qa, qb, acc, c=c))
    _same_bits(got, want)


def test_fused_sum_that_rounds_in_float64_keeps_numba_order():
    # F = 40 and 4096 products per step: (G + 1) * 2**(F + 2) > 2**53, the float64 term sum can
    # round, and the torch kernel sums in K order as numba does
    acc = Accumulator("fused", group=4096, align_bits=40, out_bits=23)
    g = torch.Generator().manual_seed(13)
    a = torch.full((2, 4096), 448.0)
    a[1] = fp8lab.cast(torch.randn(4096, generator=g) * 300, "e4m3")
    b = torch.full((4096, 3), 448.0)
    b[::3, 1] = 2.0**-9
    qa, qb = _unit(a, "e4m3"), _unit(b, "e4m3")
    want, got = _both(lambda: qmatmul(qa, qb, acc))
    _same_bits(got, want)


LIMITED = [
    Accumulator("limited"),
    Accumulator("limited", mantissa_bits=5, rounding="nearest_even"),
    Accumulator("limited", mantissa_bits=23, rounding="nearest_even", group=16),
    Accumulator("limited", promote_every=64),
    Accumulator("limited", per_product=True, mantissa_bits=6),
    Accumulator("limited", per_product=True, mantissa_bits=9, promote_every=64),
]


@pytest.mark.parametrize("acc", LIMITED, ids=lambda a: a.describe())
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_limited_bit_identical(acc, fmts):
    # 70 rows: more than one row chunk; K = 600: two batched group-sum calls, ragged
    fa, fb = fmts
    qa = quantize(_operand((70, 600), fa, 14), fa)
    qb = quantize(_operand((600, 11), fb, 15), fb)
    want, got = _both(lambda: qmatmul(qa, qb, acc))
    _same_bits(got, want)
    if acc.promote_every is None:
        ua, ub = _unit(qa.values, fa), _unit(qb.values, fb)
        c = _c(70, 11, 16)
        want, got = _both(lambda: qmatmul(ua, ub, acc, c=c))
        _same_bits(got, want)


def test_limited_nan_inf_and_k1():
    qa = _unit(_operand((4, 1), "e5m2", 17, special=True), "e5m2")
    qb = _unit(_operand((1, 6), "e5m2", 18, special=True), "e5m2")
    for acc in LIMITED:
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc))
        _same_bits(got, want)
    qa = _unit(_operand((4, 64), "e5m2", 19, special=True), "e5m2")
    qb = _unit(_operand((64, 6), "e5m2", 20, special=True), "e5m2")
    for acc in LIMITED:
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc))
        _same_bits(got, want)


@pytest.mark.parametrize("acc", ["fp32", Accumulator("limited", promote_every=128),
                                 Accumulator("h100", promote_every=128)], ids=str)  # fmt: skip
def test_block_scales_bias_and_out_format(acc):
    g = torch.Generator().manual_seed(21)
    a = torch.randn(20, 384, generator=g) * torch.exp(torch.randn(20, 384, generator=g) * 2)
    b = torch.randn(384, 70, generator=g)
    qa = quantize(a, "e4m3", (1, 128), "pow2_down")
    qb = quantize(b, "e4m3", (128, 64), "max")  # ragged N edge
    bias = torch.randn(70, generator=g)
    c = torch.randn(20, 70, generator=g)
    for kw in ({}, {"bias": bias}, {"c": c, "out_format": "bf16"}):
        want, got = _both(lambda kw=kw: qmatmul(qa, qb, acc, **kw))
        _same_bits(got, want)


def test_fp32_accumulator_and_epilogue_per_tensor():
    g = torch.Generator().manual_seed(22)
    qa = quantize(torch.randn(33, 300, generator=g), "e4m3")
    qb = quantize(torch.randn(300, 17, generator=g), "e5m2")
    bias = torch.randn(17, generator=g)
    bias[2] = float("-inf")
    for kw in ({}, {"bias": bias}, {"c": torch.randn(33, 17, generator=g), "bias": bias}):
        want, got = _both(lambda kw=kw: qmatmul(qa, qb, **kw))
        _same_bits(got, want)


def test_fused_dot_published_shapes_and_specials():
    g = torch.Generator().manual_seed(23)
    for fmts, k in ((("e4m3", "e4m3"), 70), (("e5m2", "e4m3"), 1), (("bf16", "bf16"), 48)):
        a = _operand((40, k), fmts[0], 24, special=fmts[0] == "e5m2")
        b = _operand((40, k), fmts[1], 25)
        c = torch.randn(40, generator=g) * 100
        for hw in ("h100", "ada", "b200", "b200-tcgen05"):
            if hw == "b200-tcgen05" and fmts[0] == "bf16":
                continue
            want, got = _both(lambda hw=hw, a=a, b=b, f=fmts, c=c: fused_dot(a, b, hw, f, c=c))
            _same_bits(got, want)


@pytest.mark.parametrize("block_k", [256, 64, 16])
def test_tiling_over_rows_columns_and_k_blocks(monkeypatch, block_k):
    # a tiny tile budget: many ragged row and column tiles, K blocks of one or more groups (the
    # CPU's 256 and an accelerator's 64 K elements per block) and the dots' row chunks
    from fp8lab.gemm import fused_torch

    monkeypatch.setattr(fused_torch, "_budget", lambda device: 600)
    monkeypatch.setattr(fused_torch, "_block_k", lambda device: block_k)
    qa = _unit(_operand((23, 300), "e4m3", 27), "e4m3")
    qb = _unit(_operand((300, 19), "e5m2", 28), "e5m2")
    c = _c(23, 19, 29)
    for acc in ("h100", "ada", "b200", Accumulator("h100", promote_every=64)):
        want, got = _both(lambda acc=acc: qmatmul(qa, qb, acc, c=c))
        _same_bits(got, want)
    a = _operand((50, 70), "e4m3", 30)
    want, got = _both(lambda: fused_dot(a, a.flip(0), "h100", c=c.reshape(-1)[:50]))
    _same_bits(got, want)
    from fp8lab.gemm import limited_torch  # per-product column chunks

    monkeypatch.setattr(limited_torch, "_BUDGET", {"cpu": block_k * 40})
    acc = Accumulator("limited", per_product=True, mantissa_bits=7)
    want, got = _both(lambda: qmatmul(qa, qb, acc))
    _same_bits(got, want)


# ------------------------------------------------ the torch helpers against exact arithmetic
def test_exact_sum_rz_against_fractions():
    from fractions import Fraction

    g = torch.Generator().manual_seed(26)
    e = torch.randint(-280, 250, (300, 12), generator=g).double()
    p = fp8lab.cast(torch.randn(300, 12, generator=g), "bf16").double() * torch.exp2(e)
    p[:40, 1] = -p[:40, 0]  # exact cancellation of the largest terms
    p[40:60] = 0.0
    p[60, :2] = torch.tensor([2.0**100, -(2.0**100) + 2.0**-200])  # needs many limbs
    got = exact_sum_rz(p, 13)
    for row, r in zip(p.tolist(), got.tolist(), strict=True):
        s = sum((Fraction(x) for x in row), Fraction(0))
        if s == 0:
            assert r == 0.0
            continue
        m = abs(s)
        ex = m.numerator.bit_length() - m.denominator.bit_length()
        ex = ex - 1 if Fraction(2) ** ex > m else ex
        q = Fraction(2) ** (max(ex, -126) - 13)
        want = float((m // q) * q) * (1 if s > 0 else -1)
        want = math.copysign(math.inf, want) if abs(want) >= 2.0**128 else want
        assert r == want and math.copysign(1, r) == math.copysign(1, s), (row, r, want)


def test_round_out_edges():
    v = torch.tensor([0.0, -0.0, 2.0**-150, -(2.0**-150), 2.0**128, -(2.0**129), 1.0 + 2.0**-14,
                      float("nan"), float("inf")], dtype=torch.float64)  # fmt: skip
    r = round_out(v, 13, False)
    assert r[:2].view(torch.int32).tolist() == [0, 0]  # zero is +0
    assert r[2].item() == 0.0 and r[3].view(torch.int32).item() == -(2**31)  # signed zero
    assert r[4].item() == float("inf") and r[5].item() == float("-inf")
    assert r[6].item() == 1.0 and torch.isnan(r[7]) and r[8].item() == float("inf")
    assert round_out(torch.tensor([1.0 + 3 * 2.0**-14], dtype=torch.float64), 13, True) == (
        1.0 + 2.0**-12
    )


def test_fp32_matmul_scopes_tf32_off_and_restores():
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):  # torch < 2.9 (2.8: the lower bound): allow_tf32
        old = m.allow_tf32
        try:
            m.allow_tf32 = True
            with fp32_matmul(torch.device("cuda")):
                assert m.allow_tf32 is False
            assert m.allow_tf32 is True
        finally:
            m.allow_tf32 = old
        return
    old = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        with fp32_matmul(torch.device("cuda")):
            assert m.fp32_precision == "ieee"
        assert m.fp32_precision == "tf32"
        with pytest.raises(RuntimeError), fp32_matmul(torch.device("cuda")):
            raise RuntimeError("restored on error too")
        assert m.fp32_precision == "tf32"
        with fp32_matmul(torch.device("cpu")):
            assert m.fp32_precision == "tf32"  # CPU: untouched
    finally:
        m.fp32_precision = old


def test_mixed_devices_are_refused():
    a = fp8lab.cast(torch.randn(4, 64), "e4m3")
    with pytest.raises(ValueError, match="different devices"):
        fused_dot(a, a, "h100", c=torch.zeros(4, device="meta"))


# ------------------------------------------------------------- on a GPU (skipped without CUDA)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _to(q, device: str):
    """A QTensor moved to ``device`` (values and scales; the spec is device-free)."""
    import dataclasses

    return dataclasses.replace(
        q, values=q.values.to(device), scales=q.scales.to(device), _dense=[None]
    )


@cuda
@pytest.mark.parametrize(
    "acc",
    ["h100", "ada", "b200", "b200-tcgen05", Accumulator("h100", promote_every=128),
     Accumulator("limited"), Accumulator("limited", promote_every=128),
     Accumulator("limited", per_product=True, mantissa_bits=9)],
    ids=str,
)  # fmt: skip
def test_cuda_equals_cpu_numba(acc):
    g = torch.Generator().manual_seed(30)
    a = torch.randn(64, 640, generator=g) * torch.exp(torch.randn(64, 640, generator=g) * 2)
    b = torch.randn(640, 96, generator=g)
    qa, qb = quantize(a, "e4m3", (1, 128), "max"), quantize(b, "e5m2", (128, 128), "max")
    if getattr(acc, "promote_every", 0) is None or isinstance(acc, str):
        qa, qb = quantize(a, "e4m3"), quantize(b, "e5m2")
    bias = torch.randn(96, generator=g)
    with using_kernels("numba"):
        want = qmatmul(qa, qb, acc, bias=bias)
    got = qmatmul(_to(qa, "cuda"), _to(qb, "cuda"), acc, bias=bias.cuda())
    assert got.device.type == "cuda"
    _same_bits(got.cpu(), want)


@cuda
def test_cuda_fp32_accumulator_is_fp32_with_tf32_requested(record_property):
    # K-varying "max" block scales: the fp32 model multiplies dequantized operands (24-bit
    # significands, which TF32 would cut to 11): it must stay within the FP32 bound (Higham
    # eq. 3.5, gamma_(K+2) for the sums and the dequantization) although TF32 is switched on
    # globally, and the global switch must come back unchanged
    g = torch.Generator().manual_seed(31)
    k = 1024
    qa = quantize(torch.randn(128, k, generator=g), "e4m3", (1, 128), "max")
    qb = quantize(torch.randn(k, 64, generator=g), "e4m3", (128, 128), "max")
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        got = qmatmul(_to(qa, "cuda"), _to(qb, "cuda"), "fp32").cpu()
        assert m.fp32_precision == "tf32"
    finally:
        m.fp32_precision = old
    da, db = qa.dequantize().double(), qb.dequantize().double()
    exact = da @ db
    gamma = (k + 2) * 2.0**-24 / (1 - (k + 2) * 2.0**-24)
    bound = gamma * (da.abs() @ db.abs()) + 2.0**-60
    assert ((got.double() - exact).abs() <= bound).all()
    cpu = qmatmul(qa, qb, "fp32")
    ulps = (got.view(torch.int32).long() - cpu.view(torch.int32).long()).abs().max().item()
    record_property("fp32_max_ulp_cuda_vs_cpu", ulps)  # BLAS order: reported, not pinned


@cuda
def test_cuda_native_scaled_mm_within_fp32_bound():
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability"):
            qmatmul(_to(quantize(torch.randn(16, 32), "e4m3"), "cuda"),
                    _to(quantize(torch.randn(32, 16), "e4m3"), "cuda"), native=True)  # fmt: skip
        return
    g = torch.Generator().manual_seed(32)
    qa = quantize(torch.randn(50, 200, generator=g), "e4m3")  # no dimension a multiple of 16
    qb = quantize(torch.randn(200, 30, generator=g), "e5m2")
    got = qmatmul(_to(qa, "cuda"), _to(qb, "cuda"), native=True).cpu()
    da, db = qa.dequantize().double(), qb.dequantize().double()
    gamma = 203 * 2.0**-24 / (1 - 203 * 2.0**-24)
    assert ((got.double() - da @ db).abs() <= gamma * (da.abs() @ db.abs()) + 2.0**-60).all()
