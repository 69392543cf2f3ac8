"""The per-tensor GEMM epilogue (scale, then bias) in one serial numba pass.

Moves into `fp8lab.gemm` (``qmatmul(..., bias=)``) once that lands; kept bit-identical to
``out.mul_(scale).add_(bias)``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit


@njit(cache=True)
def _scale_bias_rows(o, n, s, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = np.float32(r[j] * s) + b[j]


@njit(cache=True)
def _scale_all(o, s):  # pragma: no cover - numba
    for i in range(o.shape[0]):
        o[i] = o[i] * s


@njit(cache=True)
def _bias_rows(o, n, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = r[j] + b[j]


def epilogue(out: torch.Tensor, scale: np.ndarray | None, bias: torch.Tensor | None) -> None:
    """In place on a float32 [M, N] GEMM output: ``out = fl32(out * scale)`` then
    ``fl32(out + bias)``, the same two roundings as ``out.mul_(scale).add_(bias)`` (no FMA),
    in one serial numba pass (torch's threaded elementwise ops stall on a busy 2-core box)."""
    if not out.is_contiguous():
        if scale is not None:
            out.mul_(torch.from_numpy(np.asarray(scale, dtype=np.float32)))
        if bias is not None:
            out.add_(bias)
        return
    o = out.view(-1).numpy()
    n = out.shape[1]
    if bias is not None:
        b = bias.detach().to(torch.float32).contiguous().numpy()
        if scale is None:
            _bias_rows(o, n, b)
        else:
            _scale_bias_rows(o, n, np.float32(scale), b)
    else:
        _scale_all(o, np.float32(scale))
