"""NVFP4 two-level scales (`rules.nvfp4_scales`, `QuantSpec(tensor_scale=)`) against an
independent re-statement of TE's NVFP4 arithmetic with torch's float8 casts and ml_dtypes' FP4."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.scaling import rules

FLT_MAX = torch.finfo(torch.float32).max
TORCH_FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.nan_to_num(a.float(), nan=7.77)
    b = torch.nan_to_num(b.float(), nan=7.77)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def te_scales(block_amax, tensor_amax=None, scale_format="e4m3", s_dec=None):
    """TE's kernel arithmetic (core_nvfp4.cuh) in torch float32 ops, the block scales cast with
    torch's own float8 conversion (RNE) after TE's clamp; ``s_dec`` given = a static scale."""
    f32 = torch.float32
    dtype, smax = TORCH_FP8[scale_format]
    if s_dec is None:
        s_enc = torch.tensor(smax * 6.0, dtype=f32) / tensor_amax
        s_enc = torch.minimum(s_enc, torch.tensor(FLT_MAX))
        if float(tensor_amax) == 0.0 or float(s_enc) == 0.0:
            s_enc = torch.tensor(1.0)
        s_dec = torch.tensor(1.0, dtype=f32) / s_enc
    else:
        s_dec = torch.tensor(s_dec, dtype=f32)
        s_enc = torch.tensor(1.0, dtype=f32) / s_dec
    fp4_max_inv = torch.tensor(1.0, dtype=f32) / torch.tensor(6.0, dtype=f32)
    s_blk = (block_amax * (s_enc * fp4_max_inv)).clamp(-smax, smax).to(dtype).to(f32)
    enc = torch.minimum(torch.tensor(1.0, dtype=f32) / (s_blk * s_dec), torch.tensor(FLT_MAX))
    return s_blk, s_dec, enc


def to_e2m1(v: torch.Tensor) -> torch.Tensor:
    clipped = v.clamp(-6.0, 6.0).numpy()
    return torch.from_numpy(clipped.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def data(seed=0, rows=8, cols=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g) * 3)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 16:32] = 1e-30  # a block far below the tensor amax
    return x


@pytest.mark.parametrize("scale_format", ["e4m3", "e5m2"])
def test_nvfp4_scales_follow_te_and_honour_scale_format(scale_format):
    # issue 11 item 5: the block scales used to be cast to E4M3 whatever scale_format said
    x = data()
    blk = x.abs().reshape(8, 4, 16).amax(-1)
    tamax = x.abs().amax()
    s_blk, s_dec, enc = rules.nvfp4_scales(blk, tamax, "e2m1", scale_format=scale_format)
    w_blk, w_dec, w_enc = te_scales(blk, tamax, scale_format)
    assert same_bits(s_blk, w_blk) and same_bits(s_dec, w_dec) and same_bits(enc, w_enc)
    q = fp8lab.quantize(x, fp8lab.QuantSpec("e2m1", "nvfp4", scale_format=scale_format))
    assert same_bits(q.scales, w_blk) and same_bits(q.global_scale, w_dec)
    want = to_e2m1(x * w_enc.repeat_interleave(16, dim=1))
    assert same_bits(q.values, want)


def test_e5m2_block_scales_differ_from_e4m3_ones():
    x = data(seed=3)
    q4 = fp8lab.quantize(x, fp8lab.QuantSpec("e2m1", "nvfp4", scale_format="e4m3"))
    q5 = fp8lab.quantize(x, fp8lab.QuantSpec("e2m1", "nvfp4", scale_format="e5m2"))
    assert not torch.equal(q4.scales, q5.scales)
    # every e5m2 block scale is on the e5m2 grid
    assert torch.equal(q5.scales, q5.scales.to(torch.float8_e5m2).float())


@pytest.mark.parametrize("factor", [1.0, 0.25, 4.0])
def test_static_tensor_scale(factor):
    # issue 11 item 6: a user-chosen per-tensor scale (torchao's per_tensor_scale)
    x = data(seed=1)
    amax = x.abs().amax()
    ts = float(amax / torch.tensor(448.0 * 6.0)) * factor  # torchao per_tensor_amax_to_scale
    spec = fp8lab.QuantSpec("e2m1", "nvfp4", tensor_scale=ts)
    q = fp8lab.quantize(x, spec)
    blk = x.abs().reshape(8, 4, 16).amax(-1)
    w_blk, w_dec, w_enc = te_scales(blk, s_dec=ts)
    assert same_bits(q.scales, w_blk) and same_bits(q.global_scale, w_dec)
    assert same_bits(q.values, to_e2m1(x * w_enc.repeat_interleave(16, dim=1)))
    # the scale is static: another tensor's amax does not move it
    q2 = fp8lab.quantize(x * 1000, spec)
    assert float(q2.global_scale) == float(np.float32(ts))
    if factor < 1.0:  # a scale too small: the largest blocks saturate their E4M3 scale
        assert float(q.scales.max()) == 448.0
    spec2 = fp8lab.QuantSpec.from_dict(spec.to_dict())
    assert spec2 == spec and spec.to_dict()["tensor_scale"] == pytest.approx(ts)


def test_tensor_scale_validation_and_dict_compatibility():
    assert "tensor_scale" not in fp8lab.QuantSpec("e2m1", "nvfp4").to_dict()
    with pytest.raises(ValueError, match="tensor_scale"):
        fp8lab.QuantSpec("e4m3", "tensor", tensor_scale=0.5)
    with pytest.raises(ValueError, match="two_level"):
        fp8lab.QuantSpec("e2m1", "nvfp4", two_level=False, tensor_scale=0.5)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="positive finite"):
            fp8lab.QuantSpec("e2m1", "nvfp4", tensor_scale=bad)
    with pytest.raises(TypeError, match="tensor_scale"):
        fp8lab.QuantSpec("e2m1", "nvfp4", tensor_scale="0.5")


@pytest.mark.parametrize("tamax", [0.0, math.inf, 1e-40, 3e38])
def test_tensor_amax_edges_follow_te_kernel(tamax):
    # TE's compute_global_encode_scaling_factor_FP4: amax 0 or inf -> s_enc = 1 (inf used to
    # give s_enc 0 and an infinite s_dec); a tiny amax -> FLT_MAX
    blk = torch.tensor([0.0, 1.0, 6.0, 100.0])
    s_blk, s_dec, enc = rules.nvfp4_scales(blk, torch.tensor(tamax), "e2m1")
    w_blk, w_dec, w_enc = te_scales(blk, torch.tensor(tamax))
    assert same_bits(s_blk, w_blk) and same_bits(s_dec, w_dec) and same_bits(enc, w_enc)
    assert math.isfinite(float(s_dec))


def test_block_order_divide_follows_the_older_te_arithmetic():
    # (block_amax / 6) * s_enc, two roundings, against the kernel's block_amax * (s_enc * fl32(1/6))
    g = torch.Generator().manual_seed(5)
    blk = torch.rand(20000, generator=g) * 100
    tamax = torch.tensor(97.3)
    s_enc = torch.tensor(448.0 * 6.0) / tamax
    s_dec = torch.tensor(1.0) / s_enc
    want = ((blk / torch.tensor(6.0)) * s_enc).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    s_blk, d, enc = rules.nvfp4_scales(blk, tamax, "e2m1", block_order="divide")
    assert same_bits(s_blk, want) and same_bits(d, s_dec)
    assert same_bits(enc, torch.minimum(1.0 / (want * s_dec), torch.tensor(FLT_MAX)))
    with pytest.raises(ValueError, match="block_order"):
        rules.nvfp4_scales(blk, None, "e2m1", block_order="torchao")
