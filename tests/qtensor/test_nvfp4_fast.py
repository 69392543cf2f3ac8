"""The fused NVFP4 path of the numba kernels against the device-generic torch path, bit for bit:
the scale rule in one pass over the block amaxes (`fp8lab.scaling.rule_kernels.
nvfp4_rule_scales`), the cast with stochastic rounding and the two-level dequantized copy in one
pass over the input (`fp8lab.qtensor.kernels._walk_ext`), and the block Hadamard transforms
(`fp8lab.qtensor.transforms`), on inputs dense in edges: blocks of every scale, subnormal and
zero blocks, exact E2M1 ties, NaN elements."""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab.kernels import kernel_counts, using_kernels
from fp8lab.qtensor import transforms
from fp8lab.qtensor.spec import QuantSpec

# each test runs the numba kernels beside the torch kernels itself (`using_kernels`)
pytestmark = pytest.mark.numba_only

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # the midpoints of E2M1's grid


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.nan_to_num(a.float(), nan=7.77)
    b = torch.nan_to_num(b.float(), nan=7.77)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def edge_blocks(rows: int = 48, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Each 16-row band and each 16-column band at its own scale (2**-140 .. 2**100), so that
    1x16, 16x1 and 16x16 blocks all span the range; zero blocks, subnormal blocks, a block of
    exact ties (amax 6 * 2**e: the block multiplier is an exact power of two), a lone huge
    block, scattered NaN and -0."""
    g = torch.Generator().manual_seed(seed)
    e_r = torch.randint(-140, 100, (rows,), generator=g).float()
    e_c = torch.randint(-20, 20, (cols,), generator=g).float()
    x = torch.randn(rows, cols, generator=g) * torch.exp2((e_r[:, None] + e_c[None, :]) / 2)
    x[0, 0:16] = 0.0  # a zero 1x16 block
    x[16:32, 16:32] = 0.0  # a zero 16x16 tile
    x[1, 0:32] = torch.randint(1, 1 << 23, (32,), generator=g, dtype=torch.int32).view(
        torch.float32
    )  # float32 subnormals
    sign = torch.where(torch.rand(16, generator=g) < 0.5, -1.0, 1.0)
    tie = torch.tensor(TIES * 3)[:15]
    x[2, 16:32] = torch.cat([tie, torch.tensor([6.0])]) * 2.0**-3 * sign
    x[3:19, 48] = torch.cat([tie, torch.tensor([6.0])]) * 2.0**5  # ties down a column
    x[4, 32:48] = 3.0e38  # amaxes near FLT_MAX
    x[5, 3] = math.nan
    x[7, 40] = -0.0
    return x


def run(x: torch.Tensor, spec: QuantSpec, seed: int, deq: bool):
    out = torch.empty_like(x) if deq else None
    dq = torch.empty_like(x) if deq else None
    q = fp8lab.quantize(x, spec, generator=torch.Generator().manual_seed(seed), out=out,
                        dequantized_out=dq)  # fmt: skip
    return q.values, q.scales, q.global_scale, q.dequantize()


SPECS = [
    {"granularity": "nvfp4"},
    {"granularity": "nvfp4_col"},
    {"granularity": (16, 16)},
    {"granularity": "nvfp4", "row_scaled": True},
    {"granularity": "nvfp4_col", "row_scaled": True},
    {"granularity": "nvfp4", "tensor_scale": 1e-3},
    {"granularity": (16, 16), "tensor_scale": 3e-39},
    {"granularity": "nvfp4", "four_over_six": "mae"},
    {"granularity": "nvfp4_col", "four_over_six": "mse", "four_over_six_use_256": True},
    {"granularity": (16, 16), "four_over_six": "mse"},
    {"granularity": "nvfp4", "four_over_six": "mae", "row_scaled": True},
    {"granularity": "nvfp4_col", "four_over_six": "mse", "row_scaled": True},
]


@pytest.mark.parametrize("rounding", ["nearest_even", "stochastic"])
@pytest.mark.parametrize("kw", SPECS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_fused_nvfp4_equals_torch_path(kw, rounding):
    x = edge_blocks()
    spec = QuantSpec(format="e2m1", scaling="nvfp4", rounding=rounding, **kw)
    for deq in (False, True):
        with using_kernels("numba"):
            kernel_counts(reset=True)
            a = run(x, spec, 3, deq)
            assert kernel_counts()["torch"] == 0
        with using_kernels("torch"):
            b = run(x, spec, 3, deq)
        for u, v in zip(a, b, strict=True):
            assert same_bits(u, v), (kw, rounding, deq)


def test_stochastic_rounding_uses_each_element_counter():
    # a different seed moves some elements of the ties block (both kernels agree per seed, above);
    # the same seed repeats exactly
    x = edge_blocks()
    spec = QuantSpec(format="e2m1", granularity="nvfp4", scaling="nvfp4", rounding="stochastic")
    a, b, c = (run(x, spec, s, True)[0] for s in (3, 3, 4))
    assert same_bits(a, b)
    assert not same_bits(a, c)


@pytest.mark.parametrize("n, signed", [(16, True), (32, False), (4, False)])
def test_block_transform_equals_torch_path(n, signed):
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31, (40, 128), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).clone()  # every binade, NaN and inf included
    x[0] = torch.randn(128, generator=g) * 1e-40  # BF16 subnormals
    x[1] = torch.randn(128, generator=g)  # partial sums that round
    x[2, :] = 3.0e38  # sums that overflow BF16
    with using_kernels("numba"):
        a = transforms._apply(x, n, signed, "t")
    with using_kernels("torch"):
        b = transforms._apply(x, n, signed, "t")
    assert a.dtype == b.dtype == torch.bfloat16
    assert same_bits(a, b)


@pytest.mark.parametrize("gran", ["nvfp4", "nvfp4_col", (16, 16)])
def test_four_over_six_ragged_edges_and_infinite_amax(gran):
    # zero-padded ragged blocks, and an infinite element: the second-level amax is inf, so a
    # padded zero's error is 0 * inf = NaN in the torch version, and must be in the kernel too
    x = edge_blocks(64, 96)[:50, :70].contiguous()
    x[9, 9] = math.inf
    spec = QuantSpec(format="e2m1", granularity=gran, scaling="nvfp4", four_over_six="mae",
                     pad=True)  # fmt: skip
    with using_kernels("numba"):
        a = run(x, spec, 1, True)
    with using_kernels("torch"):
        b = run(x, spec, 1, True)
    for u, v in zip(a, b, strict=True):
        assert same_bits(u, v)
