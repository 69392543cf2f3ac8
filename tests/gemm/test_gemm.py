"""qmatmul: accumulator models against an exact-rational reference, native path, errors."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab import Accumulator, QuantSpec, qmatmul, quantize

F32 = np.float32


def gen(seed):
    return torch.Generator().manual_seed(seed)


def wide(shape, seed):
    g = gen(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 1.5)


# ---------------------------------------------------------------- exact reference of the model
def _exp2floor(m: Fraction) -> int:
    e = m.numerator.bit_length() - m.denominator.bit_length()
    if Fraction(2) ** e > m:
        e -= 1
    elif Fraction(2) ** (e + 1) <= m:
        e += 1
    return e


def cut(v: Fraction, bits: int, mode: str) -> Fraction:
    """Keep ``bits`` fraction bits below the leading one: toward zero or nearest-even."""
    if v == 0:
        return Fraction(0)
    sign = -1 if v < 0 else 1
    m = abs(v)
    q = Fraction(2) ** (_exp2floor(m) - bits)
    k = m / q
    kept = k.numerator // k.denominator
    if mode == "nearest_even":
        rem = k - kept
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and kept % 2 == 1):
            kept += 1
    return sign * kept * q


def trunc_to(v: Fraction, q: Fraction) -> Fraction:
    k = abs(v) / q
    return (1 if v >= 0 else -1) * (k.numerator // k.denominator) * q


def reference_limited(qa, qb, acc: Accumulator) -> np.ndarray:
    """Element-by-element model in exact rationals + numpy float32 for the FP32 steps."""
    va = [[Fraction(float(v)) for v in row] for row in qa.values.tolist()]
    vb = [[Fraction(float(v)) for v in row] for row in qb.values.tolist()]
    m, k = qa.shape
    n = qb.shape[1]
    bma, bka = (min(s, d) if s > 0 else d for s, d in zip(_blk(qa), qa.shape, strict=True))
    bkb, bnb = (min(s, d) if s > 0 else d for s, d in zip(_blk(qb), qb.shape, strict=True))
    pe = acc.promote_every
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            a_acc = Fraction(0)
            total = F32(0)
            for g0 in range(0, k, acc.group):
                g1 = min(g0 + acc.group, k)
                prods = [va[i][t] * vb[t][j] for t in range(g0, g1)]
                if acc.per_product:
                    nz = [abs(p) for p in prods if p != 0]
                    if nz:
                        q = Fraction(2) ** (max(_exp2floor(p) for p in nz) - acc.mantissa_bits)
                        prods = [trunc_to(p, q) for p in prods]
                a_acc = cut(a_acc + sum(prods), acc.mantissa_bits, acc.rounding)
                if pe is not None and (g1 % pe == 0 or g1 == k):
                    p0 = ((g1 - 1) // pe) * pe
                    sa = F32(qa.scales[i // bma, p0 // bka].item())
                    sb = F32(qb.scales[p0 // bkb, j // bnb].item())
                    total = F32(total + F32(F32(sa * sb) * F32(float(a_acc))))
                    a_acc = Fraction(0)
            if pe is None:
                s = F32(F32(qa.scales.reshape(-1)[0].item()) * F32(qb.scales.reshape(-1)[0].item()))
                total = F32(F32(float(a_acc)) * s)
            out[i, j] = total
    return out


def _blk(q):
    return q.spec.block


@pytest.mark.parametrize(
    "acc",
    [
        Accumulator("limited"),
        Accumulator("limited", mantissa_bits=14),
        Accumulator("limited", mantissa_bits=5, rounding="nearest_even"),
        Accumulator("limited", promote_every=64),
        Accumulator("limited", group=16, promote_every=32, mantissa_bits=7),
        Accumulator("limited", per_product=True, mantissa_bits=6),
        Accumulator("limited", per_product=True, mantissa_bits=9, promote_every=64),
    ],
)
def test_limited_matches_exact_reference_per_tensor(acc):
    a, b = wide((3, 200), 1), wide((200, 5), 2)
    qa, qb = quantize(a, "e4m3"), quantize(b, "e5m2")
    got = qmatmul(qa, qb, acc).numpy()
    np.testing.assert_array_equal(got, reference_limited(qa, qb, acc))


@pytest.mark.parametrize(
    ("m", "k", "promote_every"),
    [(70, 1100, 128), (66, 768, 128), (9, 1100, None), (5, 640, 32)],
)
def test_limited_over_several_batched_k_calls(m, k, promote_every):
    # K longer than one batched group-sum call (512), split into calls that need not divide K,
    # and more rows than one row chunk (64): still the exact reference
    a, b = wide((m, k), 5), wide((k, 7), 6)
    if promote_every is None:
        qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
    else:
        qa, qb = quantize(a, "e4m3", (1, 128), "max"), quantize(b, "e4m3", (128, 128), "max")
    acc = Accumulator("limited", promote_every=promote_every, mantissa_bits=9)
    np.testing.assert_array_equal(qmatmul(qa, qb, acc).numpy(), reference_limited(qa, qb, acc))


@pytest.mark.parametrize("per_product", [False, True])
def test_limited_block_scales_promoted_with_k_group_scales(per_product):
    a, b = wide((4, 256), 3), wide((256, 70), 4)
    qa = quantize(a, "e4m3", (1, 128), "pow2_down")
    qb = quantize(b, "e4m3", (128, 64), "max")  # ragged N edge
    acc = Accumulator("limited", promote_every=128, mantissa_bits=8, per_product=per_product)
    got = qmatmul(qa, qb, acc).numpy()
    np.testing.assert_array_equal(got, reference_limited(qa, qb, acc))


def test_fp32_accumulator_paths():
    a, b = wide((33, 300), 5), wide((300, 17), 6)
    qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
    out = qmatmul(qa, qb)
    # per tensor: exact products, fp32 sums, scales applied once to the output
    want = (qa.values @ qb.values) * (qa.scales.reshape(()) * qb.scales.reshape(()))
    assert torch.equal(out, want)
    exact = qa.dequantize().double() @ qb.dequantize().double()
    assert ((out.double() - exact).norm() / exact.norm()) < 1e-6
    # per-channel (row of a, column of b): still output scaling
    qa, qb = quantize(a, "e4m3", "row"), quantize(b, "e4m3", "col")
    out = qmatmul(qa, qb)
    assert torch.equal(out, (qa.values @ qb.values) * (qa.scales * qb.scales))
    # K-varying block scales: dequantize then multiply
    qa, qb = quantize(a, "e4m3", (1, 128)), quantize(b, "e4m3", (128, 128))
    assert torch.equal(qmatmul(qa, qb, "fp32"), qa.dequantize() @ qb.dequantize())
    # MX operands: a along K in rows, b along K in columns
    qa, qb = quantize(a, "e4m3", "mx"), quantize(b, "e4m3", "mx_col")
    assert torch.equal(qmatmul(qa, qb), qa.dequantize() @ qb.dequantize())


def test_limited_with_many_bits_approaches_fp32():
    a, b = torch.randn(16, 1024, generator=gen(7)), torch.randn(1024, 16, generator=gen(8))
    qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
    exact = qa.dequantize().double() @ qb.dequantize().double()
    e = {}
    for bits in (8, 13, 20, 23):
        out = qmatmul(qa, qb, Accumulator("limited", mantissa_bits=bits))
        e[bits] = ((out.double() - exact).norm() / exact.norm()).item()
    assert e[8] > e[13] > e[20] > e[23]
    assert e[23] < 1e-6


def test_deepseek_k4096_measurement():
    """DeepSeek-V3 §3.3: K=4096 random matrices, ~14-bit accumulation, max rel. error ~2%."""
    m = n = 64
    k = 4096
    a, b = torch.randn(m, k, generator=gen(9)), torch.randn(k, n, generator=gen(10))
    qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
    ref = qa.dequantize().double() @ qb.dequantize().double()
    big = ref.abs() > ref.abs().median()

    def errs(acc):
        d = qmatmul(qa, qb, acc).double() - ref
        return (d.norm() / ref.norm()).item(), (d.abs() / ref.abs())[big].max().item()

    frob_none, max_none = errs(Accumulator("limited", mantissa_bits=13))
    frob_pro, _ = errs(Accumulator("limited", mantissa_bits=13, promote_every=128))
    assert 3e-3 < max_none < 5e-2  # the order of DeepSeek's "nearly 2%"
    assert frob_none / frob_pro >= 10  # promotion every 128 cuts the error by >= 10x


def _exact(q) -> np.ndarray:
    """A QTensor's represented values (element x per-tensor scale), exact in float64."""
    return q.values.double().numpy() * float(q.scales.reshape(()))


def _fp32_dot_bound(qa, qb, roundings: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact product of two per-tensor QTensors (float64) and the largest error of any FP32
    evaluation of it that rounds at most ``roundings`` times per result, in any summation order
    (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5: |fl(x.y) - x.y|
    <= gamma_n |x|.|y|, gamma_n = n u / (1 - n u), u = 2^-24), plus the float64 reference's own
    rounding. BLAS kernels differ by CPU (AVX2, AVX-512, AMX) and by threading in their order."""
    a, b = _exact(qa), _exact(qb)
    k = a.shape[1]
    mag = np.abs(a) @ np.abs(b)

    def gamma(n: int, u: float) -> float:
        return n * u / (1 - n * u)

    return a @ b, (gamma(roundings, 2.0**-24) + gamma(k + 1, 2.0**-53)) * mag


def test_native_scaled_mm_vs_emulation():
    # torch's CPU _scaled_mm and the emulation's torch.mm are BLAS GEMMs: each sums K exact
    # FP8 x FP8 products in FP32 in an order its kernel picks (it differs between CPUs and thread
    # counts), so they are compared with the exact product within the FP32 bound, not bit for bit
    a, b = torch.randn(64, 256, generator=gen(11)), torch.randn(256, 48, generator=gen(12))
    k = a.shape[1]
    for fa, fb in (("e4m3", "e4m3"), ("e5m2", "e4m3")):
        for scaling in ("pow2_down", None):
            qa, qb = quantize(a, fa, scaling=scaling), quantize(b, fb, scaling=scaling)
            # K roundings of the sum, + 2: the dequantized operands (native on CPU multiplies
            # them) or sa * sb and the output scaling (the emulation, like cuBLAS); exact for
            # power-of-two scales
            exact, bound = _fp32_dot_bound(qa, qb, k + 2)
            nat, emu = qmatmul(qa, qb, native=True), qmatmul(qa, qb)
            deq = qa.dequantize() @ qb.dequantize()
            # another legitimate order, computed without BLAS: K rounded products summed from
            # the last K index down (numpy's elementwise float32 ops are IEEE, not contracted)
            da, db = qa.dequantize().numpy(), qb.dequantize().numpy()
            rev = np.zeros((a.shape[0], b.shape[1]), F32)
            for i in reversed(range(k)):
                rev += da[:, i, None] * db[None, i, :]
            for name, out in (("native", nat), ("emulation", emu), ("dequantized", deq),
                              ("reversed", torch.from_numpy(rev))):  # fmt: skip
                err = np.abs(out.double().numpy() - exact)
                assert (err <= bound).all(), (fa, fb, scaling, name, float((err - bound).max()))


def test_out_format_rounding():
    a, b = torch.randn(8, 64, generator=gen(13)), torch.randn(64, 8, generator=gen(14))
    out32 = qmatmul(a, b, spec=QuantSpec("e4m3"))
    bf = qmatmul(a, b, out_format="bf16", spec=QuantSpec("e4m3"))
    assert torch.equal(bf, fp8lab.cast(out32, "bf16"))
    fp16 = qmatmul(a, b, out_format="fp16", spec=QuantSpec("e4m3"))
    assert torch.equal(fp16, fp8lab.cast(out32, "fp16", saturate=False))
    with pytest.raises(ValueError, match="out_format"):
        qmatmul(a, b, out_format="fp8", spec=QuantSpec("e4m3"))


def test_float_operands_get_transposed_spec_for_b():
    a, b = torch.randn(4, 256), torch.randn(256, 8)
    qa = quantize(a, QuantSpec("e4m3", (1, 128), "pow2_down"))
    qb = quantize(b, QuantSpec("e4m3", (128, 1), "pow2_down"))
    with pytest.raises(ValueError, match="promote_every"):
        qmatmul(qa, qb, "limited")
    out = qmatmul(a, b, Accumulator("limited", promote_every=128),
                  spec=QuantSpec("e4m3", (1, 128), "pow2_down"))  # fmt: skip
    assert torch.equal(out, qmatmul(qa, qb, Accumulator("limited", promote_every=128)))


def test_bad_input():
    qa = quantize(torch.randn(4, 64), "e4m3", "mx")
    with pytest.raises(ValueError, match="mismatched K"):
        qmatmul(qa, quantize(torch.randn(32, 4), "e4m3"))
    with pytest.raises(ValueError, match="incompatible scale granularities"):
        qmatmul(qa, quantize(torch.randn(64, 64), "e4m3", "mx"))  # b tiled along N
    with pytest.raises(ValueError, match="2-D"):
        qmatmul(quantize(torch.randn(2, 4, 64), "e4m3"), quantize(torch.randn(64, 4), "e4m3"))
    with pytest.raises(ValueError, match="per-tensor e4m3/e5m2"):
        qmatmul(qa, quantize(torch.randn(64, 4), "e4m3", "mx_col"), native=True)
    with pytest.raises(ValueError, match="limited"):
        qmatmul(quantize(torch.randn(4, 64), "e4m3"), quantize(torch.randn(64, 4), "e4m3"),
                "limited", native=True)  # fmt: skip
    with pytest.raises(ValueError, match="spec"):
        qmatmul(torch.randn(4, 64), torch.randn(64, 4))
    with pytest.raises(ValueError, match="divide"):
        qmatmul(quantize(torch.randn(4, 256), "e4m3", (1, 128)),
                quantize(torch.randn(256, 4), "e4m3", (128, 128)),
                Accumulator("limited", promote_every=96))  # fmt: skip
    with pytest.raises(TypeError):
        qmatmul(qa, "b")


def test_accumulator_config():
    for acc in (Accumulator(), Accumulator("limited", 14, 32, 128, "nearest_even", True)):
        d = json.loads(json.dumps(acc.to_dict()))
        assert Accumulator.from_dict(d) == acc
    assert "promote_every" not in Accumulator().to_dict()
    assert Accumulator.parse("limited") == Accumulator(kind="limited")
    for kw in ({"kind": "fp16"}, {"mantissa_bits": 0}, {"group": 0},
               {"promote_every": 48}, {"rounding": "up"}):  # fmt: skip
        with pytest.raises(ValueError):
            Accumulator(**kw)
    with pytest.raises(ValueError, match="unknown Accumulator keys"):
        Accumulator.from_dict({"kind": "fp32", "bits": 3})
    with pytest.raises(TypeError):
        Accumulator.parse(3)
