"""QTensor: its memoised dequantized copy (contract C3) and straight-through gradients."""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab.scaling.granularity import as_2d, expand_blocks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.nan_to_num(a, nan=7.77)
    b = torch.nan_to_num(b, nan=7.77)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def slow_dequantize(q) -> torch.Tensor:
    """values * scales (* the NVFP4 tensor scale) with expanded scales: torch ops only."""
    v2 = as_2d(q.values)
    d = v2 * expand_blocks(q.scales, q.spec.block, tuple(v2.shape))
    if q.global_scale is not None:
        d = d * q.global_scale
    return d.reshape(q.values.shape)


def data(shape=(64, 96), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    x[0, 0] = math.nan
    x[1, 1] = -0.0
    return x


CASES = [
    ("e4m3", "tensor", "max"),
    ("e4m3", (1, 32), "pow2_down"),
    ("e4m3", "mx", "mx_floor"),
    ("e2m1", "nvfp4", "nvfp4"),
    ("e5m2", (32, 1), "max"),
    ("hif8", "row", "max"),
]


# ------------------------------------------------------------------ C3: the memoised copy
@pytest.mark.parametrize("fmt,gran,rule", CASES)
def test_dequantize_is_memoised_and_shared_with_the_transpose(fmt, gran, rule):
    q = fp8lab.quantize(data(), fmt, gran, rule)
    d = q.dequantize()
    assert same_bits(d, slow_dequantize(q))
    assert q.dequantize() is d  # computed once
    t = q.t()
    dt = t.dequantize()
    assert dt.data_ptr() == d.data_ptr() and same_bits(dt, d.t())  # the same storage, transposed
    assert same_bits(dt, slow_dequantize(t))
    # the transpose's transpose still shares it
    assert t.t().dequantize().data_ptr() == d.data_ptr()


def test_transpose_first_then_the_original_shares_its_copy():
    q = fp8lab.quantize(data(), "e4m3", (1, 32), "max")
    t = q.t()
    dt = t.dequantize()
    d = q.dequantize()
    assert d.data_ptr() == dt.data_ptr() and same_bits(d, slow_dequantize(q))


@pytest.mark.parametrize("fmt,gran,rule", CASES)
def test_dequantized_out_becomes_the_memo(fmt, gran, rule):
    x = data()
    buf = torch.full_like(x, 5.0)
    q = fp8lab.quantize(x, fmt, gran, rule, dequantized_out=buf)
    assert q.dequantize() is buf
    assert same_bits(buf, slow_dequantize(q))
    assert q.t().dequantize().data_ptr() == buf.data_ptr()
    # retile writes and memoises its dequantized_out the same way
    buf2 = torch.empty_like(x)
    r = fp8lab.retile(q, source=x, dequantized_out=buf2)
    assert r.dequantize() is buf2 and same_bits(buf2, slow_dequantize(r))


def test_new_values_recompute_the_copy():
    q = fp8lab.quantize(data(), "e4m3", "row")
    d = q.dequantize()
    q.values = torch.zeros_like(q.values)  # a new values tensor: the old copy no longer applies
    d2 = q.dequantize()
    assert d2 is not d and torch.equal(d2, torch.zeros_like(d2))


# ------------------------------------------------------------------ straight-through gradients
def test_fake_quant_and_cast_pass_gradients_straight_through():
    x = (torch.randn(8, 32) * 100).requires_grad_()  # e4m3 saturates some: gradient still 1
    (x * 2 + fp8lab.fake_quant(x, "e4m3")).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    (x * 2 + fp8lab.cast(x, "e4m3")).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dequantize_gradient_reaches_the_source(dtype):
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 64)
    q = fp8lab.quantize(x, "e4m3", "mx")
    (q.dequantize() * w).sum().backward()
    assert x.grad.dtype == dtype and torch.equal(x.grad, w.to(dtype))
    # through the transpose as well
    x.grad = None
    (q.t().dequantize() * w.t()).sum().backward()
    assert torch.equal(x.grad, w.to(dtype))


def test_no_grad_paths_keep_no_graph():
    x = torch.randn(4, 32, requires_grad=True)
    with torch.no_grad():
        assert not fp8lab.fake_quant(x, "e4m3").requires_grad
        assert not fp8lab.cast(x, "e4m3").requires_grad
        q = fp8lab.quantize(x, "e4m3")
    assert not q.dequantize().requires_grad  # quantized without grad mode: no source kept
    y = torch.randn(4, 32)
    assert not fp8lab.fake_quant(y, "e4m3").requires_grad
    assert not fp8lab.quantize(x, "e4m3").values.requires_grad
    # the forward values are the no-grad ones, bit for bit
    assert same_bits(fp8lab.fake_quant(x, "e4m3").detach(), fp8lab.fake_quant(x.detach(), "e4m3"))
    assert same_bits(fp8lab.cast(x, "e5m2").detach(), fp8lab.cast(x.detach(), "e5m2"))


# ------------------------------------------------------------------ E8M0 scale codes
def test_scale_codes_of_every_e8m0_code_incl_the_subnormal_code_0():
    # issue 11 item 3: code 0 (2**-127) is a float32 subnormal; it used to raise
    from fp8lab import QTensor, QuantSpec
    from fp8lab.scaling import rules

    codes = torch.arange(256, dtype=torch.int32)
    q = QTensor(
        values=torch.zeros(256, 32),
        scales=rules.e8m0_to_scale_inv(codes).reshape(256, 1),
        spec=QuantSpec("e4m3", "mx"),
    )
    assert torch.equal(q.scale_codes().reshape(-1), codes.to(torch.uint8))


def test_scale_codes_of_zero_and_tiny_blocks():
    q = fp8lab.quantize(torch.zeros(1, 32), "e4m3", "mx", "mx_floor")
    assert q.scale_codes().tolist() == [[0]]
    x = torch.zeros(3, 64)
    x[1, :32] = 2.0**-140
    x[2, 32:] = 1.0
    for rule in ("mx_floor", "mx_ceil", "mx_even", "mx_rceil"):
        q = fp8lab.quantize(x, "e4m3", "mx", rule)
        want = torch.frexp(q.scales)[1] - 1 + 127  # exact exponent of a power of two
        assert torch.equal(q.scale_codes(), want.to(torch.uint8)), rule


def test_scale_codes_refuse_other_scales():
    from fp8lab import QTensor, QuantSpec

    for bad in (3.0, -2.0, 0.0, math.inf, 2.0**-128):
        q = QTensor(values=torch.zeros(1, 32), scales=torch.tensor([[bad]]), spec=QuantSpec())
        with pytest.raises(ValueError, match="powers of two"):
            q.scale_codes()


def test_replaced_scales_recompute_the_copy():
    import dataclasses

    q = fp8lab.quantize(data(), "e4m3", "row")
    d = q.dequantize()
    r = dataclasses.replace(q, scales=q.scales * 2)  # same values, other scales
    assert same_bits(r.dequantize(), slow_dequantize(r)) and not same_bits(r.dequantize(), d)
    assert same_bits(q.dequantize(), d)
