"""One-pass kernel for the high-precision GEMM override: round float32 to bf16 (kept in float32).

Round-to-nearest-even on the bits (``u + 0x7FFF + lsb``, then clear the low 16 bits), overflow to
inf as real bf16 arithmetic does, NaN kept (quietened). Equal to ``x.to(bfloat16).float()`` and to
``fp8lab.cast(x, "bf16", saturate=False)`` (tested), in one pass with no temporaries (parallel under the thread policy of `fp8lab.kernels`).
Tensors off the CPU, or under ``FP8LAB_KERNELS=torch``, take the same steps as torch int32 ops
(`_bf16_rne_torch`), same bits.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from fp8lab.kernels import parallel, use_torch


@njit(cache=True, inline="always")
def _bf16_one(u):  # pragma: no cover - numba
    if (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (u & np.uint32(0x007FFFFF)):
        return u | np.uint32(0x00400000)  # NaN: quiet, payload kept
    r = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return r & np.uint32(0xFFFF0000)


@njit(parallel=True, cache=True)
def _bf16_rne(src, dst):  # pragma: no cover - numba
    for i in prange(src.size):
        dst[i] = _bf16_one(src[i])


@njit(cache=True)
def _bf16_rne_serial(src, dst):  # pragma: no cover - numba
    for i in range(src.size):
        dst[i] = _bf16_one(src[i])


def _bf16_rne_torch(u: torch.Tensor) -> torch.Tensor:
    """`_bf16_one` on int32 bits (any device): NaN quietened, else RNE onto the top 16 bits."""
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    fin = u.clamp(max=0x7F800000)  # positive NaNs (replaced below) would overflow int32 here
    r = (fin + ((fin >> 16) & 1)).add_(0x7FFF).bitwise_and_(-65536)  # -65536: 0xFFFF0000
    return torch.where(nan, u | 0x00400000, r)


def round_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to bf16 (RNE), as float32; ``out`` may be ``x`` itself."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_bf16 expects float32, got {x.dtype}")
    src = x.contiguous()
    if out is None:
        out = torch.empty_like(src)
    elif out.shape != src.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor of x's shape")
    if use_torch(src, out, what="round_bf16"):
        bits = _bf16_rne_torch(src.detach().reshape(-1).view(torch.int32))
        out.detach().view(-1).copy_(bits.view(torch.float32))
        return out
    if src.numel():
        (_bf16_rne if parallel(src.numel()) else _bf16_rne_serial)(
            src.detach().reshape(-1).numpy().view(np.uint32),
            out.detach().reshape(-1).numpy().view(np.uint32),
        )
    return out
