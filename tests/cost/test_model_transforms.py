"""The cost of NVFP4's extra per-element work: TE's random Hadamard transform (nvfp4-te) and
4over6 (nvfp4-4over6), against sums derived by hand from the algorithms' definitions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fp8lab.cost.devices import get_device
from fp8lab.cost.model import price_linears

CAL = {
    "b200": {
        "efficiency": {"bf16": 0.5, "fp8": 0.5, "mxfp8": 0.4, "nvfp4": 0.4},
        "bandwidth_efficiency": 0.5,
    }
}
#: T a multiple of 64 and every dimension of 128: TE fuses the RHT into the cast kernel
ALIGNED = ([("a", 256, 640), ("b", 384, 128)], 512)


def _dev():
    return get_device("b200", calibration=CAL)


def _t(i, o, t):
    return t * i, o * i, t * o  # elements of x, W, dy


@pytest.mark.slow  # counting nvfp4-te's RHT step takes ~2 s
def test_rht_flops_are_counted_and_hidden_when_fused():
    dev = _dev()
    lins, t = ALIGNED
    te = price_linears("nvfp4-te", dev, lins, t)
    plain = price_linears("nvfp4", dev, lins, t)
    # 16-point Hadamard as a matrix product: 32 FLOPs per element, twice per transformed tensor
    # (TE's amax kernel takes RHT(x^T)'s amax, the fused cast writes RHT(x^T) quantized), on
    # x and dy (the wgrad operands) of every Linear
    want = sum(2 * 32 * (x + dy) for x, _, dy in (_t(i, o, t) for _, i, o in lins))
    assert sum(k.flops for k in te.kernels) == want
    assert sum(k.flops for k in plain.kernels) == 0
    # at 16 FLOP per byte read the transform hides under the memory time: same bytes, same ms
    assert te.bytes == plain.bytes
    assert te.layer_ms == pytest.approx(plain.layer_ms, rel=1e-12)


@pytest.mark.slow  # counting nvfp4-te's RHT step takes ~2 s
def test_unfused_rht_costs_the_derived_extra_kernel():
    # T = 1000 is not a multiple of 64: TE writes RHT(x^T) in bf16 (read 2 B + write 2 B per
    # element) and quantizes that copy with its own kernel (another 2 B read per element)
    dev = _dev()
    lins, t = [("a", 256, 640)], 1000
    te = price_linears("nvfp4-te", dev, lins, t)
    plain = price_linears("nvfp4", dev, lins, t)
    x, _, dy = _t(256, 640, t)
    extra_bytes = 6 * (x + dy)
    assert te.bytes - plain.bytes == extra_bytes
    bw = dev.bandwidth_tbs * 1e12 * 0.5
    assert te.quantize_ms - plain.quantize_ms == pytest.approx(extra_bytes / bw * 1e3, rel=1e-9)
    assert [k.kind for k in te.kernels].count("rht") == 2
    assert te.gemm_ms == plain.gemm_ms


def test_four_over_six_ops_and_a_compute_bound_device():
    lins, t = ALIGNED
    fos = price_linears("nvfp4-4over6", _dev(), lins, t)
    # 10 FP32 operations per element of every NVFP4 cast and second tiling from bf16:
    # x (cast + column copy), W (cast; its dgrad copy is a transpose), dy (cast + column copy)
    want = sum(10 * (2 * x + w + 2 * dy) for x, w, dy in (_t(i, o, t) for _, i, o in lins))
    assert sum(k.simt_ops for k in fos.kernels) == want
    plain = price_linears("nvfp4", _dev(), lins, t)
    assert fos.layer_ms == pytest.approx(plain.layer_ms, rel=1e-12)  # memory-bound on B200
    # a device whose CUDA cores are 1 GFLOP/s: every cast kernel is compute-bound, so the
    # quantization time is the 4over6 operations at that rate plus the amax kernels' memory time
    slow = replace(_dev(), peak_tflops={**_dev().peak_tflops, "fp32": 1e-3})
    c = price_linears("nvfp4-4over6", slow, lins, t)
    amax = sum(k.ms for k in c.kernels if k.kind == "amax")
    assert c.quantize_ms - amax == pytest.approx(want / 1e9 * 1e3, rel=1e-9)


def test_recipes_without_extra_work_stay_memory_priced():
    dev = _dev()
    lins, t = ALIGNED
    bw = dev.bandwidth_tbs * 1e12 * 0.5
    for r in ("nvfp4",):
        c = price_linears(r, dev, lins, t)
        assert all(k.flops == 0 and k.simt_ops == 0 for k in c.kernels)
        assert c.quantize_ms == pytest.approx(sum(k.bytes for k in c.kernels) / bw * 1e3)
