"""The fused (hardware-exact) accumulator: exact-rational reference, probes, real-GPU outputs."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab import Accumulator, QuantSpec, qmatmul, quantize
from fp8lab.formats import get_format
from fp8lab.gemm.fused import fast_path_applies, fused, fused_dot
from fp8lab.gemm.operands import check_pair

F32 = np.float32
DATA = Path(__file__).parent / "data" / "tensor_core_validation.txt"


# ------------------------------------------------ exact-rational transcription of the model
def _floor_log2(m: Fraction) -> int:
    e = m.numerator.bit_length() - m.denominator.bit_length()
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    return e


def _trunc_to(v: Fraction, q: Fraction) -> Fraction:
    k = abs(v) / q
    return (1 if v >= 0 else -1) * (k.numerator // k.denominator) * q


def _round_fp32(v: Fraction, bits: int, rne: bool) -> float:
    """``out_bits`` fraction bits, exponent floor -126, >= 2**128 -> inf (the model's step 4)."""
    if v == 0:
        return 0.0
    q = Fraction(2) ** (max(_floor_log2(abs(v)), -126) - bits)
    k = abs(v) / q
    kept = k.numerator // k.denominator
    if rne and (k - kept > Fraction(1, 2) or (k - kept == Fraction(1, 2) and kept % 2)):
        kept += 1
    r = kept * q
    if r >= 2**128:
        return float("inf") if v > 0 else float("-inf")
    return float(r) if v > 0 else -float(r)


def ref_step(c: float, avs, bvs, acc: Accumulator, fmts) -> float:
    """One MMA step, transcribed from the issue's algorithm with Python fractions."""
    emins = [get_format(f).emin for f in fmts]
    terms = []
    for x, y in zip(avs, bvs, strict=True):
        if x == 0 or y == 0:
            continue
        ex = max(_floor_log2(abs(Fraction(x))), emins[0])
        ey = max(_floor_log2(abs(Fraction(y))), emins[1])
        terms.append((Fraction(x) * Fraction(y), ex + ey))
    if acc.c_entry == "after":
        s = _round_fp32(sum((t for t, _ in terms), Fraction(0)), acc.out_bits, False)
        return float(F32(s) + F32(c))
    if c != 0:
        terms.append((Fraction(c), max(_floor_log2(abs(Fraction(c))), -126)))
    if acc.align_bits is None:  # exact sum, c one of its terms, cut toward zero
        return _round_fp32(sum((t for t, _ in terms), Fraction(0)), acc.out_bits, False)
    if not terms:
        return 0.0
    e = max(max(x for _, x in terms), acc.exp_floor)
    q = Fraction(2) ** (e - acc.align_bits)
    s = sum((_trunc_to(t, q) for t, _ in terms), Fraction(0))
    return _round_fp32(s, acc.out_bits, acc.out_rounding == "nearest_even")


def ref_fused(qa, qb, acc: Accumulator, c=None) -> np.ndarray:
    """qmatmul under a resolved fused accumulator, element by element (promotion as FP32 ops)."""
    va, vb = qa.values.tolist(), qb.values.tolist()
    fmts = (qa.spec.format, qb.spec.format)
    m, k = qa.shape
    n = qb.shape[1]
    bka = min(qa.spec.block[1] if qa.spec.block[1] > 0 else k, k)
    bkb = min(qb.spec.block[0] if qb.spec.block[0] > 0 else k, k)
    bma = qa.spec.block[0] if qa.spec.block[0] > 0 else m
    bnb = qb.spec.block[1] if qb.spec.block[1] > 0 else n
    pe, g = acc.promote_every, acc.group
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            cij = 0.0 if c is None else float(c[i, j])
            run = 0.0 if pe is not None else cij
            total = F32(cij)
            for g0 in range(0, k, g):
                g1 = min(g0 + g, k)
                col = [vb[t][j] for t in range(g0, g1)]
                run = ref_step(run, va[i][g0:g1], col, acc, fmts)
                if pe is not None and (g1 % pe == 0 or g1 == k):
                    p0 = ((g1 - 1) // pe) * pe
                    sa = F32(qa.scales[i // bma, p0 // bka].item())
                    sb = F32(qb.scales[p0 // bkb, j // bnb].item())
                    total = F32(total + F32(F32(sa * sb) * F32(run)))
                    run = 0.0
            if pe is None:
                s = F32(F32(qa.scales.reshape(-1)[0].item()) * F32(qb.scales.reshape(-1)[0].item()))
                total = F32(F32(run) * s)
            out[i, j] = total
    return out


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _unit(x: torch.Tensor, fmt: str):
    """A QTensor with scale 1 whose values are ``x`` (already on the grid of ``fmt``)."""
    q = quantize(x, QuantSpec(fmt, scaling=1.0))
    assert torch.equal(q.values, x)
    return q


def _dot(a, b, acc="h100", fmts=("e4m3", "e4m3"), c=0.0) -> int:
    """Bit pattern of one dot product (c in), through qmatmul [1, K] x [K, 1]."""
    qa = _unit(torch.tensor([a], dtype=torch.float32), fmts[0])
    qb = _unit(torch.tensor(b, dtype=torch.float32).reshape(-1, 1), fmts[1])
    out = qmatmul(qa, qb, acc, c=torch.tensor([[c]], dtype=torch.float32))
    return int(_bits(out.reshape(()).item()))


def _pad(xs, k=32):
    return list(xs) + [0.0] * (k - len(xs))


# ------------------------------------------------------------------ probes (H100 FP8 row)
@pytest.mark.parametrize(("s", "want"), [(5, 0x3D000000), (6, 0x00000000)])
def test_cancellation_probe_reveals_13_alignment_bits(s, want):
    # 2**8 + 2**-s - 2**8: E = 8, the quantum is 2**(8 - 13): 2**-5 survives, 2**-6 is cut
    a = _pad([16.0, 2.0**-s, -16.0])
    b = _pad([16.0, 1.0, 16.0])
    assert _dot(a, b) == want


def test_carry_probe_32_products_at_the_largest_exponent():
    # 32 x 448 * 448 = 1.53125 * 2**22 (exact, 5 carries); c = 8 is a term (8 = 2**(16 - 13))
    # but the normalised sum keeps 13 fraction bits: 2**(22 - 13) = 512 > 8, cut toward zero
    assert _dot([448.0] * 32, [448.0] * 32) == 0x4AC40000
    assert _dot([448.0] * 32, [448.0] * 32, c=8.0) == 0x4AC40000
    assert F32(32 * 448.0 * 448.0 + 8) == F32(6422536.0)  # an FP32 accumulator keeps it


@pytest.mark.parametrize(
    ("p", "want"),
    [
        (1.0, 0x49800000),  # 1 < 2**(20 - 13): truncated away
        (128.0, 0x49800400),  # exactly one quantum: 2**20 + 2**7
        (240.0, 0x49800400),  # 240 = 1.875 * 2**7 truncated to 128
        (-240.0, 0x497FF800),  # toward zero per term: -128, then 2**20 - 128 (exact)
    ],
)
def test_accumulator_truncation_probe(p, want):
    assert _dot(_pad([p]), _pad([1.0]), c=2.0**20) == want


def test_mixed_sign_probe_truncates_each_term_toward_zero():
    # 256 - 0.046875: E = 8, quantum 2**-5: -0.046875 -> -0.03125, sum 256 - 2**-5 (exact)
    assert _dot(_pad([16.0, -0.046875]), _pad([16.0, 1.0])) == 0x437FF800


def test_subnormal_operand_exponent_feeds_e():
    # 2**-9 (e4m3 subnormal, e = -6) * 448: e_p = 2 although the product is 0.875, so E = 2
    # and 1.875 * 2**-12 is below the quantum 2**-11: cut to 0
    assert _dot(_pad([2.0**-9, 1.875 * 2**-6]), _pad([448.0, 2.0**-6])) == 0x3F600000


def test_zero_terms_and_signed_zero():
    assert _dot([0.0] * 32, [1.0] * 32, c=-0.0) == 0  # no terms: +0
    assert _dot(_pad([1.0, -1.0]), _pad([1.0, 1.0])) == 0  # exact cancellation: +0
    # a lone c: truncated to 13 fraction bits at its own exponent
    c = float(F32(1 + 2.0**-13 + 2.0**-14))
    assert _dot([0.0] * 32, [0.0] * 32, c=c) == int(_bits(1 + 2.0**-13))


def test_overflow_and_fp32_subnormal_results():
    # a huge c keeps its top 13 fraction bits; the product is far below its quantum
    assert _dot(_pad([448.0]), _pad([448.0]), c=float(F32(2.0**127 * 1.9999))) == 0x7F7FFC00
    # two bf16 maxima: the normalised sum is >= 2**128: +-inf
    big = float(get_format("bf16").max)
    bf = ("bf16", "bf16")
    assert _dot(_pad([big, big], 16), _pad([1.0, 1.0], 16), fmts=bf) == 0x7F800000
    assert _dot(_pad([big, big], 16), _pad([-1.0, -1.0], 16), fmts=bf) == 0xFF800000
    # c subnormal alone: e_c = -126, quantum 2**(-126 - 13) on the FP32 grid
    c = float(F32(2.0**-130 + 2.0**-149))
    assert _dot([0.0] * 32, [0.0] * 32, c=c) == int(_bits(2.0**-130))


# ------------------------------------------------------- real-GPU outputs (published data)
def _validation_sets():
    sets: dict[tuple[str, str], list] = {}
    for line in DATA.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, a, b, c, d = line.split("|")
        gpu, fmt = head.split()
        sets.setdefault((gpu, fmt), []).append((a.split(), b.split(), c.strip(), d.strip()))
    return sets


def _f32(hexes) -> torch.Tensor:
    return torch.from_numpy(np.array([int(h, 16) for h in hexes], dtype=np.uint32).view(F32))


_FMT = {"E4M3": "e4m3", "E5M2": "e5m2", "bf16": "bf16", "fp16": "fp16"}
_GPU = {"H100": ("h100", "h200"), "L40S": ("l40s", "ada"), "B200": ("b200",)}


@pytest.mark.parametrize(("gpu", "fmt"), [(g, f) for g in _GPU for f in _FMT])
def test_matches_published_gpu_outputs_bit_for_bit(gpu, fmt):
    rows = _validation_sets()[(gpu, fmt)]
    a = torch.stack([_f32(r[0]) for r in rows])
    b = torch.stack([_f32(r[1]) for r in rows])
    c = _f32([r[2] for r in rows])
    d = _bits(_f32([r[3] for r in rows]).numpy())
    f = _FMT[fmt]
    for name in _GPU[gpu]:
        got = fused_dot(a, b, name, (f, f), c=c)
        np.testing.assert_array_equal(_bits(got.numpy()), d)
    # the GEMM path (the fast kernel where it applies) on a few of them
    for s in range(0, 24, 6):
        qa = _unit(a[s : s + 1].contiguous(), f)
        qb = _unit(b[s : s + 1].t().contiguous(), f)
        out = qmatmul(qa, qb, _GPU[gpu][0], c=c[s : s + 1].reshape(1, 1))
        assert int(_bits(out.item())) == int(d[s])


def test_b200_tcgen05_is_a_different_model():
    rows = _validation_sets()[("B200", "E4M3")]
    a = torch.stack([_f32(r[0]) for r in rows])
    b = torch.stack([_f32(r[1]) for r in rows])
    c = _f32([r[2] for r in rows])
    d = _bits(_f32([r[3] for r in rows]).numpy())
    got = _bits(fused_dot(a, b, "b200-tcgen05", ("e4m3", "e4m3"), c=c).numpy())
    assert (got != d).any()  # MMA-Sim's tcgen05 model is not what mma.sync measured


# --------------------------------------------- random chains against the rational reference
def _edge_operand(shape, fmt, seed):
    """Values on ``fmt``'s grid spanning its range: subnormals, extremes, zeros, both signs."""
    g = torch.Generator().manual_seed(seed)
    ff = get_format(fmt)
    wide = ff.emax > 20  # bf16: keep products finite (an inf chain is no test of rounding)
    hi = 40 if wide else ff.emax + 1
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(ff.emin - 3, hi, shape, generator=g).float()
    )
    x = fp8lab.cast(x, fmt)
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    if not wide:
        x[torch.rand(shape, generator=g) < 0.03] = float(ff.max)
        x[torch.rand(shape, generator=g) < 0.03] = -float(ff.max)
    return x


_EXACT = Accumulator("fused", group=16, align_bits=None, out_bits=13)


@pytest.mark.parametrize(
    ("hw", "fa", "fb", "k", "pe", "seed"),
    [
        ("h100", "e4m3", "e4m3", 32, None, 1),
        ("h100", "e4m3", "e5m2", 96, None, 2),
        ("h100", "e5m2", "e5m2", 1024, 128, 3),
        ("h100", "e4m3", "e4m3", 1000, 128, 4),  # ragged last group and interval
        ("ada", "e4m3", "e5m2", 160, None, 5),
        ("h100", "bf16", "bf16", 80, None, 6),
        ("ada", "fp16", "fp16", 64, None, 7),
        ("b200", "e5m2", "e4m3", 128, None, 8),
        ("b200-tcgen05", "e4m3", "e4m3", 96, None, 9),
        (_EXACT, "e4m3", "e5m2", 100, None, 10),  # exact sums chained through an aligned c
        (_EXACT, "bf16", "bf16", 64, None, 11),
    ],
)
def test_random_chains_match_exact_reference(hw, fa, fb, k, pe, seed):
    m, n = 3, 5
    qa = _unit(_edge_operand((m, k), fa, seed), fa)
    qb = _unit(_edge_operand((k, n), fb, seed + 100), fb)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(m, n, generator=g) * 1e4
    c[0, 0], c[1, 1] = 0.0, float(F32(2.0**-140))
    acc = Accumulator.parse(hw, (fa, fb)) if isinstance(hw, Accumulator) else None
    acc = acc or Accumulator(hw, promote_every=pe).resolve(fa, fb)
    want = ref_fused(qa, qb, acc, c)
    got = qmatmul(qa, qb, acc, c=c).numpy()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    kb = check_pair(qa, qb)
    ref_kernel = fused(qa, qb, acc, kb, c, fast=False).numpy()
    np.testing.assert_array_equal(_bits(ref_kernel), _bits(want))


def test_block_scales_promoted_match_exact_reference():
    g = torch.Generator().manual_seed(11)
    a = torch.randn(4, 384, generator=g) * torch.exp(torch.randn(4, 384, generator=g) * 2)
    b = torch.randn(384, 70, generator=g)
    qa = quantize(a, "e4m3", (1, 128), "max")
    qb = quantize(b, "e4m3", (128, 64), "max")  # ragged N edge
    acc = Accumulator("h100", promote_every=128).resolve("e4m3", "e4m3")
    c = torch.randn(4, 70, generator=g)
    np.testing.assert_array_equal(qmatmul(qa, qb, acc, c=c).numpy(), ref_fused(qa, qb, acc, c))
    np.testing.assert_array_equal(qmatmul(qa, qb, acc).numpy(), ref_fused(qa, qb, acc))


@pytest.mark.numba_only  # numba's fast kernel against its reference kernel
@pytest.mark.parametrize("seed", range(4))
def test_fast_kernel_equals_reference_kernel_at_gemm_scale(seed):
    # more rows and columns than one tile/job of the fast kernel, sparse rows, both formats
    g = torch.Generator().manual_seed(seed)
    m, k, n = 37, 512, 600  # two column tiles of the fast kernel (512), the second ragged
    a = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 3)
    a[:, ::7] = 0.0
    a[3] = 0.0  # a row with no nonzero products: c alone through every step
    b = torch.randn(k, n, generator=g)
    fb = ("e4m3", "e5m2")[seed % 2]
    qa, qb = quantize(a, "e4m3"), quantize(b, fb)
    c = torch.randn(m, n, generator=g) * 10.0**seed
    c[3, :4] = torch.tensor([1e-39, -3e38, 0.0, 2.0**-120])
    for pe in (None, 128):
        acc = Accumulator("h100", promote_every=pe).resolve("e4m3", fb)
        assert fast_path_applies(acc, "e4m3", fb)
        kb = check_pair(qa, qb)
        if pe is None:  # c enters the chain: unit scales
            qa1, qb1 = _unit(qa.values, "e4m3"), _unit(qb.values, fb)
            fast = fused(qa1, qb1, acc, kb, c)
            ref = fused(qa1, qb1, acc, kb, c, fast=False)
        else:
            fast = fused(qa, qb, acc, kb, c)
            ref = fused(qa, qb, acc, kb, c, fast=False)
        np.testing.assert_array_equal(_bits(fast.numpy()), _bits(ref.numpy()))


# ------------------------------------------------------------------- configuration, names
def test_hardware_names_and_rows():
    h = Accumulator("h100", promote_every=128)
    assert h.kind == "fused" and h.hardware == "h100"
    assert Accumulator.parse("h200") == Accumulator(kind="fused", hardware="h200")
    r = h.resolve("e4m3", "e5m2")
    assert (r.group, r.align_bits, r.out_bits, r.promote_every) == (32, 13, 13, 128)
    r = Accumulator.parse("ada", ("bf16", "bf16"))
    assert (r.group, r.align_bits, r.out_bits, r.exp_floor) == (8, 24, 23, -132)
    r = Accumulator.parse("l40s", ("e4m3", "e4m3"))
    assert (r.group, r.align_bits, r.exp_floor) == (16, 13, -132)
    r = Accumulator.parse("b200", ("e4m3", "e5m2"))
    assert (r.align_bits, r.out_bits, r.c_entry) == (None, 23, "after")
    assert Accumulator.parse("b200-tcgen05", ("e5m2", "e5m2")).align_bits == 25
    for fmts in (("e4m3-ieee", "e4m3"), ("e2m1", "e2m1"), ("bf16", "fp16"), ("e4m3", "bf16")):
        with pytest.raises(ValueError, match="has no model"):
            Accumulator.parse("h100", fmts)
    with pytest.raises(ValueError, match="has no model"):
        qmatmul(quantize(torch.randn(4, 64), "e4m3", "mx"),
                quantize(torch.randn(64, 4), "e4m3", "mx_col"), "h100")  # fmt: skip
    rows = fp8lab.accumulators()
    assert {r["name"] for r in rows} == {"h100", "h200", "ada", "l40s", "b200", "b200-tcgen05"}
    assert all(r["source"] for r in rows)
    assert any("not confirmed" in r["note"] for r in rows if r["name"] == "b200-tcgen05")


def test_fused_config_round_trip_and_errors():
    accs = (
        Accumulator("h100", promote_every=128),
        Accumulator("fused", group=16, align_bits=9, out_bits=11, c_entry="after"),
        Accumulator("fused", align_bits=None, out_rounding="nearest_even", exp_floor=-132),
    )
    for acc in accs:
        d = json.loads(json.dumps(acc.to_dict()))
        assert Accumulator.from_dict(d) == acc
    assert Accumulator("h100").to_dict() == {"kind": "h100"}
    for kw in ({"c_entry": "before"}, {"out_rounding": "up"}, {"align_bits": 0},
               {"out_bits": 24}, {"exp_floor": -99}, {"hardware": "h300"}):  # fmt: skip
        with pytest.raises(ValueError):
            Accumulator("fused", **kw)
    with pytest.raises(ValueError, match="GPU name"):
        Accumulator("h300")


def test_c_without_promotion_enters_the_first_step():
    # D = A.B + C as one MMA chain: equal to fused_dot with the same c
    g = torch.Generator().manual_seed(3)
    a = fp8lab.cast(torch.randn(6, 64, generator=g) * 20, "e4m3")
    b = fp8lab.cast(torch.randn(64, 1, generator=g), "e4m3")
    c = torch.randn(6, 1, generator=g) * 1e3
    got = qmatmul(_unit(a, "e4m3"), _unit(b, "e4m3"), "h100", c=c)
    want = fused_dot(a, b.t().expand(6, 64), "h100", c=c.reshape(-1))
    assert torch.equal(got.reshape(-1), want)
    assert not torch.equal(got, qmatmul(_unit(a, "e4m3"), _unit(b, "e4m3"), "h100") + c)


def test_describe():
    assert Accumulator().describe() == "fp32"
    assert Accumulator("limited", promote_every=128).describe() == "limited(m=13, promote=128)"
    assert Accumulator("h100", promote_every=128).describe() == "h100(promote=128)"
    assert Accumulator("ada").describe() == "ada"
    acc = Accumulator("fused", align_bits=None, out_bits=23, c_entry="after")
    assert acc.describe() == "fused(G=32, F=exact, out=23, c after)"


@pytest.mark.numba_only  # numba's fast kernel against its reference kernel
@pytest.mark.parametrize("seed", range(2))
def test_fast_kernel_every_count_of_nonzero_terms(seed):
    # rows of every density, so that a 32-element group holds every number of nonzero a
    # elements (the fast kernel sweeps them four at a time, then one at a time)
    g = torch.Generator().manual_seed(100 + seed)
    m, k, n = 40, 256, 96
    a = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2)
    keep = torch.rand(m, k, generator=g) < torch.linspace(0, 1, m).reshape(-1, 1)
    a = a * keep
    b = torch.randn(k, n, generator=g)
    qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
    c = torch.randn(m, n, generator=g)
    for pe in (128, None):
        acc = Accumulator("h100", promote_every=pe).resolve("e4m3", "e4m3")
        kb = check_pair(qa, qb)
        if pe is None:  # c enters the chain: unit scales
            qa, qb = _unit(qa.values, "e4m3"), _unit(qb.values, "e4m3")
        fast = fused(qa, qb, acc, kb, c)
        ref = fused(qa, qb, acc, kb, c, fast=False)
        np.testing.assert_array_equal(_bits(fast.numpy()), _bits(ref.numpy()))


@pytest.mark.numba_only  # the numba operand pass against an independent numpy derivation
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16"])
def test_operand_exponents_pass(fmt):
    from fp8lab.gemm.fused import _exponents

    f = get_format(fmt)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4092, generator=g) * torch.exp2(torch.randint(-40, 40, (4092,), generator=g))
    x = torch.cat([fp8lab.cast(x, fmt), torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-130)])])
    v, p, finite = _exponents(x.reshape(64, -1).t(), fmt)  # a transposed (strided) operand
    xs = x.reshape(64, -1).t().contiguous().numpy().astype(np.float64)
    _, e = np.frexp(np.abs(xs))  # |x| = m 2**e, m in [0.5, 1): floor(log2|x|) = e - 1
    want = np.where(xs == 0, 0.0, np.exp2(np.maximum(e - 1, f.emin)))
    assert finite and torch.equal(v, x.reshape(64, -1).t())
    np.testing.assert_array_equal(p.numpy().astype(np.float64), want)
    for bad in (float("inf"), float("nan")):
        assert not _exponents(torch.tensor([1.0, bad]), fmt)[2]
