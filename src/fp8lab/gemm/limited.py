"""The ``limited`` accumulator model: exact MMA-group sums cut to ``mantissa_bits`` (see
`fp8lab.gemm`), with optional promotion into FP32 every ``promote_every`` K elements."""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from fp8lab._bits import f64_to_u64 as _f64_to_u64
from fp8lab._bits import u64_to_f64 as _u64_to_f64
from fp8lab.gemm.accumulator import Accumulator
from fp8lab.gemm.limited_torch import acc_step_torch, per_product_torch
from fp8lab.gemm.operands import blocks as _blocks
from fp8lab.gemm.operands import k_constant_scales as _k_constant_scales
from fp8lab.gemm.simd import vadd, vcut, vfma, vload, vsplat, vstore
from fp8lab.kernels import claim, parallel, use_torch
from fp8lab.qtensor import QTensor

__all__ = ["c_start", "check_promotion", "interval_scales", "limited", "output_scales"]

_ROW_CHUNK = 64  # output rows per pass of the torch kernels on the CPU
_RB = 64  # output rows per job of the numba kernel `_acc_sums` (a multiple of 4)
_NT = 256  # output columns per job of `_acc_sums` (a multiple of 8; tile and panels in L2)
_BATCH_K = 512  # K elements per batched group-sum GEMM


@njit(cache=True, inline="always")
def _cut(v, drop, half_m1, mask, rne):
    """Keep ``52 - drop`` fraction bits of a float64: truncate (RZ) or round to nearest even."""
    u = _f64_to_u64(v)
    if rne:
        u = u + half_m1 + ((u >> drop) & np.uint64(1))
    return _u64_to_f64(np.uint64(u & mask))


@njit(cache=True)
def _acc_step(acc, buf, drop, rne, gpp, out, sa, sb):  # pragma: no cover - numba
    """For each group g of buf [G, rows, cols]: acc = cut(acc + buf[g]); after every ``gpp``
    groups (0 = never) promote: out += f32(sa[r, t] * sb[t, n]) * f32(acc), acc = 0, where t
    counts the promotions within this call.

    Serial on purpose: it runs between torch GEMM calls, and alternating two thread pools on two
    cores makes both spin.
    """
    ng, rows, cols = buf.shape
    dropu = np.uint64(drop)
    half_m1 = (np.uint64(1) << (dropu - np.uint64(1))) - np.uint64(1)
    mask = ~((np.uint64(1) << dropu) - np.uint64(1))
    for r in range(rows):
        for g in range(ng):
            for n in range(cols):
                acc[r, n] = _cut(acc[r, n] + buf[g, r, n], dropu, half_m1, mask, rne)
            if gpp > 0 and (g + 1) % gpp == 0:
                t = g // gpp
                s_r = sa[r, t]
                for n in range(cols):
                    out[r, n] += (s_r * sb[t, n]) * np.float32(acc[r, n])
                    acc[r, n] = 0.0


@njit(cache=True, inline="always")
def _four64(row, q):  # pragma: no cover - numba
    """``row[q:q+4]`` widened to float64 (exact from float32)."""
    return (
        np.float64(row[q]),
        np.float64(row[q + 1]),
        np.float64(row[q + 2]),
        np.float64(row[q + 3]),
    )


@njit(cache=True, fastmath={"contract"})
def _group_sums(s, va, vb, r, k0, k1, n0, w):  # pragma: no cover - numba
    """``s[i, j]`` = the sum of ``va[min(r + i, M - 1), k] * vb[k, n0 + j]`` over ``k`` in
    [k0, k1), for ``i`` < 4 rows and ``j`` < ``w`` columns: from +0, in K order, four K elements
    per sweep with the running sums in registers, b's loads shared by the four rows. ``va`` is
    float32 (its values widen exactly; rows past ``M`` repeat the last one and are not kept),
    ``vb`` float32 or float64 (any strides).

    The products of FP8 values are exact in float64 and so is their sum for E4M3 and for E5M2
    groups spanning less than 2**53 (docs/gemm.md): the order, and the fused multiply-adds that
    ``contract`` allows here only, cannot change a bit there."""
    for i in range(4):
        for j in range(w):
            s[i, j] = 0.0
    s0, s1, s2, s3 = s[0], s[1], s[2], s[3]
    last = va.shape[0] - 1
    ra, rc, rd, re = va[r], va[min(r + 1, last)], va[min(r + 2, last)], va[min(r + 3, last)]
    q = k0
    while q < k1:
        if q + 4 <= k1:
            a0, a1, a2, a3 = _four64(ra, q)
            c0, c1, c2, c3 = _four64(rc, q)
            d0, d1, d2, d3 = _four64(rd, q)
            e0, e1, e2, e3 = _four64(re, q)
            b0, b1 = vb[q, n0 : n0 + w], vb[q + 1, n0 : n0 + w]
            b2, b3 = vb[q + 2, n0 : n0 + w], vb[q + 3, n0 : n0 + w]
            for j in range(w):
                x0, x1, x2, x3 = b0[j], b1[j], b2[j], b3[j]
                s0[j] = (((s0[j] + a0 * x0) + a1 * x1) + a2 * x2) + a3 * x3
                s1[j] = (((s1[j] + c0 * x0) + c1 * x1) + c2 * x2) + c3 * x3
                s2[j] = (((s2[j] + d0 * x0) + d1 * x1) + d2 * x2) + d3 * x3
                s3[j] = (((s3[j] + e0 * x0) + e1 * x1) + e2 * x2) + e3 * x3
            q += 4
        else:
            a0, c0 = np.float64(ra[q]), np.float64(rc[q])
            d0, e0 = np.float64(rd[q]), np.float64(re[q])
            b0 = vb[q, n0 : n0 + w]
            for j in range(w):
                x0 = b0[j]
                s0[j] += a0 * x0
                s1[j] += c0 * x0
                s2[j] += d0 * x0
                s3[j] += e0 * x0
            q += 1


@njit(cache=True, inline="always")
def _micro(tile, ti, ab, bp, nk, p0, j, drop, rne):  # pragma: no cover - numba
    """Register tile of `_sums_job`: the group sums of 4 rows (``ab[q, i]``: row ``i``'s
    ``q``-th element of the group) and 8 columns (``bp[p0 + q, :]``: the columns' ``q``-th
    elements) over ``nk`` K elements, from +0 in K order (8 running sums in vector registers),
    then ``tile[ti + i, j + l] = cut(tile[ti + i, j + l] + sum)``: per element the operations
    of `_group_sums` and the cut."""
    z = vsplat(0.0)
    s00, s01, s10, s11, s20, s21, s30, s31 = z, z, z, z, z, z, z, z
    for q in range(nk):
        b0 = vload(bp, p0 + q, 0)
        b1 = vload(bp, p0 + q, 4)
        x = vsplat(ab[q, 0])
        s00 = vfma(x, b0, s00)
        s01 = vfma(x, b1, s01)
        x = vsplat(ab[q, 1])
        s10 = vfma(x, b0, s10)
        s11 = vfma(x, b1, s11)
        x = vsplat(ab[q, 2])
        s20 = vfma(x, b0, s20)
        s21 = vfma(x, b1, s21)
        x = vsplat(ab[q, 3])
        s30 = vfma(x, b0, s30)
        s31 = vfma(x, b1, s31)
    vstore(tile, ti, j, vcut(vadd(vload(tile, ti, j), s00), drop, rne))
    vstore(tile, ti, j + 4, vcut(vadd(vload(tile, ti, j + 4), s01), drop, rne))
    vstore(tile, ti + 1, j, vcut(vadd(vload(tile, ti + 1, j), s10), drop, rne))
    vstore(tile, ti + 1, j + 4, vcut(vadd(vload(tile, ti + 1, j + 4), s11), drop, rne))
    vstore(tile, ti + 2, j, vcut(vadd(vload(tile, ti + 2, j), s20), drop, rne))
    vstore(tile, ti + 2, j + 4, vcut(vadd(vload(tile, ti + 2, j + 4), s21), drop, rne))
    vstore(tile, ti + 3, j, vcut(vadd(vload(tile, ti + 3, j), s30), drop, rne))
    vstore(tile, ti + 3, j + 4, vcut(vadd(vload(tile, ti + 3, j + 4), s31), drop, rne))


@njit(cache=True)
def _sums_job(job, va, vb, bp, c, out, sa, sb, group, ngroups, gpp, drop, rne):  # pragma: no cover
    """Job ``job`` of `_acc_sums`: `_RB` output rows by `_NT` output columns, all of K.

    Per output element exactly the operations of `_acc_step` over the batched GEMM's group
    sums (`_group_sums`): ``acc = cut(acc + sum)`` per group and, every ``gpp`` groups, the
    promotion. The job's accumulators live in a local [`_RB`, `_NT`] tile (in cache), starting
    at +0 or, when ``c`` has rows, at ``c``. Whole blocks of 8 columns take the register tile
    (`_micro`); the last ``w % 8`` columns `_group_sums`."""
    m, ncols = out.shape
    k = va.shape[1]
    last = m - 1
    ntiles = (ncols + _NT - 1) // _NT
    n0 = (job % ntiles) * _NT
    r0 = (job // ntiles) * _RB
    w = min(n0 + _NT, ncols) - n0
    wv = w - w % 8
    dropu = np.uint64(drop)
    half_m1 = (np.uint64(1) << (dropu - np.uint64(1))) - np.uint64(1)
    mask = ~((np.uint64(1) << dropu) - np.uint64(1))
    s = np.empty((4, _NT), dtype=np.float64)
    ab = np.empty((group, 4), dtype=np.float64)
    r1 = min(r0 + _RB, m)
    tile = np.zeros((_RB, _NT), dtype=np.float64)
    if c.shape[0]:
        for r in range(r0, r1):
            for j in range(w):
                tile[r - r0, j] = c[r, n0 + j]
    # group-major: a group's b panels (group x _NT float64, contiguous) are read once per job
    # from memory and then from L2 for every 4 rows; each element sees its groups in K order
    for g in range(ngroups):
        k0 = min(g * group, k)
        nk = min(k0 + group, k) - k0  # groups past K (`limited` pads K to whole steps): +0
        for r4 in range(r0, r1, 4):
            # the 4 rows' a values of this group, widened (exact) once for all column blocks;
            # rows past M repeat the last one and are not kept
            for q in range(nk):
                for i in range(4):
                    ab[q, i] = np.float64(va[min(r4 + i, last), k0 + q])
            for j in range(0, wv, 8):
                _micro(tile, r4 - r0, ab, bp, nk, (g * (ncols >> 3) + ((n0 + j) >> 3)) * group,
                       j, drop, rne)  # fmt: skip
            if wv < w:
                _group_sums(s, va, vb, r4, k0, k0 + nk, n0 + wv, w - wv)
                for r in range(r4, min(r4 + 4, r0 + _RB)):
                    ar = tile[r - r0, wv:w]
                    sr = s[r - r4]
                    for j in range(w - wv):
                        ar[j] = _cut(ar[j] + sr[j], dropu, half_m1, mask, rne)
            if gpp > 0 and (g + 1) % gpp == 0:
                for r in range(r4, min(r4 + 4, r1)):
                    ar = tile[r - r0, :w]
                    s_r = sa[r, g // gpp]
                    sbt = sb[g // gpp, n0 : n0 + w]
                    outr = out[r, n0 : n0 + w]
                    for j in range(w):
                        outr[j] += (s_r * sbt[j]) * np.float32(ar[j])
                        ar[j] = 0.0
    if gpp == 0:  # never promoted: `limited`'s closing pass, cut(acc + 0) times unit scales
        for r in range(r0, r1):
            ar = tile[r - r0, :w]
            outr = out[r, n0 : n0 + w]
            for j in range(w):
                outr[j] += np.float32(_cut(ar[j] + 0.0, dropu, half_m1, mask, rne))


@njit(cache=True)
def _pack_b(vb, bp, group):  # pragma: no cover - numba
    """b widened (exact) once per GEMM into the panels `_micro` reads: for K element
    ``k = g * group + q`` and the whole blocks of 8 columns ``jb`` of ``vb`` [K, N] (any
    strides), ``bp[(g * (N // 8) + jb) * group + q, l] = float64(vb[k, 8 * jb + l])``. A
    `_micro` call reads 64 contiguous bytes per K element and a job's panels of one group are
    contiguous: rows of b a power of two apart would share cache sets."""
    nb = vb.shape[1] // 8
    for kk in range(vb.shape[0]):  # serial: 1/M of the kernel's work
        g, q = kk // group, kk % group
        for jb in range(nb):
            row = vb[kk, 8 * jb : 8 * jb + 8]
            dst = bp[(g * nb + jb) * group + q]
            for i in range(8):
                dst[i] = np.float64(row[i])


@njit(parallel=True, cache=True)
def _acc_sums(va, vb, bp, c, out, sa, sb, group, ngroups, gpp, drop, rne, jobs, workers):
    """The limited model (not per product) over ``va`` [M, K] and ``vb`` [K, N] (float32 or
    float64, any strides; ``bp``: ``vb``'s panels, `_pack_b`): ``ngroups`` groups of ``group`` K elements (those past K are empty), the
    accumulator starting at ``c`` [M, N] float64 (or +0 when ``c`` has no rows), promoted into
    ``out`` [M, N] float32 with ``sa`` [M, T], ``sb`` [T, N] every ``gpp`` groups (0: never;
    then ``out`` += the last accumulator). ``workers`` threads claim the jobs
    (`fp8lab.kernels.claim`)."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        job = claim(counter)
        while job < jobs:
            _sums_job(job, va, vb, bp, c, out, sa, sb, group, ngroups, gpp, drop, rne)
            job = claim(counter)


@njit(cache=True)
def _acc_sums_serial(va, vb, bp, c, out, sa, sb, group, ngroups, gpp, drop, rne, jobs,
                     workers):  # fmt: skip
    """`_acc_sums` on the calling thread (`fp8lab.kernels`)."""
    for job in range(jobs):
        _sums_job(job, va, vb, bp, c, out, sa, sb, group, ngroups, gpp, drop, rne)


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _per_product_job(job, a, b, k0, k1, group, drop, rne, acc):  # pragma: no cover - numba
    """Job ``job`` of `_acc_per_product`: one output row, 64 output columns."""
    cols = acc.shape[1]
    dropu = np.uint64(drop)
    half_m1 = (np.uint64(1) << (dropu - np.uint64(1))) - np.uint64(1)
    mask = ~((np.uint64(1) << dropu) - np.uint64(1))
    keep = 52 - drop
    tile = 64
    ntiles = (cols + tile - 1) // tile
    r = job // ntiles
    n0 = (job % ntiles) * tile
    n1 = min(n0 + tile, cols)
    emax = np.zeros(tile, dtype=np.uint64)
    qinv = np.empty(tile, dtype=np.float64)
    q = np.empty(tile, dtype=np.float64)
    s = np.empty(tile, dtype=np.float64)
    for g0 in range(k0, k1, group):
        g1 = min(g0 + group, k1)
        for j in range(n1 - n0):
            emax[j] = np.uint64(0)
            s[j] = 0.0
        for k in range(g0, g1):
            av = a[r, k]
            for j in range(n1 - n0):
                e = (_f64_to_u64(av * b[k, n0 + j]) >> np.uint64(52)) & np.uint64(0x7FF)
                emax[j] = max(emax[j], e)
        for j in range(n1 - n0):
            # quantum 2**(e_max - keep) of the group's largest product (biased exponents)
            eq = np.int64(emax[j]) - keep
            eq = max(eq, np.int64(1))
            q[j] = _u64_to_f64(np.uint64(eq) << np.uint64(52))
            qinv[j] = _u64_to_f64(np.uint64(2046 - eq) << np.uint64(52))
        for k in range(g0, g1):
            av = a[r, k]
            for j in range(n1 - n0):
                s[j] += np.trunc(av * b[k, n0 + j] * qinv[j]) * q[j]
        for j in range(n1 - n0):
            acc[r, n0 + j] = _cut(acc[r, n0 + j] + s[j], dropu, half_m1, mask, rne)


@njit(parallel=True, cache=True)
def _acc_per_product(a, b, k0, k1, group, drop, rne, acc, jobs, workers):  # pragma: no cover
    """DeepSeek §3.5.2 model over K range [k0, k1): per group align + truncate each product.
    ``workers`` threads claim the jobs (`fp8lab.kernels.claim`)."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        job = claim(counter)
        while job < jobs:
            _per_product_job(job, a, b, k0, k1, group, drop, rne, acc)
            job = claim(counter)


@njit(cache=True, error_model="numpy")  # as a prange body: x / 0 is inf
def _acc_per_product_serial(a, b, k0, k1, group, drop, rne, acc, jobs, workers):  # pragma: no cover
    """`_acc_per_product` on the calling thread (`fp8lab.kernels`)."""
    for job in range(jobs):
        _per_product_job(job, a, b, k0, k1, group, drop, rne, acc)


def interval_scales(
    a: QTensor, b: QTensor, kp: int, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scales of a per (row, promotion interval) [M, T] and of b per (interval, column)
    [T, N] (contiguous, on the scales' device) for the intervals of ``span`` K elements up to
    ``kp`` (padding reuses the last)."""
    bma, bka = a.block_shape or _blocks(a)
    bkb, bnb = b.block_shape or _blocks(b)
    k = a.shape[1]
    starts = [min(p, k - 1) for p in range(0, kp, span)]
    ia = torch.tensor([s // bka for s in starts], dtype=torch.long, device=a.scales.device)
    ib = torch.tensor([s // bkb for s in starts], dtype=torch.long, device=b.scales.device)
    sa = a.scales[:, ia].repeat_interleave(bma, dim=0)[: a.shape[0]]
    sb = b.scales[ib, :].repeat_interleave(bnb, dim=1)[:, : b.shape[1]]
    return sa.float().contiguous(), sb.float().contiguous()


def check_promotion(acc: Accumulator, kb: int, k: int, what: str) -> None:
    """K-varying scales (blocks of ``kb`` < ``k`` along K) need a promotion interval dividing
    the block: the tensor-core accumulator sees unscaled operands."""
    pe = acc.promote_every
    if pe is None and kb < k:
        raise ValueError(
            f"{what} accumulation without promotion applies the scales to the output, but these "
            f"operands' scales change every {kb} elements along K: set promote_every to a "
            f"multiple of group={acc.group} dividing {kb} (DeepSeek: 128)"
        )
    if pe is not None and kb < k and kb % pe:
        raise ValueError(
            f"promote_every={pe} does not divide the operands' K scale block ({kb}): the "
            "promoted partial sums would straddle two scale groups"
        )


def c_start(
    a: QTensor, b: QTensor, c: torch.Tensor | None, promoted: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where an FP32 addend ``c`` [M, N] enters a tensor-core model: ``(out0, acc0)``.

    Promoted (``promote_every``): c starts the FP32 promoted sum (``out0``). Never promoted: c is
    the first MMA step's accumulator (``acc0``); the MMA sees unscaled operands, so the scales
    applied to the output must be 1. Global scales (NVFP4) multiply the whole sum: no c there.
    """
    if c is None:
        return None, None
    if a.global_scale is not None or b.global_scale is not None:
        raise ValueError("qmatmul: c is not supported with global (per-tensor FP32) scales")
    if promoted:
        return c.clone(), None
    s = _k_constant_scales(a, "a") * _k_constant_scales(b, "b")
    if not bool((s == 1).all()):
        raise ValueError(
            "qmatmul: c enters the first MMA step of an accumulator without promotion, which "
            "sees unscaled operands: the operands' scales must be 1 (or set promote_every)"
        )
    return None, c


def _numba_step(acc, buf, drop, rne, gpp, out, sa, sb) -> None:
    _acc_step(acc.numpy(), buf.numpy(), drop, rne, gpp, out.numpy(), sa.numpy(), sb.numpy())


def _numba_sums(a, b, out, acc0, kp, span, grp, gpp, drop, rne) -> None:
    """`limited` without per-product alignment as one numba pass (group sums included) into
    ``out`` over jobs the threads claim (`fp8lab.kernels`); ``kp``: K padded to whole steps."""
    m, k = a.shape
    n = b.shape[1]
    # both operands are read where they lie, float32 and in any strides (a transposed view
    # too): each job widens the values it uses into its packed panels. The accumulators live in
    # each job's tile.
    va, vb = a.values.float(), b.values.float()
    # c enters the first MMA step, as the accumulator's float64 start (no rows: +0)
    c = (
        acc0.to(torch.float64).contiguous()
        if acc0 is not None
        else torch.zeros((0, 0), dtype=torch.float64)
    )
    sa, sb = interval_scales(a, b, kp, span) if gpp else (out[:1, :1],) * 2
    jobs = -(-m // _RB) * -(-n // _NT)
    bp = np.empty((-(-k // grp) * (n // 8) * grp, 8), dtype=np.float64)
    _pack_b(vb.numpy(), bp, grp)
    kernel = _acc_sums if parallel(m * n * k) else _acc_sums_serial
    kernel(va.numpy(), vb.numpy(), bp, c.numpy(), out.numpy(), sa.numpy(), sb.numpy(), grp,
           kp // grp, gpp, drop, rne, jobs, numba.get_num_threads())  # fmt: skip


def _numba_per_product(a, b, k0, k1, group, drop, rne, acc) -> None:
    rows, n = acc.shape
    kernel = _acc_per_product if parallel(rows * n * (k1 - k0)) else _acc_per_product_serial
    kernel(a.numpy(), b.numpy(), k0, k1, group, drop, rne, acc.numpy(), rows * -(-n // 64),
           numba.get_num_threads())  # fmt: skip


def limited(
    a: QTensor, b: QTensor, acc: Accumulator, kb: int, c: torch.Tensor | None = None
) -> torch.Tensor:
    """The limited model over quantized ``a`` [M, K], ``b`` [K, N], plus ``c`` (see `c_start`)."""
    m, k = a.shape
    n = b.shape[1]
    pe = acc.promote_every
    check_promotion(acc, kb, k, "limited")
    drop = 52 - acc.mantissa_bits
    rne = acc.rounding == "nearest_even"
    out0, acc0 = c_start(a, b, c, pe is not None)
    dev = a.values.device
    out = torch.zeros((m, n), dtype=torch.float32, device=dev) if out0 is None else out0
    if m == 0 or n == 0:
        return out
    if k == 0:  # no MMA step: the sum of nothing is +0, or c as it went in (as `fused`)
        return output_scales(out if acc0 is None else acc0.float().clone(), a, b, pe is not None)
    generic = use_torch(a.values, b.values, c, what="qmatmul (limited accumulator)")
    step_k, per_product_k = (
        (acc_step_torch, per_product_torch) if generic else (_numba_step, _numba_per_product)
    )
    grp = acc.group
    span = pe if pe is not None else grp  # K elements between promotions (or per group)
    # K elements per batched group-sum GEMM: up to _BATCH_K // span promotion intervals at once
    # (fewer, larger torch calls), as many per call as make the calls cover K evenly: K = 256
    # with span 128 is one call of 2 intervals, not a call of 4 with 2 all-zero ones (zero
    # padding is exact but its MACs cost as much as real ones)
    intervals = -(-k // span)
    calls = -(-intervals // max(1, _BATCH_K // span))
    step = span * -(-intervals // calls)
    kp = calls * step
    ng = step // grp
    gpp = span // grp if pe is not None else 0
    if not generic and not acc.per_product:  # the same kp // grp groups, those past K empty
        _numba_sums(a, b, out, acc0, kp, span, grp, gpp, drop, rne)
        return output_scales(out, a, b, pe is not None)
    # exact float64 operands, zero-padded along K to whole steps: a zero group adds an exact 0,
    # cutting an already cut accumulator is a no-op and promoting 0 adds +0
    va, vb = a.values.double(), b.values.double()
    if kp > k:
        va = torch.nn.functional.pad(va, (0, kp - k))
        vb = torch.nn.functional.pad(vb, (0, 0, 0, kp - k))
    nst = step // span
    chunk = m if acc.per_product else _row_chunk(m, ng * n, generic, dev)
    f64 = {"dtype": torch.float64, "device": dev}
    accbuf = torch.zeros((chunk, n), **f64)
    zero = torch.zeros((1, chunk, n), **f64)  # a promotion pass without new sums
    if not acc.per_product:
        gbuf = torch.empty((ng, chunk, n), **f64)
    if pe is not None:
        sa_all, sb_all = interval_scales(a, b, kp, span)
    else:
        unit_a = torch.ones((chunk, max(nst, 1)), dtype=torch.float32, device=dev)
        unit_b = torch.ones((max(nst, 1), n), dtype=torch.float32, device=dev)
    for r0 in range(0, m, chunk):
        r1 = min(r0 + chunk, m)
        rows = r1 - r0
        acc_t = accbuf[:rows]
        acc_t.copy_(0.0 if acc0 is None else acc0[r0:r1])
        for p0 in range(0, kp, step):
            if pe is not None:
                t0 = p0 // span
                sa = sa_all[r0:r1, t0 : t0 + nst].contiguous()
                sb = sb_all[t0 : t0 + nst].contiguous()
            else:
                sa, sb = unit_a[:rows], unit_b
            if acc.per_product:
                for t in range(nst):
                    q0 = p0 + t * span
                    per_product_k(va[r0:r1], vb, q0, q0 + span, grp, drop, rne, acc_t)
                    step_k(acc_t, zero[:1, :rows], drop, rne, 1 if pe else 0, out[r0:r1],
                           sa[:, t : t + 1].contiguous(), sb[t : t + 1].contiguous())  # fmt: skip
                continue
            # all group sums of this step in one batched GEMM: [ng, rows, grp] @ [ng, grp, n]
            a3 = va[r0:r1, p0 : p0 + step].reshape(rows, ng, grp).transpose(0, 1)
            b3 = vb[p0 : p0 + step].reshape(ng, grp, n)
            g_c = torch.bmm(a3, b3) if rows != chunk else torch.bmm(a3, b3, out=gbuf)
            step_k(acc_t, g_c, drop, rne, gpp, out[r0:r1], sa, sb)
        if pe is None:  # never promoted: out = f32(acc), scales applied below
            step_k(acc_t, zero[:, :rows], drop, rne, 1, out[r0:r1], unit_a[:rows], unit_b)
    return output_scales(out, a, b, pe is not None)


def _row_chunk(m: int, per_row: int, generic: bool, device: torch.device) -> int:
    """Output rows per pass of the torch kernels and of numba's per-product variant:
    `_ROW_CHUNK` on the CPU; elsewhere as many rows as keep the [groups, rows, N] float64 group
    sums within 2**24 elements (each pass is a few kernel launches per group)."""
    if not generic or device.type == "cpu":
        return min(_ROW_CHUNK, m)
    return min(m, max(_ROW_CHUNK, (1 << 24) // max(1, per_row)))


def output_scales(out: torch.Tensor, a: QTensor, b: QTensor, promoted: bool) -> torch.Tensor:
    """The scales left for the output of a tensor-core model, in place: promoted sums carry
    their K groups' scales already (only global scales remain); never promoted, the K-constant
    scales multiply the chain's result (cuBLAS's epilogue)."""
    if not promoted:
        return out.mul_(_k_constant_scales(a, "a") * _k_constant_scales(b, "b"))
    if a.global_scale is not None or b.global_scale is not None:
        g = torch.ones((), device=out.device)
        for q in (a, b):
            if q.global_scale is not None:
                g = g * q.global_scale
        out.mul_(g)
    return out
