"""Device-generic kernels of `fp8lab.encode` / `fp8lab.decode`: torch ops on float32 bits.

The same codes and values as the numba kernels of `fp8lab.formats.codec` (`_encode_one`,
`_decode_kernel`), on any device. Encode looks each already rounded value up directly: a value
on the grid of a format of 8 bits or fewer has at most 7 significant bits below its leading one,
so its float32 bits shifted right by ``23 - m`` (the smallest ``m`` that keeps the format's values
apart) index a table of at most 2**15 codes (`_direct`), one gather instead of a search. Decode
indexes the 256-entry value table. The tables are copied to a device once.
"""

from __future__ import annotations

import numpy as np
import torch

from fp8lab.formats._grid import INF_BITS

__all__ = ["decode_codes", "encode_bits"]

_TABLES: dict[tuple[int, torch.device], tuple[np.ndarray, torch.Tensor]] = {}


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``, copied once (keyed by the array, which is kept);
    uint32 entries (all below 2**31 here) become int32."""
    key = (id(array), device)
    hit = _TABLES.get(key)
    if hit is None or hit[0] is not array:
        host = array.view(np.int32) if array.dtype == np.uint32 else array
        hit = (array, torch.from_numpy(host).to(device))
        _TABLES[key] = hit
    return hit[1]


_DIRECT: dict[int, tuple[np.ndarray, int, np.ndarray]] = {}


def _direct(pos_bits: np.ndarray, pos_codes: np.ndarray) -> tuple[int, np.ndarray]:
    """(shift, table): ``table[bits >> shift]`` is the code of the positive value with float32
    ``bits``, for every positive finite value of the format (cached per codebook)."""
    hit = _DIRECT.get(id(pos_bits))
    if hit is None or hit[0] is not pos_bits:
        for m in range(24):
            shift = 23 - m
            idx = pos_bits >> np.uint32(shift)
            if len(np.unique(idx)) == len(idx):
                break
        table = np.zeros(1 << (31 - shift), dtype=np.int32)
        table[idx] = pos_codes
        hit = _DIRECT[id(pos_bits)] = (pos_bits, shift, table)
    return hit[1], hit[2]


def encode_bits(
    u: torch.Tensor,
    pos_bits: np.ndarray,
    pos_codes: np.ndarray,
    special: tuple[int, int, int, int, int],
) -> torch.Tensor:
    """`codec._encode_one` on every element: ``u`` the float32 bits (int32, flat) of values on
    the format's grid; ``pos_bits`` / ``pos_codes`` the positive finite values (uint32 bits,
    ascending) and their codes; ``special`` = (sign mask, +0, -0, NaN, +Inf codes). Returns the
    uint8 codes on ``u``'s device."""
    sign, zero, neg_zero, nan, inf = special
    a = u & 0x7FFFFFFF
    neg = u < 0
    shift, table = _direct(pos_bits, pos_codes)
    c = _on(table, u.device)[a >> shift]
    c = torch.where(a == INF_BITS, inf, c)
    c = torch.where(neg, c | sign, c)
    c = torch.where(a == 0, zero, c)
    c = torch.where((a == 0) & neg, neg_zero, c)
    c = torch.where(a > INF_BITS, nan, c)
    return c.to(torch.uint8)


def decode_codes(codes: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    """Values (float32, ``codes``' device and shape) of uint8 ``codes`` by the 256-entry
    ``table``."""
    return _on(table, codes.device)[codes.to(torch.int64)]
