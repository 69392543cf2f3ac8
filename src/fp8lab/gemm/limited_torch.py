"""The ``limited`` accumulator's per-element kernels as device-generic torch tensor operations,
bit for bit numba's ``_acc_step`` and ``_acc_per_product`` (`fp8lab.gemm.limited`).

The accumulator is a float64 whose fraction is cut to ``52 - drop`` bits on its int64 bit
pattern (truncation, or round to nearest even by adding half an ulp minus one plus the kept
lowest bit: integer adds wrap the same way as numba's uint64 ones). The per-product model's
group sums are exact in float64 (terms are multiples of the group's quantum below
``2**(mantissa_bits + 1)`` each), so torch's reduction order cannot change a bit. Promotion is
three FP32 roundings, ``out += (sa * sb) * f32(acc)``, as numba (no FMA contraction: separate
torch kernels).
"""

from __future__ import annotations

import torch

__all__ = ["acc_step_torch", "per_product_torch"]

_BUDGET = {"cpu": 1 << 22}  # float64 elements per per-product tile (CPU); 2**24 elsewhere


def _cut(v: torch.Tensor, drop: int, rne: bool) -> torch.Tensor:
    """Keep ``52 - drop`` fraction bits of float64 ``v``: truncate (RZ) or nearest even."""
    u = v.view(torch.int64)
    if rne:
        u = u + (((1 << (drop - 1)) - 1) + ((u >> drop) & 1))
    return (u & -(1 << drop)).view(torch.float64)


def acc_step_torch(
    acc: torch.Tensor,
    buf: torch.Tensor,
    drop: int,
    rne: bool,
    gpp: int,
    out: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
) -> None:
    """In place: for each group ``g`` of ``buf`` [G, rows, cols] float64, ``acc = cut(acc +
    buf[g])``; after every ``gpp`` groups (0: never) promote, ``out += f32(sa[:, t] * sb[t]) *
    f32(acc)`` and ``acc = 0`` (``t`` counts the promotions of this call)."""
    for g in range(buf.shape[0]):
        acc.copy_(_cut(acc + buf[g], drop, rne))
        if gpp > 0 and (g + 1) % gpp == 0:
            t = g // gpp
            out.add_((sa[:, t : t + 1] * sb[t : t + 1]) * acc.to(torch.float32))
            acc.zero_()


def per_product_torch(
    a: torch.Tensor,
    b: torch.Tensor,
    k0: int,
    k1: int,
    group: int,
    drop: int,
    rne: bool,
    acc: torch.Tensor,
) -> None:
    """DeepSeek §3.5.2 over K range [k0, k1) of float64 ``a`` [rows, K], ``b`` [K, N], in place
    on ``acc`` [rows, N]: per group every product is truncated toward zero to the quantum
    ``2**(e_max - mantissa_bits)`` of the group's largest product (biased exponent at least 1),
    the truncated products are summed and ``acc = cut(acc + sum)``."""
    keep = 52 - drop
    rows, n = acc.shape
    budget = _BUDGET.get(a.device.type, 1 << 24)
    nc = max(1, min(n, budget // max(1, rows * group)))
    for n0 in range(0, n, nc):
        n1 = min(n0 + nc, n)
        for g0 in range(k0, k1, group):
            g1 = min(g0 + group, k1)
            prod = a[:, g0:g1, None] * b[None, g0:g1, n0:n1]  # [rows, G, cols], exact
            emax = ((prod.view(torch.int64) >> 52) & 0x7FF).amax(1)
            eq = torch.clamp_min(emax - keep, 1)
            q = (eq << 52).view(torch.float64).unsqueeze(1)
            qinv = ((2046 - eq) << 52).view(torch.float64).unsqueeze(1)
            s = (torch.trunc(prod * qinv) * q).sum(1)
            acc[:, n0:n1] = _cut(acc[:, n0:n1] + s, drop, rne)
