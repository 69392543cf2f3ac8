"""CUDA against the CPU, bit for bit: `fp8lab.cast` (every format, rounding, saturation and input
dtype), encode/decode, `fp8lab.quantize` (every scale rule and block shape of the recipes) and
`fp8lab.qmatmul` (every accumulator; fp32 within its K-derived bound) on the cases of
scripts/gpu_check.py at its smoke sizes; fp8lab's h100 model against the GPU's own FP8 GEMM; and
the one-command check itself. Every test here needs CUDA and is skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

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


@pytest.mark.parametrize(
    ("fmt", "rounding"),
    [("e4m3", "nearest_even"), ("e5m2", "toward_zero"), ("e4m3", "stochastic"), ("hif8", "hybrid")],
)
def test_compiled_cast_on_cuda_is_used_and_gives_the_cpu_bits(fmt, rounding):
    """At gpu_check's full size (more than COMPILE_MIN elements) the float32 cast runs the
    torch.compile'd (Triton) kernel: it must pass its probe on CUDA (no RuntimeWarning, the
    verified flag set) and give numba's bits. The smoke-sized cases above stay below
    COMPILE_MIN, so this is the only test of the Triton kernel."""
    from fp8lab.formats import rounding_torch

    x = gc.cast_inputs(fmt, gc.FULL)
    assert x.numel() >= rounding_torch.COMPILE_MIN
    cpu = fp8lab.cast(x, fmt, rounding, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed probe warns: fail here
        cuda = fp8lab.cast(x.cuda(), fmt, rounding, generator=torch.Generator().manual_seed(3))
    mode = fp8lab.ROUNDING_MODES.index(rounding)
    family = 0 if mode <= 2 else mode
    assert rounding_torch._compiled.get(("verified", "cuda", family)) is True
    rec = gc.bit_mismatches(cpu, cuda)
    assert rec["mismatches"] == rec.get("nan_bits_only", 0), rec


@pytest.mark.parametrize(
    "spec",
    [
        fp8lab.QuantSpec("e4m3", "tensor", "max"),
        fp8lab.QuantSpec("e4m3", (1, 128), "max"),
        fp8lab.QuantSpec("e4m3", (128, 128), "max"),
        fp8lab.QuantSpec("e4m3", "mx", "mx_rceil"),
    ],
    ids=str,
)
def test_compiled_quantize_on_cuda_is_used_and_gives_the_cpu_bits(spec):
    """quantize of a 512 x 768 tensor (above COMPILE_MIN: the compiled scaled cast) on CUDA: no
    failed probe, numba's bits in values and scales."""
    x = gc.quant_inputs((512, 768), "edge", seed=4)
    cpu = fp8lab.quantize(x, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cuda = fp8lab.quantize(x.cuda(), spec)
    rec = gc.bit_mismatches(cpu, cuda)
    assert rec["mismatches"] == rec.get("nan_bits_only", 0), rec


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
