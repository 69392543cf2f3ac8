"""qmatmul(bias=, c=): the serial epilogue is bit for bit torch's ``mul_`` then ``add_``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8lab import Accumulator, qmatmul, quantize
from fp8lab.gemm.matmul import epilogue


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))


def test_epilogue_equals_torch_mul_then_add():
    g = _gen(6)
    out = torch.randn(37, 53, generator=g) * torch.exp(torch.randn(37, 53, generator=g) * 20)
    out[0, :4] = torch.tensor([float("inf"), float("nan"), 1e-40, -0.0])
    bias = torch.randn(53, generator=g)
    bias[5] = float("-inf")
    for scale in (np.float32(3.0517578e-05), np.float32(7.1), None):
        for b in (bias, None):
            want = out.clone()
            if scale is not None:
                want.mul_(torch.tensor(scale))
            if b is not None:
                want.add_(b)
            got = out.clone()
            epilogue(got, scale, b)
            assert _bits_equal(got, want), (scale, b is None)
            got_t = out.t().clone().t()  # non-contiguous: torch fallback
            epilogue(got_t, scale, b)
            assert _bits_equal(got_t, want)


def _operands(gran_a, gran_b, k=384):
    g = _gen(3)
    a = torch.randn(29, k, generator=g) * torch.exp(torch.randn(29, k, generator=g))
    b = torch.randn(k, 41, generator=g)
    return quantize(a, "e4m3", gran_a), quantize(b, "e4m3", gran_b)


@pytest.mark.parametrize(
    ("gran_a", "gran_b", "acc"),
    [
        ("tensor", "tensor", "fp32"),
        ("row", "col", "fp32"),
        ((1, 128), (128, 128), "fp32"),
        ("tensor", "tensor", Accumulator("limited")),
        ((1, 128), (128, 128), Accumulator("limited", promote_every=128)),
    ],
)
def test_bias_is_mul_then_add(gran_a, gran_b, acc):
    qa, qb = _operands(gran_a, gran_b)
    bias = torch.randn(41, generator=_gen(4)) * 100
    bias[3] = -0.0
    plain = qmatmul(qa, qb, acc)
    got = qmatmul(qa, qb, acc, bias=bias)
    assert _bits_equal(got, plain.clone().add_(bias))
    if gran_a == "tensor" and acc == "fp32":  # the scale is applied in the same pass
        want = torch.mm(qa.values, qb.values).mul_(qa.scales.reshape(()) * qb.scales.reshape(()))
        assert _bits_equal(got, want.add_(bias))
    # bias before the output rounding (the epilogue adds in FP32, then converts)
    assert torch.equal(
        qmatmul(qa, qb, acc, "bf16", bias=bias), got.to(torch.bfloat16).to(torch.float32)
    )


def test_c_fp32_and_promoted_limited():
    qa, qb = _operands((1, 128), (128, 128))
    c = torch.randn(29, 41, generator=_gen(5)) * 1e3
    assert _bits_equal(qmatmul(qa, qb, "fp32", c=c), qmatmul(qa, qb, "fp32").add_(c))
    # promoted: c starts the FP32 sum, so the result differs from adding c at the end only by
    # FP32 association: within a few ulps of the larger operands
    acc = Accumulator("limited", promote_every=128)
    got = qmatmul(qa, qb, acc, c=c)
    loose = qmatmul(qa, qb, acc) + c
    assert torch.allclose(got, loose, rtol=1e-5, atol=1e-3)
    assert not torch.equal(got, qmatmul(qa, qb, acc))


def test_bad_bias_and_c():
    qa, qb = _operands("tensor", "tensor")
    with pytest.raises(ValueError, match="bias must have shape"):
        qmatmul(qa, qb, bias=torch.zeros(40))
    with pytest.raises(ValueError, match="c must have shape"):
        qmatmul(qa, qb, c=torch.zeros(41, 29))
    # never promoted: c enters the MMA chain, whose operands are unscaled
    with pytest.raises(ValueError, match="scales must be 1"):
        qmatmul(qa, qb, "limited", c=torch.zeros(29, 41))
