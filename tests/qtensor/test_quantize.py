"""quantize / QTensor / QuantSpec: the fused kernels against fp8lab.cast, TE semantics, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab import QTensor, QuantSpec
from fp8lab.scaling.granularity import as_2d, block_amax, expand_blocks

F32 = np.float32


def nasty(shape=(300, 515), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    x[0, 0] = math.nan
    x[1, 1] = -math.inf if shape[1] > 1 else x[1, 0]
    x[2, 2] = -0.0
    x[3, 3:40] = 1e-30
    x[4, 100:130] = 2.0**-140  # fp32 subnormals
    return x


def reference_values(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """cast(x * multiplier) with fp8lab.cast and torch ops only (the slow, obvious way)."""
    x2 = as_2d(x).float()
    mult = expand_blocks(q.scale_multipliers, q.spec.block, tuple(x2.shape))
    return fp8lab.cast(
        x2 * mult, q.spec.fmt, rounding=q.spec.rounding, saturate=q.spec.saturate
    ).reshape(x.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.nan_to_num(a, nan=7.77)
    b = torch.nan_to_num(b, nan=7.77)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


FORMATS = ["e4m3", "e5m2", "e2m1", "e3m2", "e2m3", "e4m3fnuz", "e5m2fnuz", "e5m6", "bf16", "fp16"]
CASES = [
    ("tensor", "max"),
    ((1, 128), "pow2_down"),
    ("mx", "mx_floor"),
    ("mx", "mx_rceil"),
    ("nvfp4", "nvfp4"),
    ("row", "max"),
    ("col", "pow2_up"),
    ((128, 128), "max"),
    ("tensor", 1.0),
    ("tensor", 1e6),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_kernel_equals_cast(fmt):
    x = nasty()
    for g, sc in CASES:
        q = fp8lab.quantize(x, fmt, g, sc)
        assert same_bits(q.values, reference_values(x, q)), (fmt, g, sc)


@pytest.mark.parametrize("rounding", ["toward_zero", "nearest_away", "stochastic"])
def test_other_roundings_go_through_cast(rounding):
    x = nasty((64, 96))
    gen = torch.Generator().manual_seed(3)
    q = fp8lab.quantize(x, "e4m3", (1, 32), "max", rounding, generator=gen)
    if rounding != "stochastic":
        assert same_bits(q.values, reference_values(x, q))
    else:
        q2 = fp8lab.quantize(
            x, "e4m3", (1, 32), "max", rounding, generator=torch.Generator().manual_seed(3)
        )
        assert same_bits(q.values, q2.values)  # reproducible with a seeded generator
    # no saturation: e5m2 overflow goes to inf
    qn = fp8lab.quantize(torch.tensor([1.0, 2.0]), "e5m2", scaling=1e5, saturate=False)
    assert torch.isinf(qn.values[1])


def test_values_and_scales_follow_te():
    x = torch.tensor([[3.0, -1.0, 0.001, 500.0]])
    q = fp8lab.quantize(x, "e4m3")
    scale = F32(448) / F32(500)  # correctly rounded fp32 division
    assert q.scales.item() == float(F32(1) / scale)  # stored: scale_inv
    want = fp8lab.cast(torch.tensor([[3.0, -1.0, 0.001, 500.0]]) * torch.tensor(scale), "e4m3")
    assert torch.equal(q.values, want)
    assert q.values[0, 3].item() == 448.0
    # dequantize = values * scale_inv
    assert torch.equal(q.dequantize(), q.values * q.scales)


def test_te_amax_special_cases():
    # all zeros: amax 0 -> scale 1
    q = fp8lab.quantize(torch.zeros(4, 4), "e4m3")
    assert q.scales.item() == 1.0 and torch.all(q.values == 0)
    # inf in the tensor: amax inf -> scale 1; the inf saturates to 448 (satfinite)
    q = fp8lab.quantize(torch.tensor([1.0, math.inf, -2.0]), "e4m3")
    assert q.scales.item() == 1.0 and q.values.tolist() == [1.0, 448.0, -2.0]
    # NaN ignored by amax, NaN element stays NaN
    q = fp8lab.quantize(torch.tensor([1.0, math.nan, -2.0]), "e4m3")
    assert q.scales.item() == float(F32(1) / F32(224))
    assert math.isnan(q.values[1].item()) and q.values[2].item() == -448.0
    # tiny amax: the scale overflows to inf -> FLT_MAX per tensor, but the input dtype's max in
    # TE's block kernels (bf16 input -> BF16 max)
    tiny = torch.full((2, 128), 1e-39)
    assert fp8lab.quantize(tiny, "e4m3").scale_multipliers.item() == float(np.finfo(F32).max)
    qb = fp8lab.quantize(tiny.bfloat16(), "e4m3", (1, 128))
    assert torch.all(qb.scale_multipliers == torch.finfo(torch.bfloat16).max)
    # all-NaN block -> amax 0 -> scale 1
    q = fp8lab.quantize(torch.full((2, 4), math.nan), "e4m3", "row")
    assert q.scales.tolist() == [[1.0], [1.0]]


def test_block_scales_layout_and_dequantize():
    x = nasty((130, 260), seed=4)
    x = torch.nan_to_num(x, nan=0.0, neginf=-5.0)
    q = fp8lab.quantize(x, "e4m3", (1, 128))
    assert q.scales.shape == (130, 3)
    amax = block_amax(x, (1, 128))
    assert torch.equal(q.scales, torch.reciprocal(fp8lab.scaling.max_scale(amax, "e4m3")))
    d = q.dequantize()
    assert d.shape == x.shape
    rel = ((d - x).abs() / x.abs().clamp_min(1e-30))[
        x.abs() > amax.repeat_interleave(128, 1)[:, :260] / 64
    ]
    assert rel.max() <= 2.0**-4 + 1e-6  # e4m3: half an ulp of 3 mantissa bits
    assert torch.equal(fp8lab.fake_quant(x, "e4m3", (1, 128)), d)


def test_nd_input_and_other_dtypes():
    x = torch.randn(2, 3, 64)
    q = fp8lab.quantize(x, "e4m3", "row")
    assert q.values.shape == (2, 3, 64) and q.scales.shape == (6, 1)
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        qd = fp8lab.quantize(x.to(dt), "e4m3", "row")
        assert torch.equal(qd.values, fp8lab.quantize(x.to(dt).float(), "e4m3", "row").values)
    assert fp8lab.quantize(torch.tensor(3.0), "e4m3").values.item() == 448.0


def test_codes_and_mx_scale_codes():
    x = torch.randn(4, 64)
    q = fp8lab.quantize(x, "e4m3", "mx", "mx_rceil")
    codes = q.codes()
    assert codes.dtype == torch.uint8
    assert torch.equal(fp8lab.decode(codes, "e4m3"), q.values)
    sc = q.scale_codes()
    assert torch.equal(torch.ldexp(torch.ones(()), sc.float() - 127), q.scales)
    with pytest.raises(ValueError, match="powers of two"):
        fp8lab.quantize(x, "e4m3", "row", "max").scale_codes()


def test_transpose():
    x = torch.randn(8, 256)
    q = fp8lab.quantize(x, "e4m3", (1, 128))
    t = q.t()
    assert t.shape == (256, 8) and t.spec.granularity == (128, 1)
    assert torch.equal(t.dequantize(), q.dequantize().t())
    with pytest.raises(ValueError, match="2-D"):
        fp8lab.quantize(torch.randn(2, 2, 2), "e4m3").t()


def test_spec_round_trip_and_defaults():
    for spec in (
        QuantSpec(),
        QuantSpec("e5m2", (1, 128), "pow2_down", margin=1, epsilon=1e-6),
        QuantSpec("e2m1", "nvfp4"),
        QuantSpec("e4m3", "mx", "mx_rceil", rounding="nearest_away", pad=False),
        QuantSpec("hif8", "tensor", 64.0),
    ):
        d = json.loads(json.dumps(spec.to_dict()))
        assert QuantSpec.from_dict(d) == spec
        assert all(isinstance(v, str | int | float | bool | list) for v in d.values())
    assert QuantSpec(granularity="mx").scaling == "mx_floor"
    assert QuantSpec("e2m1", "nvfp4").scaling == "nvfp4"
    assert QuantSpec(granularity=[128, 128]).granularity == (128, 128)
    assert QuantSpec("e4m3", scaling="amax").scaling == "max"
    # a spec and keyword overrides
    base = QuantSpec("e4m3", (1, 128))
    q = fp8lab.quantize(torch.randn(4, 128), base, scaling="pow2_down")
    assert q.spec == base.replace(scaling="pow2_down")


def test_bad_input():
    with pytest.raises(ValueError, match="unknown format"):
        QuantSpec("e9m9")
    with pytest.raises(ValueError, match="granularity"):
        QuantSpec(granularity="blocks")
    with pytest.raises(ValueError, match="unknown scaling rule"):
        QuantSpec(scaling="median")
    with pytest.raises(ValueError, match="positive finite"):
        QuantSpec(scaling=-2.0)
    with pytest.raises(TypeError):
        QuantSpec(scaling=True)
    with pytest.raises(ValueError, match="rounding"):
        QuantSpec(rounding="up")
    with pytest.raises(ValueError, match="unknown QuantSpec keys"):
        QuantSpec.from_dict({"format": "e4m3", "colour": "red"})
    with pytest.raises(TypeError, match="floating-point"):
        fp8lab.quantize(torch.arange(4), "e4m3")
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        fp8lab.quantize([1.0, 2.0], "e4m3")
    with pytest.raises(ValueError, match="block width"):
        fp8lab.quantize(torch.randn(2, 100), "e4m3", "mx", pad=False)


def test_empty_tensor():
    q = fp8lab.quantize(torch.empty(0, 8), "e4m3", "row")
    assert q.values.shape == (0, 8) and q.dequantize().shape == (0, 8)


# ------------------------------------------------------------------ fused scale rules, buffers
def amax_sweep() -> torch.Tensor:
    """Block amaxes over the whole float32 range: every binade, mantissas near the edges,
    subnormals, 0, FLT_MAX and inf."""
    e = torch.arange(-149, 128, dtype=torch.float64)
    mants = torch.tensor([1.0, 1.0 + 2.0**-23, 1.0625, 1.5, 1.75, 1.875, 1.9375, 2.0 - 2.0**-23])
    vals = (2.0 ** e[:, None] * mants[None, :]).reshape(-1)
    vals = vals[vals <= float(np.finfo(F32).max)].to(torch.float32)
    extra = torch.tensor([0.0, math.inf, 448.0, 57344.0, 6.0, 2.0**-127, 1e-45])
    return torch.cat([vals, extra])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e3m2", "e4m3fnuz"])
def test_fused_scale_rules_equal_the_rule_functions(fmt):
    from fp8lab.scaling import rules

    amax = amax_sweep()
    # one (1, 32) block per amax: the amax in column 0, zeros elsewhere
    x = torch.zeros(amax.numel(), 32)
    x[:, 0] = amax
    for rule in ("mx_floor", "mx_ceil", "mx_even", "mx_rceil"):
        q = fp8lab.quantize(x, fmt, "mx", rule)
        code = rules.mx_exponent(amax, fmt, rule.removeprefix("mx_"))
        assert same_bits(q.scale_multipliers.reshape(-1), rules.e8m0_to_scale(code)), rule
        assert same_bits(q.scales.reshape(-1), rules.e8m0_to_scale_inv(code)), rule
    for kw in ({}, {"margin": 2}, {"epsilon": 1e-3}, {"margin": -1, "epsilon": 2.0**-140}):
        q = fp8lab.quantize(x, fmt, (1, 32), "max", **kw)
        want = rules.max_scale(amax, fmt, **kw)
        assert same_bits(q.scale_multipliers.reshape(-1), want), kw
        assert same_bits(q.scales.reshape(-1), torch.reciprocal(want)), kw
    # bf16 input: an infinite scale becomes BF16 max in block kernels (TE)
    q = fp8lab.quantize(x.bfloat16(), fmt, (1, 32), "max")
    want = rules.max_scale(amax.bfloat16().float(), fmt, value_for_inf=3.3895313892515355e38)
    assert same_bits(q.scale_multipliers.reshape(-1), want)


BUFFER_CASES = [
    *CASES,
    ((128, 1), "max"),
    ("mx_col", "mx_rceil"),
    ((32, 1), "pow2_up"),
    ((3, 5), "max"),
    ("tensor", "pow2_down"),
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "hif8", "bf16"])
def test_out_buffers_equal_the_allocating_path(fmt):
    x = nasty((140, 290), seed=7)
    for g, sc in BUFFER_CASES:
        ref = fp8lab.quantize(x, fmt, g, sc)
        out = torch.full_like(x, 123.0)
        deq = torch.full_like(x, -7.0)
        q = fp8lab.quantize(x, fmt, g, sc, out=out, dequantized_out=deq)
        assert q.values.data_ptr() == out.data_ptr(), (g, sc)
        assert same_bits(q.values, ref.values), (g, sc)
        assert same_bits(deq, ref.dequantize()), (g, sc)
        assert same_bits(q.scales, ref.scales) and same_bits(q.dequantize(), deq), (g, sc)
        # values buffer only, and quantizing in place
        q = fp8lab.quantize(x, fmt, g, sc, out=torch.empty_like(x))
        assert same_bits(q.values, ref.values), (g, sc)
        y = x.clone()
        q = fp8lab.quantize(y, fmt, g, sc, out=y)
        assert same_bits(y, ref.values), (g, sc)


def test_out_buffers_other_shapes_and_dtypes():
    x = torch.randn(4, 6, 64, dtype=torch.bfloat16)
    ref = fp8lab.quantize(x, "e4m3", (1, 32))
    out, deq = torch.empty(4, 6, 64), torch.empty(4, 6, 64)
    q = fp8lab.quantize(x, "e4m3", (1, 32), out=out, dequantized_out=deq)
    assert q.values.shape == (4, 6, 64)
    assert torch.equal(out, ref.values) and torch.equal(deq, ref.dequantize())
    e = torch.empty(0, 8)
    q = fp8lab.quantize(e, "e4m3", "row", out=torch.empty(0, 8), dequantized_out=torch.empty(0, 8))
    assert q.values.shape == (0, 8)


def test_out_buffers_bad_input():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="out has shape"):
        fp8lab.quantize(x, "e4m3", out=torch.empty(8, 63))
    with pytest.raises(ValueError, match="dequantized_out must be a contiguous float32"):
        fp8lab.quantize(x, "e4m3", dequantized_out=torch.empty(8, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        fp8lab.quantize(x, "e4m3", out=torch.empty(64, 8).t())
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor"):
        fp8lab.quantize(x, "e4m3", out=np.empty((8, 64), F32))
    buf = torch.empty(2, 8, 64)
    with pytest.raises(ValueError, match="must not overlap"):
        fp8lab.quantize(x, "e4m3", out=buf[0], dequantized_out=buf[0])
    with pytest.raises(ValueError, match="must not require grad"):
        fp8lab.quantize(x, "e4m3", out=torch.empty(8, 64, requires_grad=True))


def test_retile_options_keep_values_and_count():
    from fp8lab.qtensor import retile_counts

    x = nasty((256, 384), seed=9)
    for g, sc in (((1, 128), "max"), ("mx", "mx_rceil"), ((1, 128), "pow2_down")):
        q = fp8lab.quantize(x, "e4m3", g, sc)
        ref = fp8lab.retile(q)
        # the added error as the reference formula computes it (NaN ignored, inf -> FLT_MAX)
        want = float(torch.nan_to_num((ref.dequantize() - q.dequantize()).abs(), nan=0.0).max())
        assert ref.meta["retile_added_error"] == want
        before = retile_counts()["from_quantized"]
        out, deq = torch.empty_like(x), torch.empty_like(x)
        r = fp8lab.retile(
            q, measure_error=False, dequantized=q.dequantize(), out=out, dequantized_out=deq
        )
        assert retile_counts()["from_quantized"] == before + 1
        assert r.meta["retile_added_error"] is None and r.retiled == 1
        assert r.values.data_ptr() == out.data_ptr()
        assert same_bits(r.values, ref.values) and same_bits(r.scales, ref.scales)
        assert same_bits(deq, ref.dequantize())
        r = fp8lab.retile(q, dequantized_out=deq)  # measured from the buffer
        assert r.meta["retile_added_error"] == want
    with pytest.raises(ValueError, match="dequantized must be float32"):
        fp8lab.retile(q, dequantized=torch.zeros(3, 3))
