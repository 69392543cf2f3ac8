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

The scaled cast (multiply, round, sign, and the dequantized copy) runs as ONE compiled pass over
each rectangle of whole blocks (`_cast_rect` under torch.compile: inductor's C++ on the CPU, Triton
on CUDA), used only after it gave the eager passes' bits on a probe of its layout
(`fp8lab.formats.rounding_torch.verified`, as the compiled cast), else as eager passes. Eager, on
the CPU every pass runs over chunks of ``_CPU_CHUNK`` elements (whole block rows, or a part of one
block row), so the chunk's temporaries stay in cache and are allocated once per call; on other
devices one chunk covers the tensor (one kernel launch per operation). No pass reads a value back
to the host (no ``.item()``), except the CPU amax's NaN check. NaN: a NaN in gives a NaN out at the
same place; its payload and sign are not part of fp8lab's arithmetic (CUDA returns its canonical
NaN).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fp8lab.formats import cast, rounding_torch

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

    On the CPU a first pass takes the integer max of the bits of ``|x|`` (one op per element
    instead of the rotation's two): NaN sorts above inf there, so only a result above inf's bits
    (a block with a NaN) sends the call to the rotation (checking a CUDA result would cost a host
    sync, so other devices rotate at once)."""
    acc = torch.zeros((nr, nc), dtype=torch.int32, device=x2.device)
    if x2.numel() == 0:
        return acc.view(torch.float32)
    if x2.device.type == "cpu":
        _amax_pass(x2, m, k, acc, rotate=False)
        if not bool((acc > _EXP).any()):
            return acc.view(torch.float32)
        acc.zero_()
    _amax_pass(x2, m, k, acc, rotate=True)
    return acc.sub_(_ROT).clamp_(min=0).view(torch.float32)


def _amax_pass(x2: torch.Tensor, m: int, k: int, acc: torch.Tensor, rotate: bool) -> None:
    """``acc[block] = max(acc[block], max over the block of t)`` (int32), ``t`` the bits of
    ``|x|`` or, with ``rotate``, the rotated bits (module doc); one chunk at a time."""
    rows, cols = x2.shape
    xi = x2.view(torch.int32)
    scratch = None
    for r0, r1 in _row_chunks(rows, cols, m, x2.device):
        n = (r1 - r0) * cols
        if scratch is None:
            scratch = torch.empty(n, dtype=torch.int32, device=x2.device)
        t = scratch[:n].view(r1 - r0, cols)
        if rotate:
            torch.add(xi[r0:r1], _ROT, out=t).bitwise_and_(_ABS)
        else:
            torch.bitwise_and(xi[r0:r1], _ABS, out=t)
        for rs, cs, (a, b, c, d), brs, bcs in _tiles(r0, r1, cols, m, k):
            tile = t[slice(rs.start - r0, rs.stop - r0), cs]
            if m == 1:  # a block row is one row, in no other chunk: no max with acc
                acc[brs, bcs] = tile.view(a, c, d).amax(dim=2)
                continue
            part = tile.view(a, b, c, d).amax(dim=3).amax(dim=1)
            torch.maximum(acc[brs, bcs], part, out=part)
            acc[brs, bcs] = part


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


@functools.lru_cache(maxsize=64)
def _grid_args(g: Any) -> tuple[float, float, float, float | None]:
    """``(max, 2**emin, alpha, zero)`` of the grid ``g`` (a `fp8lab.qtensor.kernels.RneGrid`):
    the constants of `_rne_sat_` (exact float32 values); ``zero`` is None for a format with -0
    and 0.0 for one without (adding +0 turns -0 into +0)."""
    zero = None if g.signed_zero else 0.0
    return _f32(g.maxbits), _f32(g.emin_bits), float(2 ** int(g.shift)), zero


_CONSTS: dict[tuple[Any, torch.device], torch.Tensor] = {}


def _grid_tensor(g: Any, device: torch.device) -> torch.Tensor:
    """`_grid_args` as a float32 tensor on ``device`` (cached), ``zero`` -0.0 for a format with
    -0 (adding -0 changes no value): a compiled `_cast_rect` reads its constants from a tensor,
    so it is one kernel for every format (no recompile per value)."""
    hit = _CONSTS.get((g, device))
    if hit is None:
        *c, zero = _grid_args(g)
        hit = torch.tensor([*c, -0.0 if zero is None else zero], device=device)
        _CONSTS[(g, device)] = hit
    return hit


def _rne_sat_(
    o: torch.Tensor, xs: torch.Tensor, fmax: Any, tiny: Any, alpha: Any, zero: Any,
    scratch: torch.Tensor,
) -> None:  # fmt: skip
    """``o = RNE_saturate(o)`` onto a grid in place; ``o`` = ``|xs * mult|`` (float32), ``xs``
    gives the signs, ``scratch`` a float32 buffer of ``o``'s shape; the grid's constants as
    numbers or 0-d tensors (`_grid_args`; module doc: the magic-number add). Runs eagerly on
    chunks, and compiled inside `_cast_rect`."""
    o.clamp_(max=fmax)  # saturate first; NaN stays NaN
    torch.clamp(o, min=tiny, out=scratch)  # below 2**emin the quantum is fixed
    scratch.view(torch.int32).bitwise_and_(_EXP)  # 2**E
    scratch.mul_(alpha)  # C = 2**E * alpha: exact
    # (o + C) - C; the clamp above keeps the multiply that made o from being contracted into
    # this add (an FMA rounds once instead of twice: Triton contracts)
    o.add_(scratch).sub_(scratch)
    # the sign of x (= the sign of x * multiplier) onto |result|: an OR of the sign bits, which
    # runs faster than torch.copysign on the CPU
    sign = torch.bitwise_and(xs.view(torch.int32), _SIGN, out=scratch.view(torch.int32))
    o.view(torch.int32).bitwise_or_(sign)
    if zero is not None:
        o.add_(zero)  # -0 + 0 = +0 (a format without -0); -0.0 keeps every value


def _cast_rect(
    x: torch.Tensor, mult: torch.Tensor, out: torch.Tensor, k: torch.Tensor,
    inv: torch.Tensor | None, deq: torch.Tensor | None,
) -> None:  # fmt: skip
    """The fast path on whole blocks (a `_rect_layout` view): ``out = RNE_saturate(|x| * mult)``
    with the signs of ``x`` (``mult`` broadcasts over the blocks), ``deq = out * inv`` when
    given; ``k``: `_grid_tensor`. `_compiled_cast` compiles it into one pass over the data."""
    o = torch.abs(x).mul_(mult)
    _rne_sat_(o, x, k[0], k[1], k[2], k[3], torch.empty_like(o))
    out.copy_(o)
    if deq is not None:
        torch.mul(o, inv, out=deq)


def _rect_layout(shape4: tuple[int, int, int, int]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """A `_tiles` rectangle ``[a, m, c, k]`` (multipliers ``[a, 1, c, 1]``) with its dims of
    size 1 dropped and neighbours of one role merged: the shape, and per dim whether the
    multipliers vary along it. E.g. 1x128 blocks: ``[rows * c, 128]``, (True, False); one scale:
    ``[n]``, (False,). Few layouts, so few compiled kernels (each dynamic in its sizes)."""
    dims: list[list[int]] = []
    for size, varies in zip(shape4, (True, False, True, False), strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == varies:
            dims[-1][0] *= size
        else:
            dims.append([size, varies])
    if not dims:
        return (1,), (False,)
    return tuple(d[0] for d in dims), tuple(bool(d[1]) for d in dims)


def _probe_rect(
    kernel: Callable[..., None], varies: tuple[bool, ...], k: torch.Tensor, deq: bool
) -> torch.Tensor:
    """`_cast_rect` (``kernel``: eager or compiled) on a probe of the layout ``varies``
    (`_rect_layout`): ~`rounding_torch.PROBE_N` inputs (every bf16 pattern, then random bits;
    odd sizes, so vector loops take their tails), positive multipliers of every binade (subnormal
    ones included) and their reciprocals; the outputs' bits, NaN canonical."""
    sizes = [5, 3, 7][: len(varies) - 1]
    n = rounding_torch.PROBE_N // math.prod(sizes)
    sizes.append(n - 1 + n % 2)
    dev = k.device
    x = rounding_torch.probe(dev)[: math.prod(sizes)].view(torch.float32).view(sizes).detach()
    mshape = [size if v else 1 for size, v in zip(sizes, varies, strict=True)]
    gen = torch.Generator().manual_seed(0x5CA1E)
    mbits = torch.randint(1, 0x7F800000, mshape, dtype=torch.int32, generator=gen)
    mbits.view(-1)[0] = 0x3F490FDB  # pi / 4: the only multiplier of a one-scale layout
    mult = mbits.view(torch.float32).to(dev)
    out = torch.empty_like(x)
    inv, dq = (torch.reciprocal(mult), torch.empty_like(x)) if deq else (None, None)
    kernel(x, mult, out, k, inv, dq)
    return torch.cat([rounding_torch.canonical_bits(t) for t in (out, dq) if t is not None])


def _compiled_cast(
    x2: torch.Tensor, mult: torch.Tensor, block: tuple[int, int], g: Any, out: torch.Tensor,
    deq: torch.Tensor | None, inv: torch.Tensor | None,
) -> bool:  # fmt: skip
    """The fast path as compiled `_cast_rect` calls (one per rectangle of whole blocks, at most
    two): True when they ran; False where the eager passes must run instead: few elements (the
    rules of `fp8lab.formats.rounding_torch.compiled_kernel`), columns that do not tile (strided
    rectangles), ``out`` being ``x2``, or a compiled kernel that does not give the eager bits on
    its probe (`rounding_torch.verified`, per device type, layout, output set and grid)."""
    rows, cols = x2.shape
    m, k = block
    if cols % k or out.data_ptr() == x2.data_ptr():
        return False
    fn = rounding_torch.compiled_kernel("quantize", _cast_rect, x2.numel(), x2.device)
    if fn is None:
        return False
    kt = _grid_tensor(g, x2.device)
    calls = []
    for rs, _, shape4, brs, _ in _tiles(0, rows, cols, m, k):
        shape, varies = _rect_layout(shape4)
        mshape = [size if v else 1 for size, v in zip(shape, varies, strict=True)]
        dq = None if deq is None else (inv[brs].reshape(mshape), deq[rs].view(shape))
        args = (x2[rs].view(shape), mult[brs].reshape(mshape), out[rs].view(shape), kt,
                *(dq or (None, None)))  # fmt: skip
        # detached: no view keeps its base, whose sizes dynamo would guard on (one recompile per
        # caller's slicing, and a kernel other than the probed one)
        calls.append((varies, tuple(None if a is None else a.detach() for a in args)))
    try:
        with torch._dynamo.config.patch(recompile_limit=_VARIANTS):
            for varies, _ in calls:
                key = (x2.device.type, varies, deq is not None, g)
                check = functools.partial(_probe_rect, varies=varies, k=kt, deq=deq is not None)
                if not rounding_torch.verified(fn, _cast_rect, key, "quantize", check, x2.device):
                    return False
            for _, args in calls:
                rounding_torch.call_compiled(fn, *args)
    except Exception:  # any compiler failure: the eager passes give the same bits
        rounding_torch.compile_failed()
        return False
    return True


# compiled variants of `_cast_rect` allowed (dynamo's default of 8 is too few; past the limit
# a fullgraph compile raises, and the eager kernels, the cast's too, run from then on): a
# `_rect_layout` has 1 to 4 dims of alternating roles (8 layouts), times with and without the
# dequantized copy, times CPU and CUDA, plus the rarer global modes (inference mode,
# deterministic algorithms)
_VARIANTS = 64


def scale_cast(
    x2: torch.Tensor, mult: torch.Tensor, block: tuple[int, int], g: Any, spec: Any,
    generator: torch.Generator | None, out: torch.Tensor, deq: torch.Tensor | None,
    inv: torch.Tensor | None, global_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`fp8lab.qtensor.kernels.scale_cast` on ``x2``'s device, into its (allocated) ``out``:
    ``values = cast(x * mult[block])`` (float32 ``[R, C]``, not empty), the dequantized copy into
    ``deq`` when given. The fast path runs compiled where that works (`_compiled_cast`), else as
    eager passes over chunks."""
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
    elif not _compiled_cast(x2, mult, block, g, out, deq, inv):
        fmax, tiny, alpha, zero = _grid_args(g)
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
            _rne_sat_(o, signs, fmax, tiny, alpha, zero, scratch[: o.numel()])
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
