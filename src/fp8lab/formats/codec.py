"""Bit codes of formats of 8 bits or fewer: `encode`, `decode`, torch float8 interop.

A code is stored in a uint8 holding the format's bits in its low bits (FP4: 4 bits with the sign at
bit 3; FP6: sign at bit 5), as ml_dtypes' ``view(np.uint8)`` does. `decode` is a 256-entry table
lookup; `encode` is `cast` (any rounding mode) followed by an exact value -> code lookup.

Special codes produced by `encode`: NaN -> the format's positive NaN code (e4m3 0x7F, e5m2 0x7E,
IEEE-style formats exponent all ones with the top mantissa bit, FNUZ and HiF8 0x80, E8M0 0xFF);
for FP4/FP6, which have no NaN, NaN -> the -0 code (0x8 / 0x20), as ml_dtypes does. -0 keeps its
sign bit where the format has -0.

torch dtypes: ``e4m3`` <-> ``torch.float8_e4m3fn``, ``e5m2`` <-> ``float8_e5m2``, ``e4m3fnuz``,
``e5m2fnuz`` and ``e8m0`` <-> ``float8_e8m0fnu``, same bits both ways (a ``view``, never a torch
cast: torch's own float -> e8m0fnu conversion rounds differently, see the README).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from fp8lab.formats import codec_torch as _ct
from fp8lab.formats import hif8 as _hif8
from fp8lab.formats.rounding import _check_tensor, cast
from fp8lab.formats.spec import FloatFormat, get_format
from fp8lab.kernels import parallel, use_torch

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
    "e8m0": torch.float8_e8m0fnu,
}
_FROM_TORCH = {dt: name for name, dt in _TORCH_DTYPES.items()}


@dataclass(frozen=True)
class _CodeBook:
    table: np.ndarray  # float32[256]: value of each code (codes >= 2**bits decode to NaN)
    pos_bits: np.ndarray  # uint32[k]: float32 bits of the positive finite values, ascending
    pos_codes: np.ndarray  # uint8[k]
    sign: int  # sign-bit mask (0 for unsigned formats)
    zero: int  # code of +0
    neg_zero: int  # code of -0 (== zero when the format has no -0)
    nan: int  # code produced for NaN
    inf: int  # code of +Inf (or 0 when none)


def _exmy_values(fmt: FloatFormat) -> np.ndarray:
    """float64 value of every code 0 .. 2**bits - 1 of an ExMy format."""
    n = 1 << fmt.bits
    codes = np.arange(n, dtype=np.int64)
    sign_mask = (1 << (fmt.bits - 1)) if fmt.signed else 0
    mag = codes & ~sign_mask
    e = mag >> fmt.mbits
    m = mag & ((1 << fmt.mbits) - 1)
    top = (1 << fmt.ebits) - 1
    frac = m / float(1 << fmt.mbits)
    with np.errstate(over="ignore"):
        normal = np.ldexp(1.0 + frac, (e - fmt.bias).astype(np.int32))
        sub = np.ldexp(frac, fmt.emin)
    v = np.where((e == 0) & fmt.subnormals, sub, normal)
    if fmt.nan == "ieee":
        v = np.where((e == top) & (m != 0), np.nan, v)
    if fmt.inf:
        v = np.where((e == top) & (m == 0), np.inf, v)
    if fmt.nan == "fn":
        v = np.where(mag == (1 << (fmt.ebits + fmt.mbits)) - 1, np.nan, v)
    if fmt.nan == "fnuz":
        v = np.where(codes == sign_mask, np.nan, v)
    return np.where((codes & sign_mask) != 0, -v, v)


@functools.lru_cache(maxsize=64)
def _codebook(fmt: FloatFormat) -> _CodeBook:
    if fmt.bits > 8:
        raise ValueError(
            f"{fmt.name} has {fmt.bits} bits; encode/decode handle formats of 8 bits or fewer "
            "(use cast for wider formats)"
        )
    if fmt.kind == "hif8":
        values = _hif8.DECODE_TABLE.astype(np.float64)
        sign, zero, neg_zero, nan, inf = 0x80, 0x00, 0x00, _hif8.NAN_CODE, _hif8.INF_CODE
    else:
        values = _exmy_values(fmt)
        sign = (1 << (fmt.bits - 1)) if fmt.signed else 0
        top_mag = (1 << (fmt.ebits + fmt.mbits)) - 1
        zero = 0
        neg_zero = sign if (fmt.signed_zero and fmt.signed) else 0
        if fmt.nan == "ieee" and fmt.mbits > 0:
            nan = (((1 << fmt.ebits) - 1) << fmt.mbits) | (1 << (fmt.mbits - 1))
        elif fmt.nan == "fn":
            nan = top_mag
        elif fmt.nan == "fnuz":
            nan = sign
        else:
            nan = sign  # no NaN code (FP4/FP6, IEEE-like eXm0): the -0 code, as ml_dtypes
        inf = (((1 << fmt.ebits) - 1) << fmt.mbits) if fmt.inf else 0
    table = np.full(256, np.nan, dtype=np.float32)
    table[: len(values)] = values.astype(np.float32)
    codes = np.arange(len(values))
    keep = np.isfinite(values) & (values > 0)
    order = np.argsort(values[keep], kind="stable")
    pos_vals = values[keep][order].astype(np.float32)
    return _CodeBook(
        table=table,
        pos_bits=pos_vals.view(np.uint32).copy(),
        pos_codes=codes[keep][order].astype(np.uint8),
        sign=sign,
        zero=zero,
        neg_zero=neg_zero,
        nan=nan,
        inf=inf,
    )


@njit(cache=True, inline="always")
def _encode_one(u, pos_bits, pos_codes, sign, zero, neg_zero, nan, inf):
    a = u & np.uint32(0x7FFFFFFF)
    neg = (u >> np.uint32(31)) != 0
    if a > np.uint32(0x7F800000):
        return nan
    if a == 0:
        return neg_zero if neg else zero
    if a == np.uint32(0x7F800000):
        c = inf
    else:  # binary search: the value is on the grid, so it is found exactly
        lo = 0
        hi = pos_bits.shape[0] - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if pos_bits[mid] < a:
                lo = mid + 1
            else:
                hi = mid
        c = pos_codes[lo]
    return (c | sign) if neg else c


@njit(parallel=True, cache=True)
def _encode_kernel(src, dst, pos_bits, pos_codes, sign, zero, neg_zero, nan, inf):
    for i in prange(src.shape[0]):
        dst[i] = _encode_one(src[i], pos_bits, pos_codes, sign, zero, neg_zero, nan, inf)


@njit(cache=True)
def _encode_kernel_serial(src, dst, pos_bits, pos_codes, sign, zero, neg_zero, nan, inf):
    for i in range(src.shape[0]):
        dst[i] = _encode_one(src[i], pos_bits, pos_codes, sign, zero, neg_zero, nan, inf)


@njit(parallel=True, cache=True)
def _decode_kernel(src, dst, table):
    for i in prange(src.shape[0]):
        dst[i] = table[src[i]]


def encode(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    rounding: str | None = None,
    saturate: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round ``x`` onto ``fmt`` (as `cast` does) and return the bit codes as a uint8 tensor."""
    fmt = get_format(fmt)
    book = _codebook(fmt)
    _check_tensor(x)
    v = cast(x, fmt, rounding=rounding, saturate=saturate, generator=generator)
    if use_torch(v, what="encode"):
        special = (book.sign, book.zero, book.neg_zero, book.nan, book.inf)
        flat = v.reshape(-1).view(torch.int32)
        return _ct.encode_bits(flat, book.pos_bits, book.pos_codes, special).view(v.shape)
    out = torch.empty(v.shape, dtype=torch.uint8)
    if v.numel():
        kernel = _encode_kernel if parallel(v.numel()) else _encode_kernel_serial
        kernel(
            v.view(-1).numpy().view(np.uint32),
            out.view(-1).numpy(),
            book.pos_bits,
            book.pos_codes,
            np.uint8(book.sign),
            np.uint8(book.zero),
            np.uint8(book.neg_zero),
            np.uint8(book.nan),
            np.uint8(book.inf),
        )
    return out


def decode(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Values (float32) of bit codes of ``fmt``; ``codes`` is an integer tensor (uint8 or wider)."""
    fmt = get_format(fmt)
    book = _codebook(fmt)
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor of codes, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"decode needs integer codes (uint8), got {codes.dtype}")
    if codes.dtype != torch.uint8:
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 255):
            raise ValueError("codes must lie in [0, 255]")
        codes = codes.to(torch.uint8)
    codes = codes.contiguous()
    if fmt.bits < 8 and codes.numel() and int(codes.max()) >= (1 << fmt.bits):
        raise ValueError(f"{fmt.name} codes are {fmt.bits}-bit: values must be < {1 << fmt.bits}")
    if use_torch(codes, what="decode"):
        return _ct.decode_codes(codes, book.table)
    out = torch.empty(codes.shape, dtype=torch.float32)
    if codes.numel() and parallel(codes.numel()):
        _decode_kernel(codes.view(-1).numpy(), out.view(-1).numpy(), book.table)
    elif codes.numel():
        out.view(-1).copy_(torch.from_numpy(book.table)[codes.view(-1).long()])
    return out


def torch_dtype(fmt: str | FloatFormat) -> torch.dtype:
    """The torch float8 dtype with the same bits as ``fmt`` (ValueError if there is none)."""
    fmt = get_format(fmt)
    if fmt.name not in _TORCH_DTYPES:
        raise ValueError(
            f"{fmt.name} has no torch dtype; formats with one: {', '.join(_TORCH_DTYPES)}"
        )
    return _TORCH_DTYPES[fmt.name]


def to_torch_float8(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    rounding: str | None = None,
    saturate: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A torch float8 tensor from uint8 codes (reinterpreted) or from floats (encoded by fp8lab)."""
    dtype = torch_dtype(fmt)
    if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
        codes = x
    else:
        codes = encode(x, fmt, rounding=rounding, saturate=saturate, generator=generator)
    return codes.contiguous().view(dtype)


def from_torch_float8(t: torch.Tensor) -> tuple[torch.Tensor, FloatFormat]:
    """The uint8 codes and the fp8lab format of a torch float8 tensor (same bits)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _FROM_TORCH:
        raise ValueError(
            "expected a tensor of dtype "
            + ", ".join(str(d) for d in _FROM_TORCH)
            + f"; got {getattr(t, 'dtype', type(t).__name__)}"
        )
    return t.contiguous().view(torch.uint8), get_format(_FROM_TORCH[t.dtype])


__all__ = ["decode", "encode", "from_torch_float8", "to_torch_float8", "torch_dtype"]
