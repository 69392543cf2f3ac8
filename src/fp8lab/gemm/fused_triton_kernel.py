"""The Triton source of `fp8lab.gemm.fused_triton`'s kernel (see its module doc for the
arithmetic). A module of its own so that ``import fp8lab`` never imports Triton: this one is
imported on the kernel's first use."""

import triton.language as tl


def fused_tile(va, vb, acc_ptr, out_ptr, sa_ptr, sb_ptr, M, N, K, ng, gpp, n_sb,
                G: tl.constexpr, GP: tl.constexpr, F: tl.constexpr, OUT_BITS: tl.constexpr, EXP_FLOOR: tl.constexpr, EMIN_A: tl.constexpr,
                EMIN_B: tl.constexpr, PROMOTE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """One [BM, BN] output tile of the fused chain (jitted by `fp8lab.gemm.fused_triton`).

    va [M, K], vb [K, N] float32 FP8 values; acc [M, N] float32 c in, last chain result out;
    out [M, N] float32 promoted total; sa [M, n_sb], sb [n_sb, N] float32 interval scales."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < M
    cmask = cols < N
    omask = rmask[:, None] & cmask[None, :]
    oidx = rows[:, None] * N + cols[None, :]
    run = tl.load(acc_ptr + oidx, mask=omask, other=0.0)
    total = tl.load(out_ptr + oidx, mask=omask, other=0.0)
    kk = tl.arange(0, GP)
    for g in range(0, ng):
        ks = g * G + kk
        kmask = (kk < G) & (ks < K)
        a = tl.load(va + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(vb + ks[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)  # fmt: skip
        # operand exponents e = max(floor(log2|x|), emin) from the bits (FP8 values are normal
        # float32); a zero operand makes no term
        ea = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN_A)
        eb = tl.maximum(((b.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN_B)
        live = (a != 0.0)[:, :, None] & (b != 0.0)[None, :, :]
        # (tl.reduce with tl.standard's combine functions, not tl.max / tl.sum: those are jitted
        # helpers that Triton's interpreter runs only if it was on when triton was imported)
        e_p = tl.reduce(tl.where(live, ea[:, :, None] + eb[None, :, :], -1000), 1,
                        tl.standard._elementwise_max)  # fmt: skip
        # the accumulator: a nonzero finite c is a term with e_c = max(floor(log2|c|), -126)
        cb = run.to(tl.int32, bitcast=True)
        cexp = (cb >> 23) & 0xFF
        cfin = cexp != 0xFF
        cnz = (cb & 0x7FFFFFFF) != 0
        e_c = tl.where(cnz & cfin, tl.maximum(cexp - 127, -126), -1000)
        big_e = tl.maximum(tl.maximum(e_p, e_c), EXP_FLOOR)
        # products scaled by 2**(F - E) (exact; lanes without products may clamp: their
        # products are zeros) and truncated by the int32 conversion
        sc_e = tl.minimum(tl.maximum(F - big_e, -126), 127)
        scale = ((sc_e + 127) << 23).to(tl.float32, bitcast=True)
        prod = a[:, :, None] * b[None, :, :]
        terms = (prod * scale[:, None, :]).to(tl.int32)
        s = tl.reduce(terms, 1, tl.standard._sum_combine)  # exact: int32 below 2**24
        # c's term: its significand (c = mant * 2**(cexp' - 150)) shifted right by E - F - ...
        mant = tl.where(cexp == 0, cb & 0x7FFFFF, (cb & 0x7FFFFF) | 0x800000)
        c_sh = tl.minimum(tl.maximum(big_e - F - (tl.maximum(cexp, 1) - 150), 0), 31)
        c_term = tl.where(cnz & cfin, mant >> c_sh, 0)
        s += tl.where(cb < 0, -c_term, c_term)
        # round |s| * 2**(E - F) toward zero to OUT_BITS fraction bits, exponent floor -126
        s_abs = tl.abs(s)
        x = big_e - F
        lg = ((s_abs.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exact
        ev = lg + x
        drop = tl.maximum(tl.maximum(ev, -126) - OUT_BITS - x, 0)
        m = tl.where(drop > 23, 0, (s_abs >> tl.minimum(drop, 31)) << tl.minimum(drop, 31))
        # assemble the float32 bits: normal, subnormal (exact shift: the low bits are zero), inf
        normal = ((ev + 127) << 23) | ((m << tl.minimum(tl.maximum(23 - lg, 0), 31)) & 0x7FFFFF)
        sub_sh = x + 149
        sub = tl.where(
            sub_sh >= 0, m << tl.minimum(tl.maximum(sub_sh, 0), 31),
            m >> tl.minimum(tl.maximum(-sub_sh, 0), 31),
        )  # fmt: skip
        bits = tl.where(ev >= 128, 0x7F800000, tl.where(ev >= -126, normal, sub))
        bits = tl.where(m == 0, 0, bits)
        bits = bits | ((s < 0).to(tl.int32) << 31)  # a value cut to zero keeps its sign
        res = bits.to(tl.float32, bitcast=True)
        run = tl.where(cfin, res, run)  # an inf/NaN accumulator propagates (finite operands)
        if PROMOTE:
            t = g // gpp
            do = ((g + 1) % gpp == 0) | (g == ng - 1)
            sav = tl.load(sa_ptr + rows * n_sb + t, mask=rmask, other=0.0)
            sbv = tl.load(sb_ptr + t * N + cols, mask=cmask, other=0.0)
            upd = total + (sav[:, None] * sbv[None, :]) * run
            total = tl.where(do, upd, total)
            run = tl.where(do, 0.0, run)
    tl.store(acc_ptr + oidx, run, mask=omask)
    if PROMOTE:
        tl.store(out_ptr + oidx, total, mask=omask)
