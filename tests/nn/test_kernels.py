"""The bf16 rounding kernel of the high-precision override equals torch and fp8lab.cast."""

import pytest
import torch

import fp8lab
from fp8lab.kernels import using_kernels
from fp8lab.nn._kernels import round_bf16
from fp8lab.nn.functional import round_high_precision


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g) * 10.0 ** torch.randint(-40, 39, (1 << 16,), generator=g)
    bits = torch.randint(0, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64)
    raw = bits.to(torch.int32).view(torch.float32)  # every exponent incl. subnormals, inf, NaN
    edges = torch.tensor(
        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895e38, 3.4e38, float("inf"), float("-inf")]
    )
    return torch.cat([x, raw, -raw, edges])


KERNELS = [pytest.param("numba", marks=pytest.mark.numba_only), "torch"]


@pytest.mark.parametrize("kernels", KERNELS)
def test_round_bf16_equals_torch_conversion_and_cast(kernels):
    x = _inputs()
    with using_kernels(kernels):
        got = round_bf16(x)
    ref = x.to(torch.bfloat16).to(torch.float32)
    fin = torch.isfinite(ref) | torch.isinf(ref)
    assert torch.equal(got[fin], ref[fin])
    assert torch.equal(torch.isnan(got), torch.isnan(x))
    ref2 = fp8lab.cast(x, "bf16", saturate=False)
    assert torch.equal(got[fin], ref2[fin])
    assert torch.equal(round_high_precision(x, "bf16")[fin], ref[fin])


@pytest.mark.parametrize("kernels", KERNELS)
def test_round_bf16_in_place_and_bad_input(kernels):
    x = torch.randn(7, 5)
    ref = x.to(torch.bfloat16).float()
    with using_kernels(kernels):
        assert round_bf16(x, out=x) is x and torch.equal(x, ref)
    with pytest.raises(TypeError):
        round_bf16(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        round_bf16(torch.ones(3), out=torch.empty(4))
