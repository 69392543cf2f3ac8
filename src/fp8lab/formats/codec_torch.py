"""Device-generic kernels of `fp8lab.encode` / `fp8lab.decode`: torch ops on float32 bits.

The same codes and values as the numba kernels of `fp8lab.formats.codec` (`_encode_one`,
`_decode_kernel`), on any device: encode looks each already rounded value up among the format's
positive values (ascending float32 bits, which order like the values) with `torch.searchsorted`,
decode indexes the 256-entry value table. The tables are copied to a device once.
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
    idx = torch.searchsorted(_on(pos_bits, u.device), a).clamp_(max=len(pos_bits) - 1)
    c = _on(pos_codes, u.device)[idx].to(torch.int32)
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
