"""Scale rules against hand-computed cases (numbers derived in the comments, not from the code)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.scaling import rules

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)


def t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


# ------------------------------------------------------------------ max (TE current scaling)
def test_max_scale_basic_and_correctly_rounded_division():
    s = rules.max_scale(t(448.0, 1.0, 3.0, 0.5), "e4m3")
    assert s.tolist() == [1.0, 448.0, float(F32(448) / F32(3)), 896.0]
    # find amaxes where a reciprocal-times-max differs from the correctly rounded quotient, and
    # check the rule gives the quotient (TE: __fdiv_rn, explicitly not fast-math)
    rng = np.random.default_rng(0)
    am = (rng.random(20000, dtype=np.float32) * F32(100) + F32(0.01)).astype(np.float32)
    div = (F32(448) / am).astype(np.float32)
    rcp = (F32(448) * (F32(1) / am).astype(np.float32)).astype(np.float32)
    differ = div != rcp
    assert differ.any()
    got = rules.max_scale(torch.from_numpy(am[differ]), "e4m3").numpy()
    np.testing.assert_array_equal(got, div[differ])


def test_max_scale_te_special_amax():
    # amax 0, inf, NaN -> 1.0 (TE compute_scale_from_amax); tiny amax -> inf -> FLT_MAX
    s = rules.max_scale(t(0.0, math.inf, math.nan, 1e-40), "e4m3")
    assert s.tolist()[:3] == [1.0, 1.0, 1.0]
    assert s[3].item() == FLT_MAX
    # epsilon floors amax (0 -> eps), NaN stays NaN -> 1.0
    s = rules.max_scale(t(0.0, 1e-4, math.nan, 2.0), "e4m3", epsilon=1e-3)
    assert s[0].item() == float(F32(448) / F32(1e-3))
    assert s[1].item() == float(F32(448) / F32(1e-3))
    assert s[2].item() == 1.0
    assert s[3].item() == 224.0
    # margin: fmt_max * 2**-margin / amax ; e5m2 max 57344
    assert rules.max_scale(t(1.0), "e4m3", margin=2).item() == 112.0
    assert rules.max_scale(t(2.0), "e5m2").item() == 28672.0


def test_pow2_rules():
    # 448/3 = 149.33 -> down 128, up 256 ; 448/448 = 1 stays ; 448/0.5 = 896 -> 512 / 1024
    assert rules.pow2_down(t(3.0, 448.0, 0.5), "e4m3").tolist() == [128.0, 1.0, 512.0]
    assert rules.pow2_up(t(3.0, 448.0, 0.5), "e4m3").tolist() == [256.0, 1.0, 1024.0]
    # FLT_MAX (tiny amax) rounds down to 2**127, and up is capped at 2**127
    assert rules.pow2_down(t(1e-40), "e4m3").item() == 2.0**127
    assert rules.pow2_up(t(1e-40), "e4m3").item() == 2.0**127
    # special amax -> 1.0, a power of two already
    assert rules.pow2_down(t(0.0, math.nan), "e4m3").tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ MX / E8M0
@pytest.mark.parametrize(
    ("amax", "mode", "code"),
    [
        # e4m3 emax_elem = 8
        (1.0, "floor", 127 + 0 - 8),
        (1.875, "floor", 127 + 0 - 8),  # floor keeps 2**-8: 1.875 * 256 = 480 > 448 clips
        (1.0, "ceil", 119),
        (1.5, "ceil", 120),  # ceil(log2 1.5) = 1
        (1.9375, "even", 120),  # 1.1111b rounds at 3 bits to 2.0 -> exponent 1
        (1.875, "even", 119),  # 1.111b is exact at 3 bits -> exponent 0 (clips like floor)
        (1.9, "even", 119),  # 1.1110011b -> 1.111b
        (1.875, "rceil", 127 - 7),  # 1.875/448 = 2**-7.9 -> 2**-7: 240, no clip
        (448.0, "rceil", 127),  # exactly 448 -> X = 1
        (0.0, "floor", 0),
        (0.0, "rceil", 0),
        (math.inf, "floor", 255),
        (math.inf, "rceil", 254),  # TE float_to_e8m0: inf -> 0xFE
        (math.nan, "floor", 255),
        (math.nan, "rceil", 255),
        (FLT_MAX, "floor", 127 + 127 - 8),
        (FLT_MAX, "rceil", 127 + 120),  # log2(FLT_MAX/448) = 119.2 -> 120
        (2.0**-140, "floor", 0),  # fp32 subnormal amax: clamped to 2**-127
        (2.0**-140, "rceil", 0),  # quotient <= 2**-127 -> byte 0
    ],
)
def test_mx_exponent_hand_cases(amax, mode, code):
    assert rules.mx_exponent(t(amax), "e4m3", mode).item() == code


def test_mx_e2m1_and_e5m2_emax():
    # e2m1: emax 2, max 6: amax 7 floor -> X = 2**0 (7 clips to 6); rceil -> 7/6 -> X = 2
    assert rules.mx_exponent(t(7.0), "e2m1", "floor").item() == 127
    assert rules.mx_exponent(t(7.0), "e2m1", "rceil").item() == 128
    # e5m2: emax 15: amax 1 -> 2**-15
    assert rules.mx_exponent(t(1.0), "e5m2", "floor").item() == 112


def test_mx_floor_clips_where_rceil_never_does():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.875  # amax mantissa 1.875 > 448/256 = 1.75
    x[0, 1] = 0.5
    qf = fp8lab.quantize(x, "e4m3", "mx", "mx_floor")
    qr = fp8lab.quantize(x, "e4m3", "mx", "mx_rceil")
    assert qf.scales.item() == 2.0**-8 and qf.values[0, 0].item() == 448.0
    assert qf.dequantize()[0, 0].item() == 1.75  # clipped
    assert qr.scales.item() == 2.0**-7 and qr.dequantize()[0, 0].item() == 1.875
    # rceil never clips, on random blocks of all magnitudes
    g = torch.Generator().manual_seed(1)
    y = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 256, generator=g) * 4)
    q = fp8lab.quantize(y, "e4m3", "mx", "mx_rceil")
    assert q.values.abs().max().item() <= 448.0
    blk = y.abs().reshape(64, 8, 32).amax(-1)
    assert torch.all(blk / q.scales <= 448.0)
    assert torch.equal(q.scale_codes().to(torch.int32), rules.mx_exponent(blk, "e4m3", "rceil"))


def test_rceil_reciprocal_vs_division_variant():
    # TE forms fl32(amax * fl32(1/448)); DeepGEMM divides. Both agree on exact multiples
    for v in (448.0, 896.0, 224.0):
        a = rules.mx_exponent(t(v), "e4m3", "rceil")
        b = rules.mx_exponent(t(v), "e4m3", "rceil", divide=True)
        assert a.item() == b.item()


def test_e8m0_conversions():
    codes = torch.tensor([0, 127, 254, 255])
    inv = rules.e8m0_to_scale_inv(codes)
    assert inv[:3].tolist() == [2.0**-127, 1.0, 2.0**127] and math.isnan(inv[3])
    s = rules.e8m0_to_scale(codes)
    assert s[:3].tolist() == [2.0**127, 1.0, 2.0**-127] and math.isnan(s[3])


# ------------------------------------------------------------------ NVFP4 two-level
def test_nvfp4_two_level_hand_values():
    blk = t(6.0, 3.0, 0.1, 0.0)
    s_blk, s_dec, enc = rules.nvfp4_scales(blk, t(6.0).reshape(()), "e2m1")
    s_enc = F32(448 * 6) / F32(6)  # 448
    assert s_enc == 448
    assert s_dec.item() == float(F32(1) / F32(448))
    mult = F32(s_enc) * (F32(1) / F32(6))  # fl32(448 * fl32(1/6))
    # block scales, then RNE onto e4m3 (clamped to 448): 6*74.67=448, 3*74.67=224,
    # 0.1*74.67=7.47 -> 7.5 (spacing 0.5 in [4, 8)), 0 -> 0
    raw = [F32(6) * mult, F32(3) * mult, F32(0.1) * mult]
    assert abs(float(raw[0]) - 448) < 1e-3 and abs(float(raw[1]) - 224) < 1e-3
    assert s_blk.tolist() == [448.0, 224.0, 7.5, 0.0]
    # per-block multiplier: min(1/(s_blk * s_dec), FLT_MAX)
    exp_enc = [
        float(min(F32(1) / (F32(v) * F32(s_dec.item())), F32(FLT_MAX))) for v in (448, 224, 7.5)
    ]
    assert enc[:3].tolist() == exp_enc
    assert enc[3].item() == FLT_MAX  # 1/0 -> inf -> capped


def test_nvfp4_quantize_two_level_and_single_level():
    x = torch.tensor([[6.0, -3.0, 1.5, 0.75] + [0.0] * 12, [0.1, 0.05] + [0.0] * 14])
    q = fp8lab.quantize(x, "e2m1", "nvfp4")
    assert q.global_scale is not None
    assert q.global_scale.item() == float(F32(1) / F32(448))
    assert q.scales[:, 0].tolist() == [448.0, 7.5]
    # row 0: enc = 1/fl32(448 * fl32(1/448)) = 1/fl32(7 * fl32(1/7)) = 1 exactly, so the values
    # are x on the e2m1 grid; 0.75 is a tie between 0.5 (odd code 001) and 1.0 (even) -> 1.0.
    # row 1: 0.1 * 448/7.5 = 5.97 -> 6
    assert q.values[0, :4].tolist() == [6.0, -3.0, 1.5, 1.0]
    assert q.values[1, 0].item() == 6.0
    d = q.dequantize()
    assert abs(d[0, 0].item() - 6.0) < 1e-5
    # single level: s_blk = e4m3(clamp(amax/6, 2**-9, 448)), enc = 1/s_blk
    q1 = fp8lab.quantize(x, fp8lab.QuantSpec("e2m1", "nvfp4", two_level=False))
    assert q1.global_scale is None
    assert q1.scales[:, 0].tolist() == [1.0, float(fp8lab.cast(torch.tensor([0.1 / 6]), "e4m3"))]


def test_rule_registry_errors():
    with pytest.raises(ValueError, match="unknown scaling rule"):
        rules.get_rule("median")
    with pytest.raises(ValueError, match="unknown MX scale mode"):
        rules.mx_exponent(t(1.0), "e4m3", "round")


# ------------------------------------------------------------------ MX at the top of float32
MX_FORMATS = {"e4m3": (8, 3), "e5m2": (15, 2), "e2m3": (2, 3), "e3m2": (4, 2), "e2m1": (2, 1)}
# issue 11 item 2: the byte of a finite amax whose mantissa rounding carries past 2**127
CARRY_CODE = {"e4m3": 247, "e5m2": 240, "e2m3": 253, "e3m2": 251, "e2m1": 253}


def _top_amaxes(mbits: int) -> list[float]:
    """FLT_MAX, 1.9375 * 2**127, 2**127, the carry threshold of ``mbits`` and their float32
    neighbours (exact float32 values as Python floats)."""
    base = [FLT_MAX, 1.9375 * 2.0**127, 2.0**127, (2.0 - 2.0 ** -(mbits + 1)) * 2.0**127]
    out = set()
    for v in base:
        f = F32(v)
        with np.errstate(over="ignore"):  # FLT_MAX's upper neighbour is inf (dropped below)
            out |= {float(f), float(np.nextafter(f, F32(0))), float(np.nextafter(f, F32(np.inf)))}
    return sorted(v for v in out if math.isfinite(v))


def _mx_code_reference(v: float, mode: str, emax: int, mbits: int, fmax: float) -> int:
    """Exact E8M0 code of a positive finite float32 ``v`` (integer arithmetic on frexp)."""
    m, e = math.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    fl = e - 1  # floor(log2 v)
    pow2 = m == 0.5
    if mode == "floor":
        unb = fl
    elif mode == "ceil":
        unb = fl if pow2 else fl + 1
    elif mode == "even":
        # mantissa 1.f rounded half-up at mbits fraction bits (torchao EVEN), then floor
        q = math.floor(v / 2.0**fl * 2**mbits + 0.5)
        unb = fl + (1 if q == 2 ** (mbits + 1) else 0)
    else:  # rceil: ceil(log2(fl32(v * fl32(1/fmax))))
        r = float(F32(F32(v) * (F32(1) / F32(fmax))))
        mr, er = math.frexp(r)
        return er - 1 + (0 if mr == 0.5 else 1) + 127
    return min(max(unb - emax, -127), 128) + 127


@pytest.mark.parametrize("fmt", list(MX_FORMATS))
def test_mx_rules_at_the_top_of_the_float32_range(fmt):
    emax, mbits = MX_FORMATS[fmt]
    fmax = fp8lab.get_format(fmt).max
    amaxes = _top_amaxes(mbits)
    x = torch.tensor(amaxes, dtype=torch.float32)
    for mode in ("floor", "ceil", "even", "rceil"):
        got = rules.mx_exponent(x, fmt, mode).tolist()
        want = [_mx_code_reference(v, mode, emax, mbits, fmax) for v in amaxes]
        assert got == want, (fmt, mode)
        assert 255 not in got  # finite amax: never the NaN code
    # FLT_MAX and 1.9375 * 2**127 carry under EVEN: unbiased exponent 128 - emax_elem
    for v in (FLT_MAX, 1.9375 * 2.0**127):
        assert rules.mx_exponent(t(v), fmt, "even").item() == CARRY_CODE[fmt]
        assert rules.mx_even(t(v), fmt).item() == 2.0 ** (127 - CARRY_CODE[fmt])
    # a NaN amax (only) gives 255
    assert rules.mx_exponent(t(math.nan), fmt, "even").item() == 255


@pytest.mark.parametrize("fmt", list(MX_FORMATS))
def test_fused_mx_kernels_at_the_top_of_the_float32_range(fmt):
    # quantize's fused rule kernels must give the rule functions' scales there too
    amaxes = torch.tensor(_top_amaxes(MX_FORMATS[fmt][1]), dtype=torch.float32)
    x = torch.zeros(amaxes.numel(), 32)
    x[:, 0] = amaxes
    for mode in ("floor", "ceil", "even", "rceil"):
        q = fp8lab.quantize(x, fmt, "mx", f"mx_{mode}")
        code = rules.mx_exponent(amaxes, fmt, mode)
        assert torch.equal(q.scale_multipliers.reshape(-1), rules.e8m0_to_scale(code)), mode
        assert torch.equal(q.scales.reshape(-1), rules.e8m0_to_scale_inv(code)), mode
