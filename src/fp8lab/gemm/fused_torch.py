"""The ``fused`` accumulator as device-generic torch tensor operations, bit for bit the numba
kernels of `fp8lab.gemm.fused` (``_step64`` and its fast FP8 variant, which is proven equal to it).

Every output element's chain of MMA steps is sequential along K, so the kernels loop over the K
groups and vectorise each step over a tile of output elements and the group's ``G`` products
(``[rows, cols, G]`` float64). The arithmetic is the reference transcription's:

* products ``a * b`` of format values are exact in float64, and so is every aligned term
  ``trunc(p * 2**F / 2**E)`` (an integer below ``2**(F + 2)``); their sum is exact in any order
  while ``(G + 1) * 2**(F + 2) <= 2**53`` (every GPU row: F <= 25, G <= 32), so torch's reduction
  order cannot change a bit. Larger user configurations sum the terms in K order, as numba does.
* ``align_bits=None`` (B200 ``mma.sync`` FP8) needs the exact sum of products spanning up to
  ~520 bits (bf16): it is carried in int64 limbs of 40 bits below the group's largest product
  (`_exact_sum_rz`), then cut toward zero to ``out_bits``.
* rounding to ``out_bits`` works on the float64 bit pattern (powers of two built from exponent
  bits, never ``exp2``), so nothing depends on a device's transcendental functions or on
  flush-to-zero: PyTorch's CUDA kernels keep FP32/FP64 subnormals.

Memory: a tile holds ``lanes x group-block`` float64 elements (`_budget`: 2**22 on the CPU,
2**24 = 128 MiB on an accelerator), so an [M, N, K] problem never materialises more than that.
NaN results carry the device's NaN bit pattern: tests compare NaN positions, not payloads.
"""

from __future__ import annotations

import torch

from fp8lab.formats import get_format
from fp8lab.gemm.accumulator import Accumulator

__all__ = [
    "exact_sum_rz", "fused_dots_torch", "fused_gemm_torch", "pow2_exponents", "round_out",
]  # fmt: skip

_LIMB = 40  # bits per lower limb of the exact sum


def pow2_exponents(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """``2**e_x`` per element (float32), ``e_x = max(floor(log2|x|), emin(fmt))``; 0 for zeros.

    ``values`` are float32 on ``fmt``'s grid; FP32 subnormals (bf16's) take the emin floor."""
    v = values.to(torch.float32).contiguous()
    p = (v.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2|x|), 0 if tiny
    p = torch.clamp_min_(p, 2.0 ** get_format(fmt).emin)
    return p.masked_fill_(v == 0, 0.0)


def _budget(device: torch.device) -> int:
    """float64 elements per intermediate tile: cache-sized on the CPU, 128 MiB elsewhere."""
    return 1 << 22 if device.type == "cpu" else 1 << 24


def _block_k(device: torch.device) -> int:
    """K elements per block of products: 256 on the CPU (fewer, cache-sized calls); 64 on an
    accelerator, where a wider tile of lanes means fewer kernel launches per step."""
    return 256 if device.type == "cpu" else 64


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """float64 ``2**e`` for int64 ``e`` in [-1022, 1023], built from the exponent bits."""
    return ((e + 1023) << 52).view(torch.float64)


def _exp64(v: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of float64 ``v`` (int64; -1023 for zero, 1024 for inf/NaN)."""
    return ((v.view(torch.int64) >> 52) & 0x7FF) - 1023


def round_out(v: torch.Tensor, out_bits: int, rne: bool) -> torch.Tensor:
    """float64 ``v`` (exact) rounded to ``out_bits`` fraction bits with FP32's exponent floor
    -126 -> float32, as numba's ``_round_out``: 0 -> +0, a nonzero value cut to zero keeps its
    sign, ``>= 2**128`` -> inf (the float32 conversion of a value on the grid), inf/NaN kept."""
    fin = torch.isfinite(v)
    q = torch.where(fin, torch.clamp_min(_exp64(v), -126) - out_bits, 0)
    x = v * _pow2(-q)  # exact: a power of two
    x = torch.round(x) if rne else torch.trunc(x)  # torch.round: half to even
    r = x * _pow2(q)
    zero = torch.where(v < 0, -0.0, 0.0).to(torch.float64)
    r = torch.where((r == 0) & (v != 0), zero, r)
    r = torch.where(v == 0, 0.0, r)
    return torch.where(fin, r, v).to(torch.float32)


def _carry(limbs: torch.Tensor) -> torch.Tensor:
    """Limbs (int64 [..., J], limb j worth ``2**(-40 j)`` of limb 0) with every lower limb
    brought into [0, 2**40) by carries into the limb above; the value is unchanged."""
    limbs = limbs.clone()
    for j in range(limbs.shape[-1] - 1, 0, -1):
        c = torch.div(limbs[..., j], 1 << _LIMB, rounding_mode="floor")
        limbs[..., j] -= c << _LIMB
        limbs[..., j - 1] += c
    return limbs


def exact_sum_rz(prod: torch.Tensor, out_bits: int) -> torch.Tensor:
    """Exact sum of float64 ``prod`` [..., G] cut toward zero to ``out_bits`` (FP32 range) ->
    float32 [...]: numba's ``_exact_sum_rz`` (Shewchuk partials) by int64 limbs.

    Each product (at most 22 significant bits) splits into integer multiples of a limb unit:
    the top limb's unit gives the group's largest product ``52 - bitlen(G)`` bits, each lower
    limb 40 more, so limb sums are exact in int64. After carries the sign and the two leading
    nonzero limbs decide the truncated result exactly. A non-finite product gives the IEEE sum."""
    g = prod.shape[-1]
    top = 52 - g.bit_length()
    if top < 8:
        raise ValueError(f"exact fused sums take groups below 2**44 products, got {g}")
    fin = torch.isfinite(prod).all(-1)
    p = torch.where(fin.unsqueeze(-1), prod, 0.0)
    amax = p.abs().amax(-1)
    ue = torch.where(amax > 0, _exp64(amax) + 1 - top, 0)
    limbs, rest, e = [], p, ue
    while True:
        unit = _pow2(e).unsqueeze(-1)
        h = torch.trunc(rest / unit)  # exact: below 2**top (top limb) or 2**40
        limbs.append(h.to(torch.int64).sum(-1))
        rest = rest - h * unit  # exact: the bits below the limb
        if not bool((rest != 0).any()):
            break
        e = e - _LIMB
    lim = _carry(torch.stack([*limbs, torch.zeros_like(limbs[0])], -1))
    neg = lim[..., 0] < 0
    lim = torch.where(neg.unsqueeze(-1), _carry(-lim), lim)
    nz = lim != 0
    lead = nz.to(torch.int32).argmax(-1, keepdim=True)  # the first nonzero limb
    lead = torch.clamp_max(lead, lim.shape[-1] - 2).to(torch.int64)
    a1 = lim.gather(-1, lead).squeeze(-1).to(torch.float64)
    a2 = lim.gather(-1, lead + 1).squeeze(-1).to(torch.float64)
    u1 = ue - _LIMB * lead.squeeze(-1)
    v1 = a1 * _pow2(u1)
    v2 = a2 * _pow2(u1 - _LIMB)
    qe = torch.clamp_min(_exp64(torch.where(a1 != 0, v1, v2)), -126) - out_bits
    q = _pow2(qe)
    r = torch.floor(v1 / q) * q + torch.floor(v2 / q) * q  # |S| cut to the grid, exact
    nonzero = nz.any(-1)
    r = torch.where(neg, -r, r)
    r = torch.where((r == 0) & neg, -0.0, r)
    r = torch.where(nonzero, r, 0.0).to(torch.float32)  # >= 2**128: inf by the conversion
    return torch.where(fin, r, prod.sum(-1).to(torch.float32))


def _aligned_terms_exact(acc: Accumulator) -> bool:
    """Is the float64 sum of the aligned terms exact in any order (see the module doc)?"""
    return (acc.group + 1) * 2 ** (acc.align_bits + 2) <= 2**53


def _step(
    c: torch.Tensor, prod: torch.Tensor, pmax: torch.Tensor, acc: Accumulator
) -> torch.Tensor:
    """One fused MMA step for every lane: numba's ``_step64``.

    Args:
        c: float32 [...] accumulators in.
        prod: float64 [..., G] exact products ``a_k * b_k`` of the group (zeros for padding).
        pmax: float64 [...] the largest ``2**(e_a + e_b)`` over pairs with both factors nonzero.
        acc: the resolved fused accumulator.

    Returns:
        float32 [...] accumulators out.
    """
    c_after = acc.c_entry == "after"
    if acc.align_bits is None:  # exact sum; an aligned c is one more term of it
        if c_after:
            return exact_sum_rz(prod, acc.out_bits) + c
        return exact_sum_rz(torch.cat([prod, c.to(torch.float64).unsqueeze(-1)], -1), acc.out_bits)
    c64 = c.to(torch.float64)
    cfin = torch.isfinite(c)
    aligned = torch.zeros_like(cfin) if c_after else c != 0
    e_c = ((c.view(torch.int32) >> 23) & 0xFF).to(torch.int64) - 127
    pc = _pow2(torch.clamp_min(e_c, -126))  # 2**max(e_c, -126): FP32 subnormals at -126
    p = torch.where(aligned & cfin, torch.maximum(pmax, pc), pmax)
    no_terms = p == 0
    p = torch.clamp_min(p, 2.0**acc.exp_floor)
    scl = 2.0**acc.align_bits / p  # exact: powers of two (0 when p is inf)
    s = torch.where(aligned, torch.trunc(c64 * scl) + 0.0, 0.0)
    # the terms trunc(prod * scl) in one pass as trunc(prod / (p / 2**F)): the same exact
    # power-of-two scaling (an inf p gives 0 for finite and NaN for inf products, as numba)
    unit = p * 2.0**-acc.align_bits
    if prod.dtype == torch.float32:  # FP8 fast domain (`fused_gemm_torch`): float32 is exact
        # a lane without products has only zero terms: keep its unit a normal float32
        unit = torch.clamp_min(unit, 2.0**-100).to(torch.float32)
        terms = torch.div(prod, unit.unsqueeze(-1), rounding_mode="trunc")
        s = s + terms.sum(-1).to(torch.float64)
    elif _aligned_terms_exact(acc):
        s = s + torch.div(prod, unit.unsqueeze(-1), rounding_mode="trunc").sum(-1)
    else:  # a sum that can round: numba's K order
        terms = torch.div(prod, unit.unsqueeze(-1), rounding_mode="trunc")
        for j in range(terms.shape[-1]):
            s = s + terms[..., j]
    res = round_out(s / scl, acc.out_bits, acc.out_rounding == "nearest_even")
    res = torch.where(no_terms, 0.0, res)
    if c_after:
        res = res + c
    # an inf/NaN accumulator: the hardware propagates it (0 * inf turns it into NaN)
    return torch.where(aligned & ~cfin, (c64 + 0.0 * pmax).to(torch.float32), res)


def _pad_k(x: torch.Tensor, kp: int, dim: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``kp``: (0, 0) pairs are no terms and add exact 0."""
    pad = kp - x.shape[dim]
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad) if dim == 1 else (0, 0, 0, pad))


def _block_products(va, pa, vb_t, pb_t, k0: int, k1: int, group: int, finite: bool = False):
    """Products [..., nb, G] and their exponent maxima [..., nb] for K range [k0, k1) of
    ``va``/``pa`` and ``vb_t``/``pb_t`` (broadcast against each other: [R, 1, K] x [1, C, K]
    for a GEMM tile, [S, K] x [S, K] for dots). ``finite``: no inf/NaN operand (skips a pass)."""
    prod = va[..., k0:k1] * vb_t[..., k0:k1]
    ex = pa[..., k0:k1] * pb_t[..., k0:k1]  # 2**(e_a + e_b)
    if not finite:  # inf * 0 (an inf/NaN operand against a zero) is no term, as numba skips it
        ex = torch.nan_to_num(ex, nan=0.0, posinf=float("inf"))
    shape = (*prod.shape[:-1], (k1 - k0) // group, group)
    return prod.reshape(shape), ex.reshape(shape).amax(-1)


def fused_gemm_torch(
    va: torch.Tensor,
    pa: torch.Tensor,
    vb: torch.Tensor,
    pb: torch.Tensor,
    accbuf: torch.Tensor,
    out: torch.Tensor,
    sa: torch.Tensor | None,
    sb: torch.Tensor | None,
    acc: Accumulator,
    gpp: int,
    fast: bool = False,
) -> None:
    """The fused model over ``va``/``pa`` [M, K] and ``vb``/``pb`` [K, N] (values and
    ``pow2_exponents``), in place: ``accbuf`` [M, N] float32 holds c in and the chain's last
    result out; with ``gpp`` > 0 (groups per promotion) every ``gpp`` groups and the last the
    step result is promoted, ``out += (sa[:, t] * sb[t]) * acc`` in FP32, and restarts at 0.

    ``fast``: finite FP8 operands under a model where `fast_path_applies` (numba's fast kernel
    domain): products and terms in float32, exact there (terms below ``2**15``, their sum below
    ``2**24``); the operands may then be float32. Otherwise they must be float64."""
    m, k = va.shape
    n = vb.shape[1]
    g = acc.group
    ng = -(-k // g)
    kp = ng * g
    va, pa = _pad_k(va, kp, 1), _pad_k(pa, kp, 1)
    vb_t, pb_t = _pad_k(vb, kp, 0).t().contiguous(), _pad_k(pb, kp, 0).t().contiguous()
    gpb = max(1, _block_k(va.device) // g)  # groups per block of products
    lanes = max(1, _budget(va.device) // (gpb * g))
    nc = min(n, 512, lanes)
    mc = min(m, max(1, lanes // nc))
    for r0 in range(0, m, mc):
        r1 = min(r0 + mc, m)
        for n0 in range(0, n, nc):
            n1 = min(n0 + nc, n)
            run = accbuf[r0:r1, n0:n1].clone()
            for b0 in range(0, ng, gpb):
                b1 = min(b0 + gpb, ng)
                prod, pmax = _block_products(
                    va[r0:r1, None], pa[r0:r1, None], vb_t[None, n0:n1], pb_t[None, n0:n1],
                    b0 * g, b1 * g, g, fast,
                )  # fmt: skip
                for j in range(b1 - b0):
                    run = _step(run, prod[:, :, j], pmax[:, :, j], acc)
                    gi = b0 + j
                    if gpp > 0 and ((gi + 1) % gpp == 0 or gi == ng - 1):
                        t = gi // gpp
                        out[r0:r1, n0:n1].add_((sa[r0:r1, t : t + 1] * sb[t : t + 1, n0:n1]) * run)
                        run = torch.zeros_like(run)
            accbuf[r0:r1, n0:n1] = run


def fused_dots_torch(
    va: torch.Tensor, pa: torch.Tensor, vb: torch.Tensor, pb: torch.Tensor, c: torch.Tensor,
    acc: Accumulator,
) -> torch.Tensor:  # fmt: skip
    """Row-wise dot products ``va[s] . vb[s]`` ([S, K] float64 values, ``pa``/``pb`` their
    ``pow2_exponents``) chained over K steps from ``c`` [S] float32; returns float32 [S]."""
    s, k = va.shape
    g = acc.group
    ng = -(-k // g)
    kp = ng * g
    va, pa, vb, pb = (_pad_k(x, kp, 1) for x in (va, pa, vb, pb))
    rows = max(1, _budget(va.device) // max(kp, 1))
    out = c.clone()
    for r0 in range(0, s, rows):
        r1 = min(r0 + rows, s)
        prod, pmax = _block_products(va[r0:r1], pa[r0:r1], vb[r0:r1], pb[r0:r1], 0, kp, g)
        run = out[r0:r1]
        for j in range(ng):
            run = _step(run, prod[:, j], pmax[:, j], acc)
        out[r0:r1] = run
    return out
