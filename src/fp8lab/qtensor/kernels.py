"""Numba kernels of the quantize driver: block amax and the scaled cast onto the element grid.

The scale-rule kernels live beside their rules, in `fp8lab.scaling.rule_kernels`. Each entry
point here (`block_amax`, `scale_cast`, `mul_blocks`, `max_abs_diff`) asks
`fp8lab.kernels.use_torch` and runs either these numba loops (CPU) or their device-generic twins in
`fp8lab.qtensor.kernels_torch`, which give the same bits.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from numba import njit

from fp8lab._bits import f32_to_u32 as _f32_to_u32
from fp8lab._bits import u32_to_f32 as _u32_to_f32
from fp8lab.formats import cast, get_format
from fp8lab.formats.rounding import _grids, _seed, _sr_one
from fp8lab.kernels import use_torch
from fp8lab.qtensor.kernels_torch import block_amax as _t_block_amax
from fp8lab.qtensor.kernels_torch import max_abs_diff as _t_max_abs_diff
from fp8lab.qtensor.kernels_torch import mul_blocks as _t_mul_blocks
from fp8lab.qtensor.kernels_torch import scale_cast as _t_scale_cast
from fp8lab.scaling.granularity import num_blocks, resolve_block

if TYPE_CHECKING:
    from fp8lab.qtensor.spec import QuantSpec

# ---------------------------------------------------------------------------------- kernels
# Two passes over x, no full-size temporaries: (1) block amax, NaN ignored; (2) multiply by the
# block's multiplier in float32 and round onto the grid (fast RNE+saturate path for ExMy formats
# with subnormals; any other mode writes x*scale and then runs fp8lab.cast in place).
# The kernels are serial numba loops over contiguous row segments, which LLVM vectorises (AVX2):
# measured here, a serial pass runs ~5x faster than the same loop under prange, whose thread pool
# competes with torch's OpenMP threads on this 2-core machine.
# Blocks taller than one row take their amax in a row-major sweep (one running max per column);
# blocks narrower than `_NARROW` columns are cast with the block row's multipliers expanded per
# column, so every row stays one vectorised sweep. The scale rules `max` and MX run as one numba
# pass over the block amaxes (a dozen small threaded torch ops cost more than the data pass on a
# busy 2-core machine). Pass (2) can also write the dequantized copy (``dequantized_out``), and
# both outputs can be caller-owned buffers (``out``): a fresh 32 MB tensor costs ~20 ms in page
# faults here, the pass into a warm buffer ~5 ms.
_AMAX_CHUNK = 64


@njit(cache=True)
def _seg_amax_bits(xs):  # pragma: no cover - numba
    """max |x| of a contiguous segment, on the uint32 bits; NaN (bits > 0x7F800000) counts as 0."""
    m = np.uint32(0)
    for i in range(xs.shape[0]):
        a = xs[i] & np.uint32(0x7FFFFFFF)
        ok = np.uint32(a <= np.uint32(0x7F800000))
        m = np.uint32(max(m, a * ok))
    return m


@njit(cache=True)
def _partial_amax(xu, rows, cols, bm, bk, chunk, out):  # pragma: no cover - numba
    """out[t, cb] = bits of max |x| over rows [t*chunk, (t+1)*chunk) and column block cb.

    |x| orders like its bits, so this is an integer max; NaN is ignored as TE's ``fmaxf`` does.
    """
    nt, nc = out.shape
    for t in range(nt):
        r0 = t * chunk
        r1 = min(r0 + chunk, rows)
        for cb in range(nc):
            c0 = cb * bk
            c1 = min(c0 + bk, cols)
            m = np.uint32(0)
            for r in range(r0, r1):
                m = np.uint32(max(m, _seg_amax_bits(xu[r * cols + c0 : r * cols + c1])))
            out[t, cb] = m


@njit(cache=True)
def _acc_amax_bits(xs, acc):  # pragma: no cover - numba
    """acc[i] = max(acc[i], bits of |xs[i]|), NaN counted as 0 (a vectorisable row sweep)."""
    for i in range(xs.shape[0]):
        a = xs[i] & np.uint32(0x7FFFFFFF)
        ok = np.uint32(a <= np.uint32(0x7F800000))
        acc[i] = np.uint32(max(acc[i], a * ok))


@njit(cache=True)
def _row_block_amax(xu, rows, cols, bm, bk, acc, out):  # pragma: no cover - numba
    """out[br, cb] = bits of max |x| over block (br, cb), NaN ignored; ``acc``: [cols] scratch.

    Walks rows in memory order: ``acc[c]`` holds the running max of column c over the block row.
    """
    nr, nc = out.shape
    for br in range(nr):
        acc[:] = 0
        for r in range(br * bm, min((br + 1) * bm, rows)):
            _acc_amax_bits(xu[r * cols : (r + 1) * cols], acc)
        for cb in range(nc):
            m = np.uint32(0)
            for c in range(cb * bk, min((cb + 1) * bk, cols)):
                m = np.uint32(max(m, acc[c]))
            out[br, cb] = m


@njit(cache=True)
def _max_abs_diff(a, b):  # pragma: no cover - numba
    """max |a - b| over two float32 vectors with NaN -> 0 and inf -> FLT_MAX (torch.nan_to_num)."""
    big = np.float32(3.4028234663852886e38)
    m = np.float32(0.0)
    for i in range(a.shape[0]):
        d = np.float32(abs(a[i] - b[i]))
        d = np.float32(0.0) if d != d else d
        d = big if d > big else d
        m = max(m, d)
    return m


class RneGrid(NamedTuple):
    """Constants of the fast RNE + saturate cast onto an ExMy grid with subnormals: ONE record
    passed to the kernels (numba passes it by value)."""

    shift: np.uint32  # float32 significand bits below the grid (23 - mbits)
    half_m1: np.uint32  # half an ulp of the grid, minus 1, in those bits
    lowmask: np.uint32  # clears the bits below the grid
    emin_bits: np.uint32  # float32 bits of the smallest normal binade's exponent
    maxbits: np.uint32  # float32 bits of the format's max
    magic: np.float32  # 2**(emin - mbits + 23): the subnormal quantum's magic-number add
    signed_zero: bool


# the grid argument of a pure multiply (op _MUL), where no rounding happens
_NO_GRID = RneGrid(*(np.uint32(0),) * 5, np.float32(0.0), False)

# what a block walk does per element: of = x*s; of = rne(x*s); and df = of*inv as well
_MUL, _CAST, _CAST_DEQ = 0, 1, 2


@njit(cache=True, inline="always")
def _rne_sat(y, g):
    """RNE + saturate of a float32 onto the grid ``g`` (`RneGrid`, see `_fast_params`).

    Branch-free (selects only) so that the loop around it vectorises.
    """
    u = _f32_to_u32(y)
    a = u & np.uint32(0x7FFFFFFF)
    sign = u ^ a
    # normal binades: round the fp32 significand to mbits bits (carry may bump the exponent);
    # +inf lands on 0x7F800000 and saturates with everything else above max
    an = min((a + g.half_m1 + ((a >> g.shift) & np.uint32(1))) & g.lowmask, g.maxbits)
    # below the smallest normal the quantum is fixed: RNE by the magic-number add
    asub = _f32_to_u32((abs(y) + g.magic) - g.magic)
    r = an if a >= g.emin_bits else asub
    r = a if a > np.uint32(0x7F800000) else r  # NaN stays NaN
    keep_sign = g.signed_zero or r != np.uint32(0)
    sign = sign if keep_sign else np.uint32(0)
    return _u32_to_f32(np.uint32(sign | r))


# One multiplier per segment (`_seg_*`) or one per element (`_segv_*`, narrow blocks); each is a
# branch-free loop LLVM vectorises, so the op is chosen once per segment, outside it.
@njit(cache=True)
def _seg_mul(xs, os, s):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = xs[i] * s


@njit(cache=True)
def _seg_cast(xs, os, s, g):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = _rne_sat(xs[i] * s, g)


@njit(cache=True)
def _seg_cast_deq(xs, os, ds, s, inv, g):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        v = _rne_sat(xs[i] * s, g)
        os[i] = v
        ds[i] = v * inv


@njit(cache=True)
def _segv_mul(xs, os, sv):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = xs[i] * sv[i]


@njit(cache=True)
def _segv_cast(xs, os, sv, g):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        os[i] = _rne_sat(xs[i] * sv[i], g)


@njit(cache=True)
def _segv_cast_deq(xs, os, ds, sv, iv, g):  # pragma: no cover - numba
    for i in range(xs.shape[0]):
        v = _rne_sat(xs[i] * sv[i], g)
        os[i] = v
        ds[i] = v * iv[i]


@njit(cache=True)
def _walk_blocks(x, rows, cols, bm, bk, mult, inv, of, df, op, g):  # pragma: no cover - numba
    """Over flat float32 [rows, cols] arrays, per block (br, cb) with multiplier
    ``s = mult[br, cb]``: ``of = x * s`` (op `_MUL`), ``of = RNE_saturate(x * s)`` onto the grid
    ``g`` (`_CAST`), and also ``df = of * inv[br, cb]`` (`_CAST_DEQ`: the dequantized tensor,
    bit for bit `QTensor.dequantize`). Walks rows in memory order, one segment per block."""
    for r in range(rows):
        br = r // bm
        base = r * cols
        for cb in range(mult.shape[1]):
            c0 = base + cb * bk
            c1 = base + min((cb + 1) * bk, cols)
            if op == _MUL:
                _seg_mul(x[c0:c1], of[c0:c1], mult[br, cb])
            elif op == _CAST:
                _seg_cast(x[c0:c1], of[c0:c1], mult[br, cb], g)
            else:
                _seg_cast_deq(x[c0:c1], of[c0:c1], df[c0:c1], mult[br, cb], inv[br, cb], g)


@njit(cache=True)
def _expand_row(mult_row, bk, cols, out):  # pragma: no cover - numba
    for c in range(cols):
        out[c] = mult_row[c // bk]


@njit(cache=True)
def _walk_narrow(x, rows, cols, bm, bk, mult, inv, of, df, op, g):  # pragma: no cover - numba
    """`_walk_blocks` for narrow blocks (``bk`` of a few columns, e.g. (128, 1)): the block
    row's multipliers are expanded to one per column once, so each row is one vectorisable sweep
    instead of ``cols / bk`` tiny segments."""
    sv = np.empty(cols, dtype=np.float32)
    iv = np.empty(cols, dtype=np.float32)
    for br in range(mult.shape[0]):
        _expand_row(mult[br], bk, cols, sv)
        if op == _CAST_DEQ:
            _expand_row(inv[br], bk, cols, iv)
        for r in range(br * bm, min((br + 1) * bm, rows)):
            a, b = r * cols, (r + 1) * cols
            if op == _MUL:
                _segv_mul(x[a:b], of[a:b], sv)
            elif op == _CAST:
                _segv_cast(x[a:b], of[a:b], sv, g)
            else:
                _segv_cast_deq(x[a:b], of[a:b], df[a:b], sv, iv, g)


# blocks narrower than this many columns use the expanded-multiplier walk
_NARROW = 32


# ------------------------------------------------------------- stochastic and two-level casts
# The cast pass of stochastic rounding and of NVFP4's two-level dequantized copy, one pass over
# x instead of three (multiply, `fp8lab.cast`, dequantize, then the second-level multiply):
# ``of = cast(x * s)`` with ``s`` the block's multiplier, rounded nearest-even (`_rne_sat`) or
# stochastically (`fp8lab.formats.rounding._sr_one`, the random bits of element ``r * cols + c``
# under the call's seed: what `fp8lab.cast` draws for the flat [R, C] tensor), and
# ``df = fl32(of * inv) * gd`` (``gd``: the block's second-level scale; 1 for one-level specs).
@njit(cache=True)
def _segx_rne(xs, os, ds, sv, iv, gv, deq, g):  # pragma: no cover - numba
    """One row segment, per-element factors (``sv``, ``iv``, ``gv``), nearest even."""
    if deq:
        for i in range(xs.shape[0]):
            v = _rne_sat(xs[i] * sv[i], g)
            os[i] = v
            ds[i] = (v * iv[i]) * gv[i]
    else:
        for i in range(xs.shape[0]):
            os[i] = _rne_sat(xs[i] * sv[i], g)


@njit(cache=True)
def _segx_sr(xs, os, ds, sv, iv, gv, deq, sg, seed, i0):  # pragma: no cover - numba
    """`_segx_rne` with stochastic rounding onto the fast grid ``sg``; ``i0``: the flat index
    of ``xs[0]`` (the random stream's counter)."""
    for i in range(xs.shape[0]):
        u = _f32_to_u32(np.float32(xs[i] * sv[i]))
        v = _u32_to_f32(np.uint32(_sr_one(u, i0 + i, sg, 3, seed, 0)))
        os[i] = v
        if deq:
            ds[i] = (v * iv[i]) * gv[i]


@njit(cache=True)
def _expand_blocks(row, bk, cols, out):  # pragma: no cover - numba
    """``out[c] = row[c // bk]`` for ``c < cols`` without a division per element."""
    n = cols // bk
    for cb in range(n):
        v = row[cb]
        for t in range(bk):
            out[cb * bk + t] = v
    for c in range(n * bk, cols):
        out[c] = row[n]


@njit(cache=True)
def _walk_ext(
    x, rows, cols, bm, bk, mult, inv, gd, of, df, deq, sr, g, sg, seed
):  # pragma: no cover
    """The cast pass (section comment) over flat float32 [rows, cols] arrays with ``[nr, nc]``
    factors, rows in memory order, each row one sweep with one factor per element: a block one
    column wide (e.g. NVFP4's 16x1 column copy) reads its block row's factor rows in place,
    wider blocks expand them once per block row."""
    nc = mult.shape[1]
    sv = np.empty(cols, dtype=np.float32)
    iv = np.empty(cols if deq else 0, dtype=np.float32)
    gv = np.empty(cols if deq else 0, dtype=np.float32)
    for br in range(mult.shape[0]):
        if bk == 1 and nc == cols:
            sv, iv, gv = mult[br], inv[br], gd[br]
        else:
            _expand_blocks(mult[br], bk, cols, sv)
            if deq:
                _expand_blocks(inv[br], bk, cols, iv)
                _expand_blocks(gd[br], bk, cols, gv)
        for r in range(br * bm, min((br + 1) * bm, rows)):
            a, b = r * cols, (r + 1) * cols
            if sr:
                _segx_sr(x[a:b], of[a:b], df[a:b], sv, iv, gv, deq, sg, seed, a)
            else:
                _segx_rne(x[a:b], of[a:b], df[a:b], sv, iv, gv, deq, g)


def _walk(x, rows: int, cols: int, m: int, k: int, mult, inv, of, df, op: int, g: RneGrid) -> None:
    """`_walk_blocks` or, for narrow blocks, `_walk_narrow` (flat float32 numpy arrays)."""
    kernel = _walk_narrow if (k < _NARROW and k < cols) else _walk_blocks
    kernel(x, rows, cols, m, k, mult, inv, of, df, op, g)


def _mul_blocks(x, rows: int, cols: int, m: int, k: int, mult, of) -> None:
    """of = x * mult[block] over flat float32 arrays (numba; narrow blocks swept per row)."""
    _walk(x, rows, cols, m, k, mult, mult, of, of, _MUL, _NO_GRID)


def mul_blocks(x2: torch.Tensor, mult: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """``x2 * mult[block]`` (float32 ``[R, C]`` contiguous, ``mult`` float32 ``[nr, nc]``, the
    block ``(m, k)`` resolved): a fresh float32 ``[R, C]`` tensor on ``x2``'s device, one float32
    multiply per element (`QTensor.dequantize`'s pass)."""
    out = torch.empty(x2.shape, dtype=torch.float32, device=x2.device)
    if x2.numel() == 0:
        return out
    if use_torch(x2, what="dequantize"):
        return _t_mul_blocks(x2, mult.to(device=x2.device, dtype=torch.float32), m, k, out)
    rows, cols = x2.shape
    mult_np = np.ascontiguousarray(mult.to(torch.float32).numpy())
    _mul_blocks(x2.view(-1).numpy(), rows, cols, m, k, mult_np, out.view(-1).numpy())
    return out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` of two float32 tensors of one shape, NaN -> 0 and inf -> FLT_MAX per
    element (0.0 when empty): the re-tiling's added error."""
    if a.numel() == 0:
        return 0.0
    a = a.detach().reshape(-1).to(torch.float32).contiguous()
    b = b.detach().reshape(-1).to(torch.float32).contiguous()
    if use_torch(a, b, what="max abs diff"):
        return _t_max_abs_diff(a, b)
    return float(_max_abs_diff(a.numpy(), b.numpy()))


def _fast_params(spec: QuantSpec) -> RneGrid | None:
    """Kernel constants of the fast RNE + saturate path, or None if the spec needs `cast`."""
    return _fast_params_for(spec.format, spec.rounding, spec.saturate)


@functools.lru_cache(maxsize=64)
def _fast_params_for(fmt_name: str, rounding: str, saturate: bool) -> RneGrid | None:
    f = get_format(fmt_name)
    if (
        rounding != "nearest_even"
        or not saturate
        or f.kind != "exmy"
        or not f.subnormals
        or not f.signed
        or not f.has_zero
        or f.mbits >= 23
        or f.emin < -126
        or f.emin - f.mbits < -149
    ):
        return None
    shift = 23 - f.mbits
    return RneGrid(
        shift=np.uint32(shift),
        half_m1=np.uint32((1 << (shift - 1)) - 1),
        lowmask=np.uint32(~((1 << shift) - 1) & 0xFFFFFFFF),
        emin_bits=np.uint32((f.emin + 127) << 23),
        maxbits=np.uint32(np.array(f.max, dtype=np.float32).view(np.uint32)),
        magic=np.float32(2.0 ** (f.emin - f.mbits + 23)),
        signed_zero=bool(f.signed_zero),
    )


@functools.lru_cache(maxsize=64)
def _sr_grid_for(fmt_name: str, saturate: bool) -> Any:
    return _grids(get_format(fmt_name), saturate, 3)[1]


def _sr_grid(spec: QuantSpec) -> Any:
    """`fp8lab.cast`'s fast-kernel record of the spec's format for stochastic rounding, or None
    (another rounding, or a format the fast kernel cannot describe)."""
    if spec.rounding != "stochastic":
        return None
    return _sr_grid_for(spec.format, spec.saturate)


def _block_amax_fast(x2: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block NaN-ignoring amax of a contiguous float32 [R, C] tensor (numba)."""
    rows, cols = x2.shape
    m, k = resolve_block(block, (rows, cols))
    nr, nc = num_blocks((rows, cols), (m, k))
    return block_amax(x2, m, k, nr, nc)


def block_amax(x2: torch.Tensor, m: int, k: int, nr: int, nc: int) -> torch.Tensor:
    """`_block_amax_fast` with the block ``(m, k)`` and the block counts ``(nr, nc)`` resolved
    (`fp8lab.qtensor.quantizer.Quantizer` resolves them once per shape)."""
    if use_torch(x2, what="block amax"):
        return _t_block_amax(x2, m, k, nr, nc)
    rows, cols = x2.shape
    if x2.numel() == 0:
        return torch.zeros((nr, nc), dtype=torch.float32)
    if m > 1:
        # blocks taller than one row: a row-major sweep keeping one running max per column
        # (a column-wise walk over (128, 1) blocks measured 40 ms on 2048 x 4096, this 2 ms)
        out = np.empty((nr, nc), dtype=np.uint32)
        acc = np.empty(cols, dtype=np.uint32)
        _row_block_amax(x2.view(-1).numpy().view(np.uint32), rows, cols, m, k, acc, out)
        return torch.from_numpy(out.view(np.float32))
    chunk = m if m <= _AMAX_CHUNK else math.gcd(m, _AMAX_CHUNK)
    nt = -(-rows // chunk)
    part = np.empty((nt, nc), dtype=np.uint32)
    _partial_amax(x2.view(-1).numpy().view(np.uint32), rows, cols, m, k, chunk, part)
    pt = torch.from_numpy(part.view(np.float32))
    per = m // chunk
    if per == 1:
        return pt
    if nt != nr * per:
        pt = torch.cat([pt, pt.new_zeros((nr * per - nt, nc))])
    return pt.reshape(nr, per, nc).amax(dim=1)


def scale_cast(
    x2: torch.Tensor,
    mult: torch.Tensor,
    m: int,
    k: int,
    g: RneGrid | None,
    spec: QuantSpec,
    generator: torch.Generator | None,
    out: torch.Tensor | None = None,
    deq: torch.Tensor | None = None,
    inv: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """values = cast(x * mult[block]) for a contiguous float32 [R, C] tensor; float32 [R, C].

    The block ``(m, k)`` is resolved; ``g``: the fast path's grid (`_fast_params`; None: the
    generic `fp8lab.cast`). ``out``: a contiguous float32 [R, C] buffer for the values (else
    allocated). ``deq``: a second buffer that receives ``values * inv[block] (* global_scale)``,
    bit for bit what `QTensor.dequantize` computes, fused into the cast pass on the fast path.
    Runs on ``x2``'s device (`fp8lab.kernels.use_torch`); the buffers must be there too.
    """
    rows, cols = x2.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=x2.device)
    if x2.numel() == 0:
        return out
    if use_torch(x2, out, deq, what="quantize"):
        return _t_scale_cast(x2, mult, (m, k), g, spec, generator, out, deq, inv, global_scale)
    mult_np = np.ascontiguousarray(mult.to(torch.float32).numpy())
    xf = x2.view(-1).numpy()
    of = out.view(-1).numpy()
    sg = _sr_grid(spec) if g is None else None
    if sg is not None or (g is not None and global_scale is not None and deq is not None):
        # stochastic rounding, or a two-level (NVFP4) dequantized copy: one fused pass
        nr, nc = mult_np.shape
        want = deq is not None
        inv_np, gd, df = mult_np, mult_np, of
        if want:
            inv_np = np.ascontiguousarray(inv.to(torch.float32).reshape(nr, nc).numpy())
            gs = torch.ones(()) if global_scale is None else global_scale.to(torch.float32)
            gd = np.ascontiguousarray(gs.expand(nr, nc).numpy())
            df = deq.view(-1).numpy()
        seed = _seed(generator) if sg is not None else 0
        _walk_ext(xf, rows, cols, m, k, mult_np, inv_np, gd, of, df, want, sg is not None,
                  _NO_GRID if g is None else g, sg or _sr_grid_for("e2m1", True), seed)  # fmt: skip
        return out
    if g is not None:
        if deq is None:
            _walk(xf, rows, cols, m, k, mult_np, mult_np, of, of, _CAST, g)
            return out
        inv_np = np.ascontiguousarray(inv.to(torch.float32).reshape(mult_np.shape).numpy())
        _walk(xf, rows, cols, m, k, mult_np, inv_np, of, deq.view(-1).numpy(), _CAST_DEQ, g)
        if global_scale is not None:
            deq.mul_(global_scale)
        return out
    _mul_blocks(xf, rows, cols, m, k, mult_np, of)
    cast(
        out, spec.fmt, rounding=spec.rounding, saturate=spec.saturate, generator=generator, out=out
    )
    if deq is not None:
        inv_np = np.ascontiguousarray(inv.to(torch.float32).reshape(mult_np.shape).numpy())
        _mul_blocks(of, rows, cols, m, k, inv_np, deq.view(-1).numpy())
        if global_scale is not None:
            deq.mul_(global_scale)
    return out
