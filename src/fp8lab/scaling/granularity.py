"""Scale granularity: which elements share one scale.

A granularity is normalised to a block shape ``(m, k)`` over the 2-D view of a tensor (a tensor of
shape ``[..., C]`` is viewed as ``[R, C]`` with ``R = prod(leading dims)``; a 1-D tensor as
``[1, C]``). ``-1`` means the full extent of that axis.

Named granularities:

====================  ==========  ===============================================================
name                  block       meaning
====================  ==========  ===============================================================
``"tensor"``          (-1, -1)    one scale for the whole tensor (TE delayed / current scaling)
``"row"``             (1, -1)     one scale per row (per token / per output channel)
``"col"``             (-1, 1)     one scale per column (per input channel)
``"mx"``              (1, 32)     OCP MX: 32 consecutive elements along a row, E8M0 scales
``"mx_col"``          (32, 1)     MX blocks running down the columns (the transposed direction)
``"nvfp4"``           (1, 16)     NVFP4: 16 elements along a row, E4M3 scales under an FP32 scale
``"nvfp4_col"``       (16, 1)     NVFP4 blocks down the columns
====================  ==========  ===============================================================

Any tuple ``(m, k)`` is accepted too: DeepSeek-V3 uses ``(1, 128)`` for activations and gradients,
``(128, 128)`` for weights and ``(128, 1)`` for the wgrad operands.

Ragged edges: when an axis is not a multiple of its block size the last block is partial. With
``pad=True`` (the default) it is treated as if zero-padded (zeros never change a block's amax), so
quantizing a ragged tensor equals quantizing its zero-padded version and cropping; with
``pad=False`` a `ValueError` is raised. Nothing is ever silently truncated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

GranularityLike = str | tuple[int, int] | Sequence[int]

NAMED_GRANULARITIES: dict[str, tuple[int, int]] = {
    "tensor": (-1, -1),
    "row": (1, -1),
    "col": (-1, 1),
    "mx": (1, 32),
    "mx_col": (32, 1),
    "nvfp4": (1, 16),
    "nvfp4_col": (16, 1),
}
_ALIASES = {
    "per_tensor": "tensor",
    "rowwise": "row",
    "channel": "row",
    "colwise": "col",
    "column": "col",
    "mxfp8": "mx",
    "mx_row": "mx",
    "nvfp4_row": "nvfp4",
}


def normalize_granularity(g: GranularityLike) -> tuple[int, int]:
    """Block shape ``(m, k)`` of a granularity name or tuple (-1 = full extent)."""
    if isinstance(g, str):
        key = g.strip().lower()
        key = _ALIASES.get(key, key)
        if key not in NAMED_GRANULARITIES:
            raise ValueError(
                f"unknown granularity {g!r}; valid names: {', '.join(NAMED_GRANULARITIES)}, "
                "or a tuple (m, k) with positive ints or -1 for the full extent"
            )
        return NAMED_GRANULARITIES[key]
    try:
        m, k = (int(v) for v in g)
    except (TypeError, ValueError):
        raise ValueError(f"granularity must be a name or a pair (m, k), got {g!r}") from None
    for v in (m, k):
        if v == 0 or v < -1:
            raise ValueError(f"granularity block sizes must be positive or -1, got {(m, k)}")
    return (m, k)


def canonical_granularity(g: GranularityLike) -> str | tuple[int, int]:
    """The name of a granularity if it has one, else its ``(m, k)`` tuple."""
    block = normalize_granularity(g)
    for name, b in NAMED_GRANULARITIES.items():
        if b == block:
            return name
    return block


def granularity_to_plain(g: GranularityLike) -> str | list[int]:
    """JSON/TOML-friendly form: a name, or a list ``[m, k]``."""
    c = canonical_granularity(g)
    return c if isinstance(c, str) else [c[0], c[1]]


def transpose_granularity(g: GranularityLike) -> str | tuple[int, int]:
    """The granularity with the block's axes swapped: (1, 128) -> (128, 1), "mx" -> "mx_col"."""
    m, k = normalize_granularity(g)
    return canonical_granularity((k, m))


def shape_2d(shape: Sequence[int]) -> tuple[int, int]:
    """The ``[R, C]`` view scales are laid out on."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (math.prod(shape[:-1]), shape[-1])


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as ``[R, C]`` (a reshape; no copy for contiguous tensors)."""
    return x.reshape(shape_2d(x.shape))


def resolve_block(block: tuple[int, int], shape2d: tuple[int, int]) -> tuple[int, int]:
    """Replace -1 by the full extent (at least 1)."""
    r, c = shape2d
    m, k = block
    return (max(r, 1) if m == -1 else m, max(c, 1) if k == -1 else k)


def num_blocks(shape2d: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Number of blocks along each axis (ragged edges count as a block)."""
    m, k = resolve_block(block, shape2d)
    return (max(-(-shape2d[0] // m), 1), max(-(-shape2d[1] // k), 1))


def check_fit(shape2d: tuple[int, int], block: tuple[int, int], pad: bool) -> None:
    """Raise if the tensor does not tile into whole blocks and padding is off."""
    if pad:
        return
    m, k = resolve_block(block, shape2d)
    r, c = shape2d
    bad = []
    if r % m:
        bad.append(f"{r} rows are not a multiple of the block height {m}")
    if c % k:
        bad.append(f"{c} columns are not a multiple of the block width {k}")
    if bad:
        raise ValueError(
            f"tensor of 2-D shape {tuple(shape2d)} does not fit blocks of {(m, k)}: "
            + "; ".join(bad)
            + " (pass pad=True to treat the ragged edge blocks as zero-padded)"
        )


def pad_to_blocks(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad ``x2d`` on the bottom/right to whole blocks (returns ``x2d`` itself if it fits)."""
    r, c = x2d.shape
    m, k = resolve_block(block, (r, c))
    nr, nc = num_blocks((r, c), (m, k))
    if nr * m == r and nc * k == c:
        return x2d
    out = x2d.new_zeros((nr * m, nc * k))
    out[:r, :c] = x2d
    return out


def nan_ignoring_abs(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN replaced by 0: TE's ``fmaxf`` amax reductions ignore NaN."""
    a = x.abs()
    return torch.where(torch.isnan(a), 0.0, a)


def block_amax(x: torch.Tensor, block: GranularityLike, pad: bool = True) -> torch.Tensor:
    """Per-block ``max |x|`` (float32, NaN ignored as TE does), shape ``num_blocks``.

    Reference implementation in torch; `fp8lab.quantize` uses fused kernels for speed and is
    tested against this.
    """
    blk = normalize_granularity(block)
    x2d = as_2d(x.detach()).float()
    s2 = tuple(x2d.shape)
    check_fit(s2, blk, pad)
    m, k = resolve_block(blk, s2)
    if x2d.numel() == 0:
        return torch.zeros(num_blocks(s2, blk), dtype=torch.float32, device=x2d.device)
    xp = pad_to_blocks(nan_ignoring_abs(x2d), (m, k))
    nr, nc = xp.shape[0] // m, xp.shape[1] // k
    return xp.reshape(nr, m, nc, k).amax(dim=(1, 3))


def expand_blocks(
    scales: torch.Tensor, block: GranularityLike, shape2d: tuple[int, int]
) -> torch.Tensor:
    """Broadcast per-block values ``[nr, nc]`` back to a ``[R, C]`` tensor (cropping padding)."""
    blk = normalize_granularity(block)
    r, c = shape2d
    m, k = resolve_block(blk, (r, c))
    nr, nc = scales.shape
    full = scales[:, None, :, None].expand(nr, m, nc, k).reshape(nr * m, nc * k)
    return full[:r, :c]
