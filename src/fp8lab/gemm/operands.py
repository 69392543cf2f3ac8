"""Operand checks shared by the accumulator models: quantize float operands, validate shapes and
the scale geometry along K, broadcast K-constant scales."""

from __future__ import annotations

import torch

from fp8lab.qtensor import QTensor, QuantSpec, quantize
from fp8lab.scaling.granularity import resolve_block

__all__ = ["as_qtensors", "blocks", "check_pair", "k_constant_scales"]


def as_qtensors(
    a: QTensor | torch.Tensor,
    b: QTensor | torch.Tensor,
    spec: QuantSpec | None,
    spec_b: QuantSpec | None,
) -> tuple[QTensor, QTensor]:
    if isinstance(a, torch.Tensor):
        if spec is None:
            raise ValueError("qmatmul: float operand a needs spec= (a QuantSpec) to be quantized")
        a = quantize(a, spec)
    if isinstance(b, torch.Tensor):
        sb = spec_b or (spec.transposed() if spec is not None else None)
        if sb is None:
            raise ValueError("qmatmul: float operand b needs spec_b= or spec= to be quantized")
        b = quantize(b, sb)
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        raise TypeError(
            f"qmatmul operands must be QTensors or float tensors, got {type(a).__name__} and "
            f"{type(b).__name__}"
        )
    return a, b


def blocks(q: QTensor) -> tuple[int, int]:
    return resolve_block(q.spec.block, (q.shape[0], q.shape[1]))


def check_pair(a: QTensor, b: QTensor) -> int:
    """Validate shapes and scale geometry; return the K extent over which scales are constant."""
    if a.values.dim() != 2 or b.values.dim() != 2:
        raise ValueError(f"qmatmul needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    k = a.shape[1]
    if k != b.shape[0]:
        raise ValueError(
            f"qmatmul: mismatched K: a is {tuple(a.shape)} (K={k}), "
            f"b is {tuple(b.shape)} (K={b.shape[0]})"
        )
    ka = min(blocks(a)[1], k)
    kb = min(blocks(b)[0], k)
    if k in (ka, kb) or ka == kb:
        return min(ka, kb)
    raise ValueError(
        f"qmatmul: incompatible scale granularities along K: a has blocks {a.spec.granularity!r} "
        f"({ka} wide along K), b has blocks {b.spec.granularity!r} ({kb} tall along K). The scale "
        "groups of both operands must line up along the reduction axis (equal, or one of them "
        "spanning all of K); for b = x of shape [K, N] quantized row-wise, retile it to the "
        "transposed blocks first (fp8lab.retile)."
    )


def k_constant_scales(q: QTensor, side: str) -> torch.Tensor:
    """Scales of an operand whose scales do not vary along K, broadcast to [M, 1] or [1, N]."""
    sc = q.scales
    if q.global_scale is not None:
        sc = sc * q.global_scale
    if side == "a":
        bm = blocks(q)[0]
        return sc.repeat_interleave(bm, dim=0)[: q.shape[0]].reshape(-1, 1)
    bn = blocks(q)[1]
    return sc.repeat_interleave(bn, dim=1)[:, : q.shape[1]].reshape(1, -1)
