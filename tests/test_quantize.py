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
