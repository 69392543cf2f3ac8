"""encode/decode: all codes of every <=8-bit format round-trip; torch float8 interop by bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats_reference import ML_NONSAT, ML_SAT

from fp8lab import cast, decode, encode, from_torch_float8, get_format, to_torch_float8

EIGHT_BIT = [
    "e4m3",
    "e5m2",
    "e4m3fnuz",
    "e5m2fnuz",
    "e4m3-ieee",
    "e3m4",
    "e8m0",
    "hif8",
    "e2m5",
    "e7m0",
]
SMALL = ["e2m1", "e2m3", "e3m2", "e3m3"]

ML = {k: v for k, v in {**ML_NONSAT, **ML_SAT}.items() if k not in ("bf16", "fp16")}


@pytest.mark.parametrize("fmt", EIGHT_BIT + SMALL)
def test_all_codes_round_trip(fmt, kernels):
    f = get_format(fmt)
    codes = torch.arange(1 << f.bits, dtype=torch.int32).to(torch.uint8)
    vals = decode(codes, fmt)
    nan = torch.isnan(vals)
    sat = not f.inf and not f.has_nan
    back = encode(vals[~nan], fmt, saturate=sat)
    assert torch.equal(back, codes[~nan])
    # decoded values are fixed points of cast in every deterministic mode
    for mode in ("nearest_even", "nearest_away", "toward_zero"):
        fin = vals[torch.isfinite(vals)]
        assert torch.equal(cast(fin, fmt, rounding=mode), fin)


@pytest.mark.parametrize("fmt", list(ML))
def test_decode_matches_ml_dtypes(fmt, kernels):
    f = get_format(fmt)
    codes = np.arange(1 << f.bits, dtype=np.uint8)
    ref = codes.view(ML[fmt]).astype(np.float32)
    got = decode(torch.from_numpy(codes), fmt).numpy()
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all()


@pytest.mark.parametrize("fmt", list(ML))
def test_encode_matches_ml_dtypes_bits(fmt, kernels):
    f = get_format(fmt)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * min(f.max, 1e4) / 3).astype(np.float32)
    if not f.signed:
        x = np.abs(x) + np.float32(2.0**-100)
    sat = not f.inf and not f.has_nan
    with np.errstate(over="ignore"):
        ref = x.astype(ML[fmt]).view(np.uint8)
    got = encode(torch.from_numpy(x), fmt, saturate=sat).numpy()
    vals = ref.view(ML[fmt]).astype(np.float32)
    ok = (got == ref) | np.isnan(vals)  # NaN codes: fp8lab emits the positive NaN code
    assert ok.all()


def test_special_codes(kernels):
    nan = torch.tensor([float("nan")])
    assert encode(nan, "e4m3").item() == 0x7F
    assert encode(nan, "e5m2").item() == 0x7E
    assert encode(nan, "e4m3fnuz").item() == 0x80
    assert encode(nan, "hif8").item() == 0x80
    assert encode(nan, "e8m0").item() == 0xFF
    assert encode(nan, "e2m1").item() == 0x8  # no NaN: the -0 code, as ml_dtypes
    assert encode(torch.tensor([-0.0]), "e4m3").item() == 0x80
    assert encode(torch.tensor([-0.0]), "e4m3fnuz").item() == 0x00
    assert encode(torch.tensor([float("inf")]), "e5m2", saturate=False).item() == 0x7C
    assert encode(torch.tensor([500.0]), "e4m3", saturate=False).item() == 0x7F


TORCH = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
    "e8m0": torch.float8_e8m0fnu,
}


@pytest.mark.parametrize("fmt", list(TORCH))
def test_torch_interop_same_bits(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    t = to_torch_float8(codes, fmt)
    assert t.dtype == TORCH[fmt]
    ours = decode(codes, fmt)
    theirs = t.float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    fin = ~torch.isnan(ours)
    assert torch.equal(ours[fin], theirs[fin])
    back, f = from_torch_float8(t)
    assert f.name == fmt and back.dtype == torch.uint8 and torch.equal(back, codes)


def test_to_torch_from_floats_matches_torch_cast():
    # within e4m3's range: beyond 448 torch's own cast saturates in torch 2.13 but gives NaN in
    # 2.11 (test_formats_oracles.test_torch_native_casts reads which); unseeded, about 1 run in
    # 3 drew a value past 464 and failed under torch 2.11
    x = (torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 100).clamp(-448, 448)
    t = to_torch_float8(x, "e4m3")
    assert torch.equal(t.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    t = to_torch_float8(x, "e5m2", saturate=False)
    assert torch.equal(t.view(torch.uint8), x.to(torch.float8_e5m2).view(torch.uint8))


def test_codec_errors():
    with pytest.raises(ValueError, match="8 bits or fewer"):
        encode(torch.ones(2), "bf16")
    with pytest.raises(ValueError, match="8 bits or fewer"):
        decode(torch.zeros(2, dtype=torch.uint8), "e5m6")
    with pytest.raises(ValueError, match="integer"):
        decode(torch.zeros(2), "e4m3")
    with pytest.raises(ValueError, match="4-bit"):
        decode(torch.tensor([16], dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="torch dtype"):
        to_torch_float8(torch.ones(2), "hif8")
    with pytest.raises(ValueError, match="float8"):
        from_torch_float8(torch.ones(2))
    with pytest.raises(ValueError, match="valid names"):
        encode(torch.ones(2), "nope")
    with pytest.raises(ValueError, match="float32"):
        encode(torch.ones(2, dtype=torch.int64), "e4m3")


def test_decode_accepts_wider_int_codes():
    assert decode(torch.tensor([0x38], dtype=torch.int64), "e4m3").item() == 1.0
