"""Empty tensors through every kernel: cast/encode/decode, quantize under every granularity and
scale rule, retile, qmatmul under every accumulator (M, K or N zero, with and without promotion
and c), fused_dot. K = 0 is a sum of nothing: 0, or c where c is given."""

from __future__ import annotations

import pytest
import torch

from fp8lab import Accumulator, QuantSpec, cast, qmatmul, quantize, retile
from fp8lab.formats import decode, encode
from fp8lab.gemm import fused_dot
from fp8lab.nn._kernels import round_bf16
from fp8lab.scaling.rules import SCALE_RULES

SHAPES = [(0, 256), (64, 0), (0, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cast_empty(shape, rounding, dtype):
    x = torch.empty(shape, dtype=dtype)
    y = cast(x, "e4m3", rounding=rounding, generator=torch.Generator().manual_seed(0))
    assert y.shape == shape and y.dtype == torch.float32
    assert encode(x.float(), "e4m3").shape == shape
    assert decode(torch.empty(shape, dtype=torch.uint8), "e5m2").shape == shape
    assert round_bf16(torch.empty(shape)).shape == shape


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "gran", ["tensor", "row", "col", "mx", "mx_col", (1, 128), (128, 128), (128, 1)]
)
@pytest.mark.parametrize("rule", [r for r in SCALE_RULES if not r.startswith("mx")] + ["mx_floor"])
def test_quantize_empty(shape, gran, rule):
    fmt = "e4m3"
    if rule.startswith("mx") and gran not in ("mx", "mx_col"):
        pytest.skip("mx rules take mx blocks")
    x = torch.empty(shape)
    q = quantize(x, QuantSpec(fmt, gran, rule))
    assert q.shape == shape
    assert q.dequantize().shape == shape
    assert q.values.shape == shape


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_and_retile_empty(shape):
    q = quantize(torch.empty(shape), QuantSpec("e2m1", "nvfp4", "nvfp4"))
    assert q.dequantize().shape == shape
    q = quantize(torch.empty(shape), QuantSpec("e4m3", (1, 128), "max"))
    r = retile(q, (128, 1))
    assert r.shape == shape and r.dequantize().shape == shape


ACCS = [
    "fp32",
    Accumulator("limited"),
    Accumulator("limited", promote_every=128),
    Accumulator("limited", per_product=True),
    Accumulator("limited", promote_every=128, per_product=True),
    "h100",
    Accumulator("h100", promote_every=128),
    "b200",
]


@pytest.mark.parametrize("mkn", [(0, 256, 64), (64, 0, 32), (64, 256, 0), (0, 0, 0)])
@pytest.mark.parametrize("acc", ACCS, ids=str)
@pytest.mark.parametrize("block", [False, True])
def test_qmatmul_empty(mkn, acc, block):
    m, k, n = mkn
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    if block:
        if getattr(acc, "promote_every", 1) is None or acc in ("h100", "b200"):
            pytest.skip("1x128 x 128x128 scales need promotion (or fp32)")
        sa, sb = QuantSpec("e4m3", (1, 128), "max"), QuantSpec("e4m3", (128, 128), "max")
    else:
        sa = sb = QuantSpec("e4m3", "tensor", "max")
    y = qmatmul(a, b, acc, spec=sa, spec_b=sb)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert not y.any()  # K = 0: an empty sum is +0
    if block:
        return
    c = torch.randn(m, n, generator=g)
    qa, qb = (
        quantize(a, QuantSpec("e4m3", "tensor", 1.0)),
        quantize(b, QuantSpec("e4m3", "tensor", 1.0)),
    )
    y = qmatmul(qa, qb, acc, c=c)
    assert y.shape == (m, n)
    if k == 0:
        assert torch.equal(y, c)  # no MMA step: c comes out as it went in


@pytest.mark.parametrize("sk", [(0, 64), (8, 0), (0, 0)])
def test_fused_dot_empty(sk):
    v = torch.zeros(sk)
    y = fused_dot(v, v, "h100")
    assert y.shape == (sk[0],) and not y.any()
