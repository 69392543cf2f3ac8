"""Device-generic torch twins of the quantize kernels (`fp8lab.qtensor.kernels`): block amax,
the scaled cast onto the element grid (its RNE + saturate fast path) and the block multiply.

They give the same bits as the numba kernels on the same input (tests/qtensor/
test_kernels_torch.py) and run on any device torch runs on. `fp8lab.qtensor.kernels` dispatches
to them through `fp8lab.kernels.use_torch`.

How the bits are kept with tensor operations:

* block amax: ``max |x|`` is an integer max over the float32 bits with NaN ignored. The bits are
  rotated, ``r = (bits + 0x7FFFFF) & 0x7FFFFFFF``: this drops the sign, keeps the order of every
  non-NaN magnitude (0 .. inf map to 0x7FFFFF .. 0x7FFFFFFF) and sends every NaN below them
  (0 .. 0x7FFFFE), so one integer ``amax`` per block ignores NaN without a select;
  ``max - 0x7FFFFF`` clamped at 0 is the amax's bits (an all-NaN block gives 0, as numba).
* RNE + saturate onto an ExMy grid with subnormals: ``|y|`` is clamped to the format's max
  first (rounding never exceeds a grid point at or above, so this equals numba's round-then-
  saturate), then rounded by one magic-number add: ``(|y| + C) - C`` with
  ``C = 2**(max(E, emin) + 23 - mbits)`` (``E``: the binade of ``|y|``). The sum lies in
  ``[C, 2C]`` whose float32 ulp is the grid's quantum at ``|y|``, so the add rounds to nearest
  even onto the grid and the subtraction is exact. ``C`` is the exponent field of
  ``max(|y|, 2**emin)`` times ``2**(23 - mbits)`` (an exact power-of-two ``alpha``). The sign is
  put back from ``x`` (the multipliers are positive). Grids whose ``C`` would overflow (a top
  binade above ``2**(104 + mbits)``, e.g. bf16) take `fp8lab.cast` instead.

On the CPU every pass runs over chunks of ``_CPU_CHUNK`` elements (whole block rows, or a part of
one block row), so the chunk's temporaries stay in cache and are allocated once per call; on other
devices one chunk covers the tensor (one kernel launch per operation). NaN: a NaN in gives a NaN
out at the same place; its payload and sign are not part of fp8lab's arithmetic (CUDA returns its
canonical NaN).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import torch

from fp8lab.formats import cast

__all__ = ["block_amax", "max_abs_diff", "mul_blocks", "scale_cast"]

# elements per pass on the CPU: a chunk and its scratch (2 x 1 MiB) stay in L2
_CPU_CHUNK = 1 << 18
_ROT = 0x007FFFFF  # the amax rotation (module doc)
_ABS = 0x7FFFFFFF
_EXP = 0x7F800000
_SIGN = -0x80000000  # 0x80000000 as int32
_FLT_MAX = torch.finfo(torch.float32).max


def _row_chunks(rows: int, cols: int, m: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` covering ``[0, rows)``: each either whole block rows (starting on
    a block-row boundary, the last one possibly ragged) or a part of one block row."""
    step = max(1, _CPU_CHUNK // max(cols, 1)) if device.type == "cpu" else rows
    if step >= m:
        step = step // m * m
        for r0 in range(0, rows, step):
            yield r0, min(r0 + step, rows)
        return
    for b0 in range(0, rows, m):
        b1 = min(b0 + m, rows)
        for r0 in range(b0, b1, step):
            yield r0, min(r0 + step, b1)


def _tiles(
    r0: int, r1: int, cols: int, m: int, k: int
) -> Iterator[tuple[slice, slice, tuple[int, int, int, int], slice, slice]]:
    """The rectangles of the rows ``[r0, r1)`` (a `_row_chunks` range) that tile into whole or
    ragged blocks: ``(rows, cols, (a, m', c, k'), block rows, block cols)``; the rectangle viewed
    as ``[a, m', c, k']`` has block ``(i, j)`` at ``[i, :, j, :]``."""
    n = r1 - r0
    full_r = n // m * m if r0 % m == 0 else 0
    full_c = cols // k * k
    rest_c = cols - full_c
    br0 = r0 // m
    if full_r:
        nb = full_r // m
        rows, brs = slice(r0, r0 + full_r), slice(br0, br0 + nb)
        if full_c:
            yield rows, slice(0, full_c), (nb, m, full_c // k, k), brs, slice(0, full_c // k)
        if rest_c:
            yield rows, slice(full_c, cols), (nb, m, 1, rest_c), brs, slice(full_c // k, None)
    if full_r < n:
        rows = slice(r0 + full_r, r1)
        br = (r0 + full_r) // m
        brs = slice(br, br + 1)
        if full_c:
            yield (
                rows,
                slice(0, full_c),
                (1, n - full_r, full_c // k, k),
                brs,
                slice(0, full_c // k),
            )
        if rest_c:
            yield (
                rows,
                slice(full_c, cols),
                (1, n - full_r, 1, rest_c),
                brs,
                slice(full_c // k, None),
            )


def block_amax(x2: torch.Tensor, m: int, k: int, nr: int, nc: int) -> torch.Tensor:
    """Per-block NaN-ignoring ``max |x|`` of a contiguous float32 ``[R, C]`` tensor: float32
    ``[nr, nc]`` on ``x2``'s device, bit for bit the numba kernel (module doc: the rotation).

    On the CPU a tensor without NaN takes a shortcut: ``max(max x, -min x)`` per block from two
    float reductions (no temporaries; |x| orders like its bits), ``abs`` making a zero block +0;
    any NaN sends the call to the rotation (checking a CUDA result would cost a host sync)."""
    rows, cols = x2.shape
    acc = torch.zeros((nr, nc), dtype=torch.int32, device=x2.device)
    if x2.numel() == 0:
        return acc.view(torch.float32)
    if x2.device.type == "cpu":
        hl = acc.view(torch.float32)
        for rs, cs, shape4, brs, bcs in _tiles(0, rows, cols, m, k):
            t = x2[rs, cs].view(shape4)
            hi, lo = t.amax(dim=3).amax(dim=1), t.amin(dim=3).amin(dim=1)
            hl[brs, bcs] = torch.maximum(hi, lo.neg_()).abs_()
        if not bool(torch.isnan(hl).any()):
            return hl
        acc.zero_()
    xi = x2.view(torch.int32)
    scratch = None
    for r0, r1 in _row_chunks(rows, cols, m, x2.device):
        n = (r1 - r0) * cols
        if scratch is None:
            scratch = torch.empty(n, dtype=torch.int32, device=x2.device)
        rot = torch.add(xi[r0:r1], _ROT, out=scratch[:n].view(r1 - r0, cols))
        rot.bitwise_and_(_ABS)
        for rs, cs, shape4, brs, bcs in _tiles(r0, r1, cols, m, k):
            rs = slice(rs.start - r0, rs.stop - r0)
            part = rot[rs, cs].view(shape4).amax(dim=3).amax(dim=1)
            torch.maximum(acc[brs, bcs], part, out=part)
            acc[brs, bcs] = part
    return acc.sub_(_ROT).clamp_(min=0).view(torch.float32)


def mul_blocks(
    x2: torch.Tensor,
    mult: torch.Tensor,
    m: int,
    k: int,
    out: torch.Tensor,
    chunk: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out = x2 * mult[block]`` for float32 ``[R, C]`` tensors and float32 ``[nr, nc]``
    multipliers, one float32 multiply per element as numba's ``_mul_blocks``; over the rows of
    ``chunk`` (a `_row_chunks` range) or all rows. Returns ``out``."""
    rows, cols = x2.shape
    chunks = _row_chunks(rows, cols, m, x2.device) if chunk is None else (chunk,)
    for r0, r1 in chunks if cols else ():
        for rs, cs, (a, b, c, d), brs, bcs in _tiles(r0, r1, cols, m, k):
            mt = mult[brs, bcs].reshape(a, 1, c, 1)
            torch.mul(x2[rs, cs].view(a, b, c, d), mt, out=out[rs, cs].view(a, b, c, d))
    return out


def _f32(bits: Any) -> float:
    """The float32 whose bits are ``bits``."""
    return struct.unpack("<f", struct.pack("<I", int(bits)))[0]


def _fast_ok(g: Any) -> bool:
    """Whether the magic-number rounding applies to the grid ``g`` (its ``C`` stays finite)."""
    return (int(g.maxbits) >> 23) + int(g.shift) <= 254


def _rne_sat_(o: torch.Tensor, xs: torch.Tensor, g: Any, scratch: torch.Tensor) -> None:
    """``o = RNE_saturate(o)`` onto the grid ``g`` (a `fp8lab.qtensor.kernels.RneGrid`) in place;
    ``o`` = ``|xs * multiplier|`` (flat float32), ``xs`` gives the signs, ``scratch`` a float32
    buffer of ``o``'s size (module doc: the magic-number add)."""
    fmax, tiny = _f32(g.maxbits), _f32(g.emin_bits)
    alpha = float(2 ** int(g.shift))
    o.clamp_(max=fmax)  # saturate first; NaN stays NaN
    torch.clamp(o, min=tiny, out=scratch)  # below 2**emin the quantum is fixed
    scratch.view(torch.int32).bitwise_and_(_EXP)  # 2**E: C = 2**E * alpha, exact
    o.add_(scratch, alpha=alpha).sub_(scratch, alpha=alpha)
    # the sign of x (= the sign of x * multiplier) onto |result|: an OR of the sign bits, which
    # runs faster than torch.copysign on the CPU
    sign = torch.bitwise_and(xs.view(torch.int32), _SIGN, out=scratch.view(torch.int32))
    o.view(torch.int32).bitwise_or_(sign)
    if not g.signed_zero:
        o.add_(0.0)  # -0 + 0 = +0: a format without -0


def scale_cast(
    x2: torch.Tensor, mult: torch.Tensor, block: tuple[int, int], g: Any, spec: Any,
    generator: torch.Generator | None, out: torch.Tensor, deq: torch.Tensor | None,
    inv: torch.Tensor | None, global_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`fp8lab.qtensor.kernels.scale_cast` on ``x2``'s device, into its (allocated) ``out``:
    ``values = cast(x * mult[block])`` (float32 ``[R, C]``, not empty), the dequantized copy into
    ``deq`` when given."""
    rows, cols = x2.shape
    m, k = block
    dev = x2.device
    mult = mult.to(device=dev, dtype=torch.float32).reshape(-1, mult.shape[-1])
    inv = None if inv is None else inv.to(device=dev, dtype=torch.float32).reshape(mult.shape)
    if g is None or not _fast_ok(g):
        mul_blocks(x2, mult, m, k, out)
        cast(out, spec.fmt, rounding=spec.rounding, saturate=spec.saturate,
             generator=generator, out=out)  # fmt: skip
        if deq is not None:
            mul_blocks(out, inv, m, k, deq)
    else:
        scratch = None
        in_place = out.data_ptr() == x2.data_ptr()  # quantize(y, out=y): keep the signs
        for r0, r1 in _row_chunks(rows, cols, m, dev):
            signs = x2[r0:r1].view(-1)
            signs = signs.clone() if in_place else signs
            # |x| * multiplier = |x * multiplier| (multipliers are positive): the abs into the
            # output, then the multiply in place, run faster than a multiply into another buffer
            torch.abs(x2[r0:r1], out=out[r0:r1])
            mul_blocks(out, mult, m, k, out, (r0, r1))
            o = out[r0:r1].view(-1)
            if scratch is None:
                scratch = torch.empty(o.numel(), dtype=torch.float32, device=dev)
            _rne_sat_(o, signs, g, scratch[: o.numel()])
            if deq is not None:
                mul_blocks(out, inv, m, k, deq, (r0, r1))
    if deq is not None and global_scale is not None:
        deq.mul_(global_scale)
    return out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over two float32 tensors of one shape, NaN -> 0 and inf -> FLT_MAX per
    element (numba's ``_max_abs_diff``); 0.0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    d = torch.sub(a, b).abs_()
    return float(torch.nan_to_num_(d, nan=0.0, posinf=_FLT_MAX).amax())
