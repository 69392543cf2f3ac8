"""The ``fused`` accumulator: NVIDIA tensor cores' fused block FMA, bit for bit.

The published model (Khattak & Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv
2512.07004, validated against H100/H200/Ada/L40S/B200 outputs; Xie et al., MMA-Sim, arXiv
2511.10909). One MMA step takes ``G`` products ``p_i = a_i * b_i`` and the FP32 accumulator
``c``:

1. Each operand is ``x = s_x * 2**e_x`` with ``e_x = max(floor(log2|x|), emin)`` of its format
   (subnormals keep ``|s| < 1``). A product keeps exponent ``e_a + e_b`` and its exact
   significand ``s_a * s_b`` in ``[0, 4)``: it is not renormalised. Zero products are no terms.
   A nonzero ``c`` is a term with ``e_c = max(floor(log2|c|), -126)`` (FP32's own emin: a
   subnormal c keeps ``|s| < 1``, as in the authors' model); a zero ``c`` is no term.
2. ``E`` = the largest exponent among the terms, floored at ``exp_floor`` (-133; Ada -132).
3. Every term is truncated toward zero to a multiple of ``2**(E - F)`` (``F = align_bits``).
4. The truncated terms are summed exactly (no carry limit); an exact zero is +0. The sum is
   normalised and rounded to ``out_bits`` fraction bits (toward zero; ``nearest_even`` for FP16
   destinations) with FP32's exponent range: exponent floor -126 (results below 2**-126 keep
   the quantum ``2**(-126 - out_bits)``), and a magnitude >= 2**128 is ±inf.
5. Over K the steps chain: the next step's ``c`` is this step's result.

``c_entry="after"`` (B200 ``mma.sync`` FP8): the G products are summed exactly, rounded toward
zero to ``out_bits`` (23), then ``c`` is added with one FP32 round-to-nearest-even addition.
``align_bits=None`` is that exact sum (with ``c_entry="aligned"`` c is one more term of it),
cut toward zero whatever ``out_rounding`` says.

Promotion (``promote_every = N_C``): after every N_C K elements the step result is added to an
FP32 total with the K group's scales, ``total += (sa * sb) * acc``, and the chain restarts at 0
(DeepSeek-V3's promotion, DeepGEMM's ``final_accum += scale * accum``); the last, shorter
interval is promoted too. Without promotion the chain's result is multiplied by the K-constant
scales at the end (as cuBLAS's epilogue does).

Two kernels compute the model. ``_step64`` is the reference transcription (float64, one output
element and one step at a time); ``_fused_fast`` is the FP8 fast path: float32 SIMD over a tile
of output columns, exact because every term ``trunc(a * b * 2**(F - E))`` is an integer below
2**15 and their sum below 2**24 (checked by `fast_path_applies`); lanes whose ``E`` is out of its
safe range (no nonzero product and a tiny or huge ``c``) fall back to ``_step64``. Both are
tested against an exact-rational transcription of the steps above (tests/gemm/test_fused.py).
GEMMs with an inf/NaN operand take ``_step64`` (the fast kernel's int32 truncation would turn a
NaN term into garbage). `fp8lab.gemm.fused_torch` is the same model in torch tensor operations
for any device, bit for bit these kernels (tests/gemm/test_torch_kernels.py).
The fast kernel's two sweeps (the exponent max, the truncated terms) run over a register tile
of two output rows by 32 columns (`fp8lab.gemm.simd` vectors): each lane's running max and sum
stay in registers through the group, and each load of b (from panels packed once per GEMM,
`_pack_b`) serves both rows. The max chain keeps K order; the sums are exact integers, in any
order the same bits.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from fp8lab._bits import f32_to_u32, u32_to_f32
from fp8lab._bits import f64_to_u64 as f64_bits
from fp8lab.formats import get_format
from fp8lab.gemm.accumulator import Accumulator
from fp8lab.gemm.fused_torch import fused_dots_torch, fused_gemm_torch, pow2_exponents
from fp8lab.gemm.fused_triton import fits, fused_gemm_triton, triton_mode, verified_kernel
from fp8lab.gemm.limited import c_start, check_promotion, interval_scales, output_scales
from fp8lab.gemm.simd import (
    vadd,
    vand_bits,
    vdiv,
    vload,
    vmask_outside,
    vmax,
    vmul,
    vsplat,
    vstore,
    vtrunc_i32,
)
from fp8lab.kernels import claim, parallel, use_torch
from fp8lab.qtensor import QTensor

__all__ = ["fast_path_applies", "fused", "fused_dot", "pow2_exponents"]

_NT = 512  # output columns per job of the fast kernel (a multiple of 32; its b panels in L2)
_RB = 16  # output rows per job of the fast kernel
_LO = np.float32(2.0**-100)  # 2**E outside (_LO, _HI): a lane of the fast kernel falls back
_HI = np.float32(2.0**100)


@njit(cache=True)
def _round_out(v, out_bits, rne):  # pragma: no cover - numba
    """float64 ``v`` (exact) rounded to ``out_bits`` fraction bits, FP32 range -> float32."""
    if v == 0.0:
        return np.float32(0.0)
    e = np.int64((f64_bits(abs(v)) >> np.uint64(52)) & np.uint64(0x7FF)) - 1023
    q = max(e, -126) - out_bits
    x = v * 2.0 ** (-q)  # exact: a power of two
    x = np.rint(x) if rne else np.trunc(x)
    r = x * 2.0**q
    if abs(r) >= 2.0**128:
        return np.float32(np.inf) if r > 0 else np.float32(-np.inf)
    if r == 0.0:  # a nonzero value truncated away keeps its sign (IEEE RZ)
        return np.float32(-0.0) if v < 0 else np.float32(0.0)
    return np.float32(r)


@njit(cache=True)
def _prev_toward_zero(m, out_bits):  # pragma: no cover - numba
    """The largest value below ``m`` > 0 on the FP32 grid of ``out_bits`` fraction bits."""
    e = np.int64((f64_bits(m) >> np.uint64(52)) & np.uint64(0x7FF)) - 1023
    if m == 2.0**e and e - 1 >= -126:
        return m - 2.0 ** (e - 1 - out_bits)
    return m - 2.0 ** (max(e, -126) - out_bits)


@njit(cache=True)
def _exact_sum_rz(xs, n, out_bits):  # pragma: no cover - numba
    """Exact sum of float64 ``xs[:n]`` rounded toward zero to ``out_bits`` (FP32 range).

    Shewchuk's non-overlapping partials: the exact sum is ``hi + rest`` with ``|rest|`` below
    one ulp of ``hi``, so it truncates like ``hi`` unless ``hi`` sits on the output grid and
    ``rest`` points toward zero."""
    parts = np.empty(n + 1, dtype=np.float64)
    m = 0
    for i in range(n):
        x = xs[i]
        j = 0
        for t in range(m):
            y = parts[t]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                parts[j] = lo
                j += 1
            x = hi
        parts[j] = x
        m = j + 1
    hi = parts[m - 1] if m > 0 else 0.0
    rest = 0.0
    for t in range(m - 1):
        rest += parts[t]
    if hi == 0.0:
        return np.float32(0.0)
    r = _round_out(hi, out_bits, False)
    if np.float64(r) == hi and rest != 0.0 and (rest < 0.0) != (hi < 0.0):
        p = _prev_toward_zero(abs(hi), out_bits)
        r = np.float32(p if hi > 0 else -p) if p != 0.0 else np.float32(0.0 if hi > 0 else -0.0)
    return r


@njit(cache=True)
def _step64(c, va, pa, vb, pb, r, n, k0, k1, f_bits, out_bits, rne, c_after, floor_p):
    """One fused MMA step for output (r, n) over K range [k0, k1): the reference kernel.

    ``f_bits < 0``: exact sum (then RZ to ``out_bits``). Returns the float32 result."""
    c64 = np.float64(c)
    if f_bits < 0:  # exact sum; an aligned c is one more term of it
        xs = np.empty(k1 - k0 + 1, dtype=np.float64)
        for k in range(k0, k1):
            xs[k - k0] = np.float64(va[r, k]) * np.float64(vb[k, n])
        xs[k1 - k0] = 0.0 if c_after else c64
        s = _exact_sum_rz(xs, k1 - k0 + 1, out_bits)
        return s + np.float32(c) if c_after else s
    p = 0.0
    for k in range(k0, k1):
        if va[r, k] != 0 and vb[k, n] != 0:
            p = max(p, np.float64(pa[r, k]) * np.float64(pb[k, n]))
    aligned = not c_after and c64 != 0.0
    if aligned and np.isfinite(c64):
        e_c = np.int64((f64_bits(abs(c64)) >> np.uint64(52)) & np.uint64(0x7FF)) - 1023
        p = max(p, 2.0 ** max(e_c, -126))
    elif aligned:  # inf/nan accumulator: the hardware propagates it
        return np.float32(c64 + 0.0 * p)
    if p == 0.0:  # no terms
        return np.float32(0.0) + np.float32(c) if c_after else np.float32(0.0)
    p = max(p, floor_p)
    scl = 2.0**f_bits / p
    s = np.trunc(c64 * scl) + 0.0 if aligned else 0.0
    for k in range(k0, k1):
        s += np.trunc(np.float64(va[r, k]) * np.float64(vb[k, n]) * scl)
    res = _round_out(s / scl, out_bits, rne)
    return res + np.float32(c) if c_after else res


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _general_row(r, va, pa, vb, pb, acc, out, sa, sb, group, f_bits, out_bits, rne, c_after,
                 floor_p, gpp):  # fmt: skip  # pragma: no cover - numba
    """Row ``r`` of `_fused_general`."""
    k = va.shape[1]
    ncols = vb.shape[1]
    ng = (k + group - 1) // group
    for n in range(ncols):
        a = acc[r, n]
        for g in range(ng):
            k0 = g * group
            a = _step64(a, va, pa, vb, pb, r, n, k0, min(k0 + group, k), f_bits, out_bits,
                        rne, c_after, floor_p)  # fmt: skip
            if gpp > 0 and ((g + 1) % gpp == 0 or g == ng - 1):
                t = g // gpp
                out[r, n] += (sa[r, t] * sb[t, n]) * a
                a = np.float32(0.0)
        acc[r, n] = a


@njit(parallel=True, cache=True)
def _fused_general(va, pa, vb, pb, acc, out, sa, sb, group, f_bits, out_bits, rne, c_after,
                   floor_p, gpp, workers):  # fmt: skip  # pragma: no cover - numba
    """The model with `_step64` for every step: acc [M, N] float32 holds c in and the chain's
    last result out; with ``gpp`` > 0 (groups per promotion) steps are promoted into ``out``.
    ``workers`` threads claim the rows (`fp8lab.kernels.claim`)."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        r = claim(counter)
        while r < va.shape[0]:
            _general_row(r, va, pa, vb, pb, acc, out, sa, sb, group, f_bits, out_bits, rne,
                         c_after, floor_p, gpp)  # fmt: skip
            r = claim(counter)


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _fused_general_serial(va, pa, vb, pb, acc, out, sa, sb, group, f_bits, out_bits, rne,
                          c_after, floor_p, gpp, workers):  # fmt: skip  # pragma: no cover
    """`_fused_general` on the calling thread (`fp8lab.kernels`)."""
    for r in range(va.shape[0]):
        _general_row(r, va, pa, vb, pb, acc, out, sa, sb, group, f_bits, out_bits, rne, c_after,
                     floor_p, gpp)  # fmt: skip


@njit(cache=True, inline="always")
def _fast_block(cbuf, xa, xp, dk, nz, vbp, pbp, p0, j, scale_f, inv_f, mask):
    """One MMA step for two output rows by 32 output columns, in 2 x 4 float32 vectors: row
    ``i``'s c in ``cbuf[i, j : j + 32]``, its step result written back there. The group's K
    elements where either row's a is nonzero: row ``i``'s values ``xa[i, :nz]`` and powers of
    two ``xp[i, :nz]`` (a zero is a zero product: no term in pass 1, +0 in pass 2), their K
    offsets in the group ``dk[:nz]``; ``vbp``/``pbp`` row ``p0 + dk[q]`` holds the 32 columns'
    b values and powers of two (`_pack_b`), each load serving both rows. Per lane the
    operations of the scalar sweeps, with the running max and the sums of the truncated terms
    in registers. Returns per row the bit mask of lanes whose ``2**E`` is outside (`_LO`,
    `_HI`): those need `_step64`."""
    e = np.uint32(0x7F800000)
    c0, c1, c2, c3 = (vload(cbuf, 0, j), vload(cbuf, 0, j + 8), vload(cbuf, 0, j + 16),
                      vload(cbuf, 0, j + 24))  # fmt: skip
    d0, d1, d2, d3 = (vload(cbuf, 1, j), vload(cbuf, 1, j + 8), vload(cbuf, 1, j + 16),
                      vload(cbuf, 1, j + 24))  # fmt: skip
    # pass 1: 2**E = max(2**e_c, max 2**(e_a + e_b)); zeros give 0 (no term)
    m0, m1, m2, m3 = vand_bits(c0, e), vand_bits(c1, e), vand_bits(c2, e), vand_bits(c3, e)
    n0, n1, n2, n3 = vand_bits(d0, e), vand_bits(d1, e), vand_bits(d2, e), vand_bits(d3, e)
    for q in range(nz):
        x, y = vsplat(xp[0, q]), vsplat(xp[1, q])
        row = p0 + dk[q]
        b = vload(pbp, row, 0)
        m0, n0 = vmax(m0, vmul(x, b)), vmax(n0, vmul(y, b))
        b = vload(pbp, row, 8)
        m1, n1 = vmax(m1, vmul(x, b)), vmax(n1, vmul(y, b))
        b = vload(pbp, row, 16)
        m2, n2 = vmax(m2, vmul(x, b)), vmax(n2, vmul(y, b))
        b = vload(pbp, row, 24)
        m3, n3 = vmax(m3, vmul(x, b)), vmax(n3, vmul(y, b))
    # pass 2: the terms truncated to multiples of 2**(E - F) (the int32 conversion; every term
    # is below 2**15 and an exact zero comes back +0), summed exactly in units of 2**(E - F)
    sf = vsplat(scale_f)
    sc0, sc1, sc2, sc3 = vdiv(sf, m0), vdiv(sf, m1), vdiv(sf, m2), vdiv(sf, m3)
    sd0, sd1, sd2, sd3 = vdiv(sf, n0), vdiv(sf, n1), vdiv(sf, n2), vdiv(sf, n3)
    s0, s1 = vtrunc_i32(vmul(c0, sc0)), vtrunc_i32(vmul(c1, sc1))
    s2, s3 = vtrunc_i32(vmul(c2, sc2)), vtrunc_i32(vmul(c3, sc3))
    t0, t1 = vtrunc_i32(vmul(d0, sd0)), vtrunc_i32(vmul(d1, sd1))
    t2, t3 = vtrunc_i32(vmul(d2, sd2)), vtrunc_i32(vmul(d3, sd3))
    for q in range(nz):
        x, y = vsplat(xa[0, q]), vsplat(xa[1, q])
        row = p0 + dk[q]
        b = vload(vbp, row, 0)
        s0 = vadd(s0, vtrunc_i32(vmul(vmul(x, b), sc0)))
        t0 = vadd(t0, vtrunc_i32(vmul(vmul(y, b), sd0)))
        b = vload(vbp, row, 8)
        s1 = vadd(s1, vtrunc_i32(vmul(vmul(x, b), sc1)))
        t1 = vadd(t1, vtrunc_i32(vmul(vmul(y, b), sd1)))
        b = vload(vbp, row, 16)
        s2 = vadd(s2, vtrunc_i32(vmul(vmul(x, b), sc2)))
        t2 = vadd(t2, vtrunc_i32(vmul(vmul(y, b), sd2)))
        b = vload(vbp, row, 24)
        s3 = vadd(s3, vtrunc_i32(vmul(vmul(x, b), sc3)))
        t3 = vadd(t3, vtrunc_i32(vmul(vmul(y, b), sd3)))
    # normalise: RZ to out_bits fraction bits is a mask of the (integer, normal) float32 sum;
    # scaling back by 2**(E - F) is exact (or overflows to inf)
    fi = vsplat(inv_f)
    vstore(cbuf, 0, j, vmul(vand_bits(s0, mask), vmul(m0, fi)))
    vstore(cbuf, 0, j + 8, vmul(vand_bits(s1, mask), vmul(m1, fi)))
    vstore(cbuf, 0, j + 16, vmul(vand_bits(s2, mask), vmul(m2, fi)))
    vstore(cbuf, 0, j + 24, vmul(vand_bits(s3, mask), vmul(m3, fi)))
    vstore(cbuf, 1, j, vmul(vand_bits(t0, mask), vmul(n0, fi)))
    vstore(cbuf, 1, j + 8, vmul(vand_bits(t1, mask), vmul(n1, fi)))
    vstore(cbuf, 1, j + 16, vmul(vand_bits(t2, mask), vmul(n2, fi)))
    vstore(cbuf, 1, j + 24, vmul(vand_bits(t3, mask), vmul(n3, fi)))
    bad0 = (
        vmask_outside(m0, _LO, _HI)
        | (vmask_outside(m1, _LO, _HI) << 8)
        | (vmask_outside(m2, _LO, _HI) << 16)
        | (vmask_outside(m3, _LO, _HI) << 24)
    )
    bad1 = (
        vmask_outside(n0, _LO, _HI)
        | (vmask_outside(n1, _LO, _HI) << 8)
        | (vmask_outside(n2, _LO, _HI) << 16)
        | (vmask_outside(n3, _LO, _HI) << 24)
    )
    return bad0, bad1


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _fast_job(
    job, va, pa, vb, pb, vbp, pbp, acc, out, sa, sb, group, f_bits, out_bits, floor_p, gpp
):  # pragma: no cover
    """Job ``job`` of `_fused_fast`: `_RB` output rows by `_NT` output columns, two rows at a
    time (an odd last row is paired with itself) in blocks of 32 columns (`_fast_block`; the
    last block's lanes past N compute on zero padding and are not kept)."""
    m, k = va.shape
    ncols = acc.shape[1]
    ng = (k + group - 1) // group
    nb = (ncols + 31) // 32
    ntiles = (ncols + _NT - 1) // _NT
    scale_f = np.float32(2.0**f_bits)
    inv_f = np.float32(2.0**-f_bits)
    mask = np.uint32((0xFFFFFFFF << (23 - out_bits)) & 0xFFFFFFFF)
    n0 = (job % ntiles) * _NT
    r0 = (job // ntiles) * _RB
    w = min(n0 + _NT, ncols) - n0
    cbuf = np.zeros((2, _NT), dtype=np.float32)
    bad = np.zeros((2, _NT // 32), dtype=np.int64)
    xa = np.empty((2, group), dtype=np.float32)
    xp = np.empty((2, group), dtype=np.float32)
    dk = np.empty(group, dtype=np.int64)
    for g in range(ng):
        k0 = g * group
        k1 = min(k0 + group, k)
        promote = gpp > 0 and ((g + 1) % gpp == 0 or g == ng - 1)
        for rp in range(r0, min(r0 + _RB, m), 2):
            rr = (rp, min(rp + 1, m - 1))
            nrows = min(rp + 2, m) - rp
            # the group's K elements where either row's a is nonzero, in K order
            nz = 0
            for kk in range(k0, k1):
                u, v = va[rr[0], kk], va[rr[1], kk]
                if u != 0 or v != 0:
                    xa[0, nz], xa[1, nz] = u, v
                    xp[0, nz], xp[1, nz] = pa[rr[0], kk], pa[rr[1], kk]
                    dk[nz] = kk - k0
                    nz += 1
            for i in range(2):
                ar = acc[rr[i], n0 : n0 + w]
                for j in range(w):
                    cbuf[i, j] = ar[j]
            anybad = 0
            for j in range(0, w, 32):
                p0 = (g * nb + (n0 + j) // 32) * group
                b0, b1 = _fast_block(cbuf, xa, xp, dk, nz, vbp, pbp, p0, j, scale_f, inv_f, mask)
                bad[0, j // 32], bad[1, j // 32] = b0, b1
                anybad |= b0 | b1
            for i in range(nrows):
                r = rr[i]
                ar = acc[r, n0 : n0 + w]
                if anybad:  # no nonzero product and c tiny, huge or not finite: the reference
                    for j in range(w):
                        if (bad[i, j // 32] >> (j % 32)) & 1:
                            cbuf[i, j] = _step64(ar[j], va, pa, vb, pb, r, n0 + j, k0, k1,
                                                 f_bits, out_bits, False, False, floor_p)  # fmt: skip
                for j in range(w):
                    ar[j] = cbuf[i, j]
                if promote:
                    t = g // gpp
                    srt = sa[r, t]
                    outr = out[r, n0 : n0 + w]
                    sbt = sb[t, n0 : n0 + w]
                    for j in range(w):
                        outr[j] += (srt * sbt[j]) * ar[j]
                        ar[j] = np.float32(0.0)


@njit(cache=True)
def _pack_b(v, p, vbp, pbp, group):  # pragma: no cover - numba
    """b's values ``v`` and powers of two ``p`` [K, N] (C-contiguous) into the panels
    `_fast_block` reads: ``vbp[(g * nb + jb) * group + q, i] = v[g * group + q, 32 * jb + i]``
    (``nb`` blocks of 32 columns, zero past N), the same for ``p``. A block reads 128
    contiguous bytes per K element and a group's panels are contiguous: rows of b a power of
    two apart would share cache sets."""
    kk, n = v.shape
    nb = (n + 31) // 32
    full = n // 32
    for k in range(kk):
        g, q = k // group, k % group
        vk, pk = v[k], p[k]
        for jb in range(full):
            row = (g * nb + jb) * group + q
            vr, pr = vbp[row], pbp[row]
            for i in range(32):
                vr[i] = vk[32 * jb + i]
                pr[i] = pk[32 * jb + i]
        if full < nb:
            row = (g * nb + full) * group + q
            for i in range(32):
                c = 32 * full + i
                vbp[row, i] = vk[c] if c < n else np.float32(0.0)
                pbp[row, i] = pk[c] if c < n else np.float32(0.0)


def _fast_jobs(m: int, ncols: int) -> int:
    return ((ncols + _NT - 1) // _NT) * ((m + _RB - 1) // _RB)


@njit(parallel=True, cache=True)
def _fused_fast(
    va,
    pa,
    vb,
    pb,
    vbp,
    pbp,
    acc,
    out,
    sa,
    sb,
    group,
    f_bits,
    out_bits,
    floor_p,
    gpp,
    jobs,
    workers,
):  # pragma: no cover
    """FP8 operands, aligned c, RZ output, exact float32 sums (`fast_path_applies`): float32
    SIMD across a tile of output columns; same contract as `_fused_general`."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        job = claim(counter)
        while job < jobs:
            _fast_job(job, va, pa, vb, pb, vbp, pbp, acc, out, sa, sb, group, f_bits, out_bits,
                      floor_p, gpp)  # fmt: skip
            job = claim(counter)


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _fused_fast_serial(
    va,
    pa,
    vb,
    pb,
    vbp,
    pbp,
    acc,
    out,
    sa,
    sb,
    group,
    f_bits,
    out_bits,
    floor_p,
    gpp,
    jobs,
    workers,
):  # pragma: no cover
    """`_fused_fast` on the calling thread (`fp8lab.kernels`)."""
    for job in range(jobs):
        _fast_job(job, va, pa, vb, pb, vbp, pbp, acc, out, sa, sb, group, f_bits, out_bits,
                  floor_p, gpp)  # fmt: skip


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _dot_row(r, va, pa, vbt, pbt, c, group, f_bits, out_bits, rne, c_after, floor_p):
    """Dot product ``r`` of `_dots`."""
    k = va.shape[1]
    ng = (k + group - 1) // group
    a = c[r]
    for g in range(ng):
        k0 = g * group
        a = _step64(a, va, pa, vbt, pbt, r, r, k0, min(k0 + group, k), f_bits, out_bits,
                    rne, c_after, floor_p)  # fmt: skip
    c[r] = a


@njit(parallel=True, cache=True)
def _dots(va, pa, vbt, pbt, c, group, f_bits, out_bits, rne, c_after, floor_p, workers):
    """Row-wise dot products ``va[s] . vbt[:, s]`` chained over K steps (c: [S], in and out);
    ``workers`` threads claim the rows (`fp8lab.kernels.claim`)."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        r = claim(counter)
        while r < va.shape[0]:
            _dot_row(r, va, pa, vbt, pbt, c, group, f_bits, out_bits, rne, c_after, floor_p)
            r = claim(counter)


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _dots_serial(va, pa, vbt, pbt, c, group, f_bits, out_bits, rne, c_after, floor_p, workers):
    """`_dots` on the calling thread (`fp8lab.kernels`)."""
    for r in range(va.shape[0]):
        _dot_row(r, va, pa, vbt, pbt, c, group, f_bits, out_bits, rne, c_after, floor_p)


@njit(cache=True)
def _pow2_pass(v, floor_p, p):  # pragma: no cover - numba
    """`pow2_exponents` of float32 ``v`` (flat) into ``p`` in one pass; returns whether every
    element is finite (the fast kernel's condition), so no second pass over ``v`` is needed."""
    expo = np.uint32(0x7F800000)
    finite = True
    for i in range(v.size):
        e = np.uint32(f32_to_u32(v[i]) & expo)
        finite &= e != expo
        p[i] = np.float32(0.0) if v[i] == 0 else max(u32_to_f32(e), floor_p)
    return finite


def _exponents(values: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """CPU operand prep: float32 contiguous values, their `pow2_exponents` and whether all
    are finite, from one numba pass (bit for bit `pow2_exponents` and ``torch.isfinite``)."""
    v = values.to(torch.float32).contiguous()
    p = torch.empty_like(v)
    floor_p = np.float32(2.0 ** get_format(fmt).emin)
    return v, p, bool(_pow2_pass(v.view(-1).numpy(), floor_p, p.view(-1).numpy()))


def fast_path_applies(acc: Accumulator, fmt_a: str, fmt_b: str) -> bool:
    """Is `_fused_fast` exact for this model and these operand formats: FP8 operands (products
    exact in float32, ``E`` >= -28), aligned ``c``, RZ output, and float32 sums that stay exact
    (every term below ``2**(F + 2)``, ``G + 1`` of them below 2**24)."""
    if acc.align_bits is None or acc.c_entry != "aligned" or acc.out_rounding != "toward_zero":
        return False
    if fmt_a not in ("e4m3", "e5m2") or fmt_b not in ("e4m3", "e5m2"):
        return False
    return (acc.group + 1) * 2 ** (acc.align_bits + 2) <= 2**24


def fused(
    a: QTensor,
    b: QTensor,
    acc: Accumulator,
    kb: int,
    c: torch.Tensor | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """The fused model over quantized ``a`` [M, K], ``b`` [K, N] (+ FP32 ``c`` [M, N]).

    ``acc`` must be resolved (`Accumulator.resolve`). ``fast``: None picks the fast kernel
    where it applies (finite operands); False forces the reference kernel (tests). Under the
    torch kernels (`fp8lab.kernels`) one kernel computes both (`fused_torch`)."""
    m, k = a.shape
    n = b.shape[1]
    pe = acc.promote_every
    check_promotion(acc, kb, k, "fused")
    out0, acc0 = c_start(a, b, c, pe is not None)
    dev = a.values.device
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=dev) if out0 is None else out0.contiguous()
    )
    if m == 0 or n == 0:
        return out
    fa, fb = a.spec.format, b.spec.format
    use_fast = fast_path_applies(acc, fa, fb) if fast is None else fast
    if use_fast and not fast_path_applies(acc, fa, fb):
        raise ValueError(f"the fast fused kernel does not apply to {acc} on {fa} x {fb}")
    generic = use_torch(a.values, b.values, c, what="qmatmul (fused accumulator)")
    # an inf/NaN operand makes a term NaN, whose int32 conversion in the fast kernel is
    # garbage (INT_MIN on x86): such GEMMs take the reference kernel, which propagates NaN
    if generic:
        va, vb = a.values, b.values
        pa, pb = pow2_exponents(a.values, fa), pow2_exponents(b.values, fb)
        if use_fast:
            use_fast = bool(torch.isfinite(va).all()) and bool(torch.isfinite(vb).all())
    else:  # values, exponents and finiteness in one numba pass per operand
        va, pa, fin_a = _exponents(a.values, fa)
        vb, pb, fin_b = _exponents(b.values, fb)
        if use_fast and fast is None:
            use_fast = fin_a and fin_b
    dt = torch.float32 if use_fast else torch.float64
    va, vb, pa, pb = (t.to(dt).contiguous() for t in (va, vb, pa, pb))
    accbuf = (
        torch.zeros((m, n), dtype=torch.float32, device=dev)
        if acc0 is None
        else acc0.clone().contiguous()
    )
    gpp = 0 if pe is None else pe // acc.group
    if pe is not None:
        sa, sb = interval_scales(a, b, k, pe)
    else:
        sa = torch.ones((m, 1), dtype=torch.float32, device=dev)
        sb = torch.ones((1, n), dtype=torch.float32, device=dev)
    mode = triton_mode(dev) if use_fast and generic and fits(m, k, n, acc.group) else None
    if mode is not None and verified_kernel(acc, (fa, fb), dev, mode == "interpret"):
        # the fast domain as one Triton kernel (GPU), probed against the torch kernel's bits
        fused_gemm_triton(va, vb, accbuf, out, sa, sb, acc, gpp, (fa, fb), mode == "interpret")
    elif generic:  # one kernel for the fast and reference paths: they compute the same bits
        fused_gemm_torch(va, pa, vb, pb, accbuf, out, sa, sb, acc, gpp, use_fast)
    if generic:
        return output_scales(out if pe is not None else accbuf, a, b, pe is not None)
    floor_p = 2.0**acc.exp_floor
    args = (va.numpy(), pa.numpy(), vb.numpy(), pb.numpy(), accbuf.numpy(), out.numpy(),
            sa.numpy(), sb.numpy())  # fmt: skip
    par = parallel(m * n * k)  # the thread policy of fp8lab.kernels
    if use_fast:
        rows = -(-k // acc.group) * -(-n // 32) * acc.group
        vbp, pbp = np.empty((rows, 32), np.float32), np.empty((rows, 32), np.float32)
        _pack_b(args[2], args[3], vbp, pbp, acc.group)
        kernel = _fused_fast if par else _fused_fast_serial
        kernel(*args[:4], vbp, pbp, *args[4:], acc.group, acc.align_bits, acc.out_bits, floor_p,
               gpp, _fast_jobs(m, n), numba.get_num_threads())  # fmt: skip
    else:
        f_bits = -1 if acc.align_bits is None else acc.align_bits
        kernel = _fused_general if par else _fused_general_serial
        kernel(*args, acc.group, f_bits, acc.out_bits, acc.out_rounding == "nearest_even",
               acc.c_entry == "after", floor_p, gpp, numba.get_num_threads())  # fmt: skip
    return output_scales(out if pe is not None else accbuf, a, b, pe is not None)


def fused_dot(
    a_vals: torch.Tensor,
    b_vals: torch.Tensor,
    acc: Accumulator | str,
    formats: tuple[str, str] = ("e4m3", "e4m3"),
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """A batch of dot products through a fused (hardware) accumulator model, unscaled.

    Args:
        a_vals, b_vals: ``[S, K]`` float tensors whose elements are already on the grids of
            ``formats`` (the values of a QTensor, not dequantized); row ``s`` of ``a_vals``
            and of ``b_vals`` form dot product ``s``, summed in K order, ``group`` products per
            MMA step, steps chained (no promotion: promote outside by splitting K).
        acc: a fused `Accumulator` or a GPU name (``"h100"``, ...), resolved for ``formats``.
        formats: the element formats of ``a_vals`` and ``b_vals``.
        c: optional FP32 ``[S]`` accumulators entering the first step.

    Returns:
        float32 ``[S]``, bit for bit what `qmatmul` computes for ``a[s] @ b[s]`` with unit scales.
    """
    acc = Accumulator.parse(acc, formats)
    if acc.kind != "fused":
        raise ValueError(f"fused_dot takes a fused/GPU accumulator, got kind {acc.kind!r}")
    if a_vals.dim() != 2 or a_vals.shape != b_vals.shape:
        raise ValueError(
            f"fused_dot needs two [S, K] tensors of one shape, got {tuple(a_vals.shape)} and "
            f"{tuple(b_vals.shape)}"
        )
    s = a_vals.shape[0]
    dev = a_vals.device
    out = (
        torch.zeros(s, dtype=torch.float32, device=dev)
        if c is None
        else c.to(torch.float32).clone()
    )
    if out.shape != (s,):
        raise ValueError(f"fused_dot: c must have shape [{s}], got {tuple(c.shape)}")
    va = a_vals.to(torch.float64).contiguous()
    vb = b_vals.to(torch.float64).contiguous()
    pa = pow2_exponents(a_vals, formats[0]).double()
    pb = pow2_exponents(b_vals, formats[1]).double()
    if use_torch(a_vals, b_vals, c, what="fused_dot"):
        return fused_dots_torch(va, pa, vb, pb, out, acc)
    f_bits = -1 if acc.align_bits is None else acc.align_bits
    kernel = _dots if parallel(a_vals.numel()) else _dots_serial
    kernel(va.numpy(), pa.numpy(), vb.numpy().T, pb.numpy().T, out.numpy(), acc.group, f_bits,
          acc.out_bits, acc.out_rounding == "nearest_even", acc.c_entry == "after",
          2.0**acc.exp_floor, numba.get_num_threads())  # fmt: skip
    return out
