"""Block Hadamard transforms applied before quantizing: Transformer Engine's NVFP4 random
Hadamard transform (`rht16`) and Quartet's Hadamard transform over blocks (`hadamard_transform`).

Both multiply every run of ``n`` consecutive elements along the last dimension by an ``n x n``
matrix held in BF16, with one arithmetic, fp8lab's own and defined (docs/nvfp4.md):

* the input is rounded to BF16 (round to nearest even, subnormals kept): TE's input dtype;
* each output element ``y[j] = sum_i x[i] * M[i, j]``: the 16 (or ``n``) products are exact in
  FP32 (a BF16 times a BF16 has at most 16 significant bits and stays inside FP32's range:
  BF16's smallest subnormal 2**-133 times an entry >= 2**-3 is >= 2**-136 > 2**-149);
* the products are summed in FP32 in index order ``i = 0, 1, ..., n-1`` (one rounding per
  addition);
* the sum is rounded once to BF16 (nearest even, subnormals kept; overflow gives +-inf).

TE's reference (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``) forms the
same products with a BF16 torch matmul, whose FP32 accumulation order is the BLAS library's: on
blocks whose FP32 partial sums are all exact the two agree bit for bit; elsewhere they can differ
by the FP32 rounding of a different order, which after the BF16 rounding is at most 1 BF16 ulp
unless the sum cancels heavily (docs/nvfp4.md states the bound).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

from fp8lab.kernels import use_torch

__all__ = ["RHT_SIGNS", "hadamard_matrix", "hadamard_transform", "rht16", "transform_along"]

# TE's fixed sign vector of the wgrad RHT (reference_nvfp4.py, get_wgrad_sign_vector): row i of
# the 16x16 Sylvester matrix is multiplied by RHT_SIGNS[i]
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _sylvester(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, float32): ``H[i, j] =
    (-1)**popcount(i & j)``, the same matrix as the recursive construction ``[[H, H], [H, -H]]``."""
    # built once on the CPU (cached by `_matrix`; callers move it), whatever the default device
    idx = torch.arange(n, device="cpu")
    parity = torch.zeros((n, n), dtype=torch.int64, device="cpu")
    both = idx[:, None] & idx[None, :]
    while bool(both.any()):
        parity ^= both & 1
        both = both >> 1
    return 1.0 - 2.0 * parity.to(torch.float32)


@functools.lru_cache(maxsize=8)
def _matrix(n: int, signed: bool) -> torch.Tensor:
    h = _sylvester(n)
    if signed:
        h = torch.tensor(RHT_SIGNS, dtype=torch.float32, device="cpu")[:, None] * h
    # 1/sqrt(n) rounded once to BF16 (exact for n = 4**k: 16 -> 0.25)
    scale = torch.tensor(n**-0.5, dtype=torch.float32, device="cpu")
    scale = scale.to(torch.bfloat16).to(torch.float32)
    return (h * scale).to(torch.bfloat16)


def hadamard_matrix(n: int = 16, *, signs: bool | None = None) -> torch.Tensor:
    """The BF16 matrix ``M`` a transform multiplies blocks by (``y = x @ M``), shape ``[n, n]``.

    ``n = 16`` (default): TE's RHT matrix, the Sylvester matrix with row ``i`` times
    ``RHT_SIGNS[i]``, times 1/4 (``signs`` defaults to True). Any other power of two: the
    Sylvester matrix times ``bf16(1/sqrt(n))`` without signs (Quartet's transform; ``signs``
    defaults to False). A copy: callers may modify it."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"a Hadamard size must be a power of two >= 2, got {n!r}")
    signed = (n == 16) if signs is None else bool(signs)
    if signed and n != 16:
        raise ValueError(f"TE's sign vector has 16 entries; signs=True needs n=16, got {n}")
    return _matrix(n, signed).clone()


def _apply(x: torch.Tensor, n: int, signed: bool, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{what} expects a floating-point torch.Tensor, got {x!r:.60}")
    c = x.shape[-1] if x.dim() else 1
    if c % n:
        raise ValueError(
            f"{what}: the last dimension has {c} elements, not a multiple of {n} "
            f"(shape {tuple(x.shape)})"
        )
    if not x.numel():  # an empty batch (zero tokens): nothing to transform
        return x.detach().to(torch.bfloat16)
    m = _matrix(n, signed).to(device=x.device, dtype=torch.float32)
    xb = x.detach().to(torch.bfloat16).to(torch.float32)
    if not use_torch(xb, what="hadamard transform"):
        acc = torch.empty((xb.numel() // n, n), dtype=torch.float32)
        _block_products(xb.reshape(-1, n).contiguous().numpy(), m.numpy(), acc.numpy())
        return acc.to(torch.bfloat16).reshape(x.shape)
    xb = xb.reshape(-1, c // n, n)
    # index order: acc = p_0; acc = acc + p_1; ... one FP32 rounding per addition
    acc = xb[..., 0, None] * m[0]
    for i in range(1, n):
        acc = acc + xb[..., i, None] * m[i]
    return acc.to(torch.bfloat16).reshape(x.shape)


def rht16(x: torch.Tensor) -> torch.Tensor:
    """TE's NVFP4 random Hadamard transform along the last dimension: each run of 16 elements
    times the BF16 matrix `hadamard_matrix` (16): Sylvester rows times TE's sign vector, times 1/4.

    Returns a BF16 tensor of ``x``'s shape (``x`` is rounded to BF16 first; see the module doc
    for the arithmetic). The last dimension must be a multiple of 16 (ValueError). No gradient.
    """
    return _apply(x, 16, True, "rht16")


def hadamard_transform(x: torch.Tensor, n: int = 32) -> torch.Tensor:
    """A Hadamard transform over blocks of ``n`` elements along the last dimension (Quartet,
    arXiv 2505.14669: ``n = 32``, the MXFP4 block): each block times the Sylvester matrix times
    ``bf16(1/sqrt(n))``, no signs, with `rht16`'s arithmetic. For ``n`` not a power of 4 the
    BF16 entry is not exactly ``1/sqrt(n)`` (32: 0.1767578125 vs 0.1767767..., 1.1e-4 relative),
    so the transform is orthogonal up to that factor. Returns BF16; ``n`` must divide the last
    dimension (ValueError)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"hadamard must be a power of two >= 2, got {n!r}")
    return _apply(x, n, False, f"hadamard={n}")


def transform_along(x2: torch.Tensor, axis: int, n: int, signed: bool, what: str) -> torch.Tensor:
    """The transform of a 2-D ``[R, C]`` tensor along ``axis`` (1: along rows, 0: down columns)
    as contiguous float32 (the BF16 results widened exactly). ``what`` names the field in the
    error when that axis is not a multiple of ``n``."""
    size = x2.shape[axis]
    if size % n:
        side = "columns" if axis == 1 else "rows"
        raise ValueError(
            f"{what}: the transformed axis ({side}) has {size} elements, not a multiple of {n} "
            f"(2-D shape {tuple(x2.shape)})"
        )
    src = x2 if axis == 1 else x2.t()
    out = _apply(src, n, signed, what).to(torch.float32)
    return (out if axis == 1 else out.t()).contiguous()


@njit(cache=True)
def _block_products(xb, m, out):  # pragma: no cover - numba
    """``out[g, j] = sum_i xb[g, i] * m[i, j]`` summed in FP32 in index order (the module doc's
    arithmetic; the products are exact, so a fused multiply-add gives the same sums). Vectorised
    over blocks: ``_GROUPS`` blocks at a time are transposed into a scratch so that each
    addition runs over contiguous lanes, one block per lane, all in L1."""
    n = m.shape[0]
    ng = xb.shape[0]
    xt = np.empty((n, _GROUPS), dtype=np.float32)
    acc = np.empty(_GROUPS, dtype=np.float32)
    for g0 in range(0, ng, _GROUPS):
        nb = min(_GROUPS, ng - g0)
        for b in range(nb):
            for i in range(n):
                xt[i, b] = xb[g0 + b, i]
        for j in range(n):
            m0 = m[0, j]
            for b in range(nb):
                acc[b] = xt[0, b] * m0
            for i in range(1, n):
                mij = m[i, j]
                for b in range(nb):
                    acc[b] = acc[b] + xt[i, b] * mij
            for b in range(nb):
                out[g0 + b, j] = acc[b]


_GROUPS = 128  # blocks per vectorised sweep: 128 x 32 float32 = 16 KiB of transposed input
