"""Emulated low-precision storage of optimizer states (and of model weights).

A state "stored in bf16" is kept as a float32 tensor whose values lie exactly on the bf16 grid:
every write rounds (nearest-even, saturating) and every read is exact. FP8 storage is block-scaled
(FP8-LM, COAT): the flattened tensor is cut into blocks of ``block`` consecutive elements, each block
gets a current-scaling multiplier ``fmt_max / amax`` (power of two rounded down, so that the stored,
dequantized value ``q / scale`` is exact in float32), values are rounded onto the FP8 grid and
dequantized again. Only the dequantized values are kept: they are what the optimizer reads back.
"""

from __future__ import annotations

import math

import torch

from fp8lab.formats import cast, get_format

# precision name -> canonical format name of fp8lab.formats ("fp32" means: no rounding)
_STORAGE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "fp8": "e4m3",
    "e4m3": "e4m3",
    "e5m2": "e5m2",
}
STORAGE_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "e4m3", "e5m2")
_BLOCK_SCALED = {"e4m3", "e5m2"}


def canonical_storage(name: str) -> str:
    """Canonical storage format name for ``name`` (``"fp8"`` means block-scaled E4M3)."""
    if not isinstance(name, str) or name.lower() not in _STORAGE_NAMES:
        raise ValueError(
            f"unknown storage precision {name!r}; valid: {', '.join(STORAGE_PRECISIONS)}"
        )
    return _STORAGE_NAMES[name.lower()]


def round_to(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round float32 ``x`` onto the grid of ``fmt`` (nearest-even, saturating, NaN kept); new tensor."""
    fmt = canonical_storage(fmt)
    if fmt == "fp32":
        return x.clone()
    if hasattr(x, "to_local") and hasattr(x, "placements"):  # a DTensor (FSDP2): elementwise
        from torch.distributed.tensor import DTensor

        local = round_to(x.to_local(), fmt)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())  # fmt: skip
    return cast(x, fmt, rounding="nearest_even", saturate=True)


def store_(state: torch.Tensor, value: torch.Tensor, fmt: str, block: int = 128) -> torch.Tensor:
    """Write ``value`` into ``state`` (float32, same shape) as stored in ``fmt``; returns ``state``.

    ``fmt`` is a canonical storage name. FP8 formats are block-scaled over ``block`` consecutive
    elements of the flattened tensor (the last block may be short).
    """
    if fmt == "fp32":
        return state.copy_(value)
    if fmt not in _BLOCK_SCALED:
        return state.copy_(round_to(value, fmt))
    flat = value.reshape(-1)
    n = flat.numel()
    nb = math.ceil(n / block)
    pad = nb * block - n
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(nb, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    fmax = get_format(fmt).max
    # power-of-two multiplier, rounded down (TE's pow2 rule) -> q / scale is exact in fp32
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(fmax / safe)))
    # log2 of a float may land one binade off near powers of two: fix so that amax*scale <= fmax
    scale = torch.where(safe * scale > fmax, scale * 0.5, scale)
    scale = torch.where(safe * scale * 2 <= fmax, scale * 2, scale)
    scale = torch.where(ok, scale, torch.ones_like(scale))
    q = round_to(blocks * scale, fmt) / scale
    return state.copy_(q.reshape(-1)[:n].view_as(state))
