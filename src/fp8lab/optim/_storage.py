"""Emulated low-precision storage of optimizer states (and of model weights).

A state "stored in bf16" is kept as a float32 tensor whose values lie exactly on the bf16 grid:
every write rounds (nearest-even, saturating) and every read is exact. FP8 storage is block-scaled
(FP8-LM, COAT): the flattened tensor is cut into blocks of ``block`` consecutive elements, each block
gets a current-scaling multiplier ``fmt_max / amax`` (power of two rounded down, so that the stored,
dequantized value ``q / scale`` is exact in float32), values are rounded onto the FP8 grid and
dequantized again. Only the dequantized values are kept: they are what the optimizer reads back.

Two refinements of the stored value:

* :func:`store_expanded_` (``moment_expansion``): COAT's dynamic range expansion (Xi et al.,
  arXiv 2410.19313, Sec. 4; NVlabs/COAT ``coat/optimizer/kernels/fp8_adamw_expand_cuda_kernel.cu``)
  maps each block through ``f(x) = sign(x) (|x| / g)^k`` before the FP8 cast and back through
  ``f^-1`` after it, with ``g = sqrt(max|x| * min|x|)`` (the block's geometric centre, zeros left
  out of the minimum) and ``k`` chosen so that the block's dynamic range ``max/min`` raised to
  ``k`` fills the format's (``fmt_max^2 / 2``), rounded down to a multiple of 1/16 as COAT's
  kernel does. Moments whose blocks span a few binades (the second moment: ~10) then use the
  whole FP8 range instead of its top few binades.
* ``scaled=True`` on :func:`store_` for a 16-bit format: one power-of-two scale for the whole
  tensor (``fmt_max / amax`` rounded down), MS-AMP's O2 scaled FP16 master weights
  (Azure/MS-AMP ``msamp/common/tensor/meta.py``: ``compute_scaling_factor`` with margin 0).
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


def _blocks(value: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``value`` flattened and zero-padded into ``[n_blocks, block]`` rows; (rows, numel)."""
    flat = value.reshape(-1)
    n = flat.numel()
    nb = math.ceil(n / block)
    return torch.nn.functional.pad(flat, (0, nb * block - n)).view(nb, block), n


def pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The largest power of two ``s`` with ``amax * s <= fmax`` (1 where amax is 0 or not
    finite), so that ``q / s`` is exact in float32."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(fmax / safe)))
    # log2 of a float may land one binade off near powers of two: fix so that amax*scale <= fmax
    scale = torch.where(safe * scale > fmax, scale * 0.5, scale)
    scale = torch.where(safe * scale * 2 <= fmax, scale * 2, scale)
    return torch.where(ok, scale, torch.ones_like(scale))


def store_(
    state: torch.Tensor, value: torch.Tensor, fmt: str, block: int = 128, *, scaled: bool = False
) -> torch.Tensor:
    """Write ``value`` into ``state`` (float32, same shape) as stored in ``fmt``; returns ``state``.

    ``fmt`` is a canonical storage name. FP8 formats are block-scaled over ``block`` consecutive
    elements of the flattened tensor (the last block may be short). ``scaled``: a 16-bit format
    is scaled too, by one power of two for the whole tensor (``block`` is then ignored).
    """
    if fmt == "fp32":
        return state.copy_(value)
    if fmt not in _BLOCK_SCALED and not scaled:
        return state.copy_(round_to(value, fmt))
    if fmt not in _BLOCK_SCALED:
        block = max(value.numel(), 1)
    blocks, n = _blocks(value, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    fmax = get_format(fmt).max
    # power-of-two multiplier, rounded down (TE's pow2 rule) -> q / scale is exact in fp32
    scale = pow2_scale(amax, fmax)
    q = round_to(blocks * scale, fmt) / scale
    return state.copy_(q.reshape(-1)[:n].view_as(state))


#: COAT's exponent granularity: k is rounded down to a multiple of 1/EXPAND_STEPS
EXPAND_STEPS = 16


def expansion(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """COAT's per-block expansion parameters of ``blocks`` ``[n, block]``: ``(g, k)``, each
    ``[n, 1]`` (module doc). ``g`` is the geometric mean of the largest and the smallest non-zero
    magnitude; ``k = floor(16 log2(fmax^2 / 2) / log2(max / min)) / 16``, at least 1/16, and 1 for
    a block with a single non-zero magnitude (or none)."""
    a = blocks.abs()
    tiny = 1e-30  # COAT's QUANT_MIN_VAL: keeps max/min finite
    mx = a.amax(dim=1, keepdim=True) + tiny
    mn = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(dim=1, keepdim=True)
    mn = torch.where(torch.isfinite(mn), mn, mx - tiny) + tiny
    fmax = get_format(fmt).max
    ratio = mx / mn
    k = torch.floor(math.log2(fmax * fmax / 2) / torch.log2(ratio) * EXPAND_STEPS) / EXPAND_STEPS
    k = torch.where(ratio > 1, k.clamp(min=1.0 / EXPAND_STEPS), torch.ones_like(k))
    return mx.sqrt() * mn.sqrt(), k


def store_expanded_(
    state: torch.Tensor, value: torch.Tensor, fmt: str, block: int = 128
) -> torch.Tensor:
    """`store_` of an FP8 format through COAT's dynamic range expansion (module doc): per block,
    ``y = sign(x) (|x|/g)^k`` is cast with the multiplier ``fmax / max|y|`` (COAT's: not a power
    of two), and ``sign(y') |y'|^(1/k) g`` of the dequantized ``y'`` is stored. Zeros stay zero."""
    if fmt not in _BLOCK_SCALED:
        raise ValueError(f"moment expansion is for FP8 storage (e4m3, e5m2), not {fmt!r}")
    blocks, n = _blocks(value, block)
    g, k = expansion(blocks, fmt)
    fmax = get_format(fmt).max
    y = torch.sign(blocks) * (blocks.abs() / g).pow(k)
    deq = (y.abs().amax(dim=1, keepdim=True) / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    yq = round_to(y / deq, fmt) * deq
    x = torch.sign(yq) * yq.abs().pow(1.0 / k) * g
    return state.copy_(x.reshape(-1)[:n].view_as(state))
