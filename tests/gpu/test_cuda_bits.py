"""CUDA against the CPU, bit for bit: `fp8lab.cast` (every format, rounding, saturation and input
dtype), encode/decode, `fp8lab.quantize` (every scale rule and block shape of the recipes) and
`fp8lab.qmatmul` (every accumulator; fp32 within its K-derived bound) on the cases of
scripts/gpu_check.py at its smoke sizes; fp8lab's h100 model against the GPU's own FP8 GEMM; and
the one-command check itself. Every test here needs CUDA and is skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fp8lab
import gpu_check_module
from gpu_check_module import SCRIPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


gc = gpu_check_module.load()
CUDA = torch.device("cuda")


def _wrong(r: dict) -> bool:
    # a NaN's sign/payload is the device's (CUDA canonicalises NaN); every other bit must match
    beyond_nan = r.get("mismatches", 0) - r.get("nan_bits_only", 0)
    return "error" in r or beyond_nan > 0 or r.get("bound_violations", 0) > 0


def _check(cases) -> None:
    """Every case equal (or within its bound), none failing on one side only."""
    records = [gc.run_case(case, CUDA) for case in cases]
    bad = [r for r in records if _wrong(r)]
    assert records and not bad, bad[:5]


@pytest.mark.parametrize("fmt", fp8lab.format_names())
def test_cast_bits_equal_cpu(fmt):
    _check(c for c in gc.cast_cases(gc.SMOKE) if c.name.split()[1] == fmt)


@pytest.mark.parametrize("spec", gc.quant_specs(), ids=str)
def test_quantize_bits_equal_cpu(spec):
    _check(c for c in gc.quantize_cases(gc.SMOKE) if c.name.split()[1] == str(spec))


def test_qmatmul_bits_equal_cpu():
    _check(gc.qmatmul_cases(gc.SMOKE))


def test_stochastic_rounding_takes_the_cpu_generator_draws():
    """The same CPU generator seed gives the same stochastic roundings on both devices."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    cpu = fp8lab.cast(x, "e4m3", "stochastic", generator=torch.Generator().manual_seed(5))
    cuda = fp8lab.cast(x.cuda(), "e4m3", "stochastic", generator=torch.Generator().manual_seed(5))
    assert torch.equal(gc._bits(cpu), gc._bits(cuda))
    other = fp8lab.cast(x.cuda(), "e4m3", "stochastic", generator=torch.Generator().manual_seed(6))
    assert not torch.equal(gc._bits(cpu), gc._bits(other))  # the draws do depend on the seed


def test_numba_kernels_refuse_a_cuda_tensor():
    with fp8lab.using_kernels("numba"), pytest.raises(ValueError, match=r"cuda.*numba"):
        fp8lab.cast(torch.ones(4, device="cuda"), "e4m3")


def test_cpu_and_cuda_operands_are_refused():
    q = fp8lab.quantize(torch.randn(32, 64), "e4m3")
    with pytest.raises(ValueError, match="device"):
        fp8lab.qmatmul(q, gc.to_device(fp8lab.quantize(torch.randn(64, 32), "e4m3"), CUDA), "h100")


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="needs FP8 tensor cores (compute capability >= 8.9)",
)
@pytest.mark.parametrize("fb", ["e4m3", "e5m2"])
@pytest.mark.parametrize("unit", [True, False], ids=["unit-scales", "current-scales"])
def test_h100_model_equals_scaled_mm_fast_accum(fb, unit):
    """fp8lab's h100 fused model, never promoted, is torch._scaled_mm(use_fast_accum=True)
    bit for bit (K = 32 .. 1024)."""
    for k in (32, 64, 256, 1024):
        rec = gc.scaled_mm_case("e4m3", fb, k, unit, 64, CUDA)
        assert rec["fast_accum_mismatches"] == 0, rec


def test_gpu_check_smoke_on_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--device", "cuda", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"]["name"] and report["torch"]["cuda"]
    bits = report["bit_identity"]["summary"]
    assert bits["exact_mismatches"] == bits["nan_bits_only"]
    assert report["distributed"]["backend"] == "nccl"
    assert "fast_accum_mismatches" in report["scaled_mm"] or "skipped" in report["scaled_mm"]
    assert "skipped" not in report["step_time"]["cases"]["native-fp32"]
