"""fp8lab.distributed.comm against an exact rational model of the ring schedule.

The reference below is independent of the implementation: ranks hold their own buffers and pass
messages one hop at a time (no vectorised chunk indexing), and every float32 / bf16 / fp8 rounding
is done exactly on `fractions.Fraction` values by a round-to-nearest-even written here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from fp8lab.distributed.comm import GRAD_COMMS, bytes_per_rank, msamp_scale, ring_allreduce

# (mantissa bits, min normal exponent, max finite)
F32 = (23, -126, Fraction((2 - Fraction(1, 2**23)) * 2**127))
BF16 = (7, -126, Fraction((2 - Fraction(1, 2**7)) * 2**127))
E5M2 = (2, -14, Fraction(57344))
E4M3 = (3, -6, Fraction(448))


def rnd(x: Fraction, fmt: tuple, stats: dict | None = None) -> Fraction:
    """Round-to-nearest-even onto ``fmt``'s grid (unbounded exponent), then saturate to max."""
    mbits, emin, fmax = fmt
    if stats is not None:
        stats["n"] += 1
    if x == 0:
        return Fraction(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - mbits)
    k = a / quantum
    f = math.floor(k)
    r = k - f
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and f % 2 == 1):
        f += 1
    out = f * quantum
    if stats is not None:
        stats["under"] += out == 0
        stats["over"] += out > fmax
    out = min(out, fmax)
    return out if x > 0 else -out


def f32(x: Fraction) -> Fraction:
    return rnd(x, F32)


def quant_fp8_current(msg: list[Fraction], stats: dict) -> list[Fraction]:
    """E5M2 with TE current scaling of the message: cast(x * scale) * fl(1/scale)."""
    amax = max((abs(v) for v in msg), default=Fraction(0))
    scale = f32(E5M2[2] / amax) if amax > 0 else Fraction(1)
    inv = f32(1 / scale)
    return [f32(rnd(f32(v * scale), E5M2, stats) * inv) for v in msg]


def split(n: int, parts: int) -> list[int]:
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def reference(grads: list[list[float]], precision: str) -> tuple[list[Fraction], dict, list]:
    """The averaged gradient of the ring all-reduce, the wire counters, bytes sent per rank."""
    n, numel = len(grads), len(grads[0])
    stats = {"n": 0, "under": 0, "over": 0}
    sent = [0] * n
    wire = {"fp32": 4, "bf16": 2, "fp8": 1, "fp8-msamp": 1}[precision]
    sizes = split(numel, n)
    starts = [sum(sizes[:c]) for c in range(n)]
    if precision == "fp8-msamp":
        root = Fraction(float(torch.tensor(math.sqrt(n), dtype=torch.float32)))
        pre = [[f32(Fraction(v) / root) for v in g] for g in grads]
        amax = max(abs(Fraction(v)) for g in grads for v in g)
        scale = Fraction(1)
        if amax > 0:
            e = 0
            while Fraction(2) ** (e + 1) <= E4M3[2] / amax:
                e += 1
            while Fraction(2) ** e > E4M3[2] / amax:
                e -= 1
            scale = Fraction(2) ** e
        local = [[rnd(f32(v * scale), E4M3, stats) for v in g] for g in pre]
        add = lambda p, x: rnd(p + x, E4M3, stats)  # noqa: E731
        for r in range(n):
            sent[r] += 4 * (n - 1)  # the amax all-reduce
    else:
        local = [[f32(Fraction(v) / n) for v in g] for g in grads]
        if precision == "bf16":
            local = [[rnd(v, BF16) for v in g] for g in local]
            add = lambda p, x: rnd(f32(p + x), BF16, stats)  # noqa: E731
        else:
            add = lambda p, x: f32(p + x)  # noqa: E731
    bufs = [[g[starts[c] : starts[c] + sizes[c]] for c in range(n)] for g in local]
    # reduce-scatter: at step s rank r sends chunk (r - s) % n to rank r + 1
    for s in range(n - 1):
        msgs = []
        for r in range(n):
            c = (r - s) % n
            msg = bufs[r][c]
            if precision == "fp8":
                msg = quant_fp8_current(msg, stats)
                sent[r] += 4
            sent[r] += wire * len(msg)
            msgs.append((r, c, msg))
        for r, c, msg in msgs:
            dst = (r + 1) % n
            bufs[dst][c] = [add(m, x) for m, x in zip(msg, bufs[dst][c], strict=True)]
    # all-gather: the owner of chunk c is rank c - 1; it is forwarded n - 1 hops
    result = []
    for c in range(n):
        owner = (c - 1) % n
        chunk = bufs[owner][c]
        if precision == "fp8":
            chunk = quant_fp8_current(chunk, stats)
        for hop in range(n - 1):
            sent[(owner + hop) % n] += wire * len(chunk) + (4 if precision == "fp8" else 0)
        result += chunk
    if precision == "fp8-msamp":
        result = [f32(f32(v / scale) / root) for v in result]
    return result, stats, sent


def edge_grads(n: int, numel: int, seed: int) -> torch.Tensor:
    """Magnitudes over ~50 binades, exact zeros, cancelling pairs, fp32 subnormals, ties."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, numel, generator=gen) * torch.exp(torch.randn(n, numel, generator=gen) * 6)
    g[:, 0] = 0.0
    if numel > 3 and n > 1:
        g[0, 1], g[1, 1] = 3.0, -3.0  # cancels to exactly 0 (with the other ranks' zeros)
        g[2:, 1] = 0.0
        g[:, 2] = 1.0e-40  # float32 subnormal
        g[:, 3] = 1.125 * 2.0**-12  # sums land on E5M2/E4M3 ties
    return g


CASES = [(2, 7), (3, 13), (4, 9), (5, 16), (3, 2)]


@pytest.mark.parametrize("precision", GRAD_COMMS)
@pytest.mark.parametrize(("n", "numel"), CASES)
def test_ring_matches_exact_reference(precision: str, n: int, numel: int) -> None:
    for seed in range(3):
        g = edge_grads(n, numel, seed)
        res = ring_allreduce(g, precision)
        ref, stats, sent = reference(g.tolist(), precision)
        got = [Fraction(v) for v in res.out.tolist()]
        assert got == ref, (precision, n, numel, seed)
        if precision != "fp32":
            assert (res.messages, res.underflow, res.overflow) == (
                stats["n"], stats["under"], stats["over"],
            )  # fmt: skip
        assert res.bytes_per_rank == pytest.approx(sum(sent) / n, rel=1e-12)


@pytest.mark.parametrize("precision", GRAD_COMMS)
def test_buckets_are_reduced_alone(precision: str) -> None:
    g = edge_grads(3, 11, 7)
    res = ring_allreduce(g, precision, bucket_numel=4)
    want = torch.cat([ring_allreduce(g[:, i : i + 4], precision).out for i in range(0, 11, 4)])
    assert torch.equal(res.out, want)
    assert res.bytes_per_rank == sum(
        bytes_per_rank(min(4, 11 - i), 3, precision) for i in range(0, 11, 4)
    )


def test_overflow_and_underflow_are_counted() -> None:
    # fp8-msamp: 4 equal ranks at the amax sum to 2x the scaled max -> saturated partial sums
    g = torch.full((4, 8), 3.0)
    res = ring_allreduce(g, "fp8-msamp")
    assert res.overflow > 0
    assert torch.all(res.out < 3.0)  # saturated: the mean is lost
    # fp8 current scaling: an element 2**-40 below the message amax underflows E5M2 (32 binades)
    g = torch.zeros(2, 4)
    g[:, 0], g[:, 1] = 1.0, 2.0**-40
    res = ring_allreduce(g, "fp8")
    assert res.underflow > 0 and res.out[1] == 0


def test_msamp_scale_is_floor_power_of_two() -> None:
    for amax in (448.0, 449.0, 447.9, 1.0, 3.5, 2.0**-20, 1e-3):
        s = float(msamp_scale(torch.tensor(amax)))
        assert math.log2(s).is_integer()
        assert s * amax <= 448.0 < 2 * s * amax
    assert float(msamp_scale(torch.tensor(0.0))) == 1.0
    assert float(msamp_scale(torch.tensor(float("nan")))) == 1.0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="fp4"):
        ring_allreduce(torch.zeros(2, 3), "fp4")
    with pytest.raises(ValueError, match="float32"):
        ring_allreduce(torch.zeros(2, 3, dtype=torch.float64))


def test_single_rank_is_identity_fp32() -> None:
    g = edge_grads(1, 5, 0)
    assert torch.equal(ring_allreduce(g, "fp32").out, g[0])
    assert ring_allreduce(g, "fp8").bytes_per_rank == 0.0
