"""Underflow and saturation percentages of the GEMM operands, cheaply, on the steps the guard
samples (its ``saturation`` / ``underflow`` detectors, every ``every`` steps).

Only the operands in their natural layout (fprop input and weight, dgrad grad_output), and only
what the detectors read: ``underflow_pct`` = % of the nonzero elements of the high-precision
operand that the GEMM received as 0; ``saturation_pct`` = % of the elements the GEMM received at
the operand's largest magnitude while the high-precision value exceeds it by more than an FP8
rounding could (12.5 %: half an ulp of E5M2's top binade) -- exact for per-tensor scaling, a
lower bound for block scaling. Two passes over each operand, instead of the full statistics and
re-quantization of `fp8lab.observe.sample` (about 3x cheaper).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fp8lab.nn.operand import COLLECTORS
from fp8lab.observe.records import NATURAL_OPERANDS
from fp8lab.qtensor import QTensor

__all__ = ["operand_percentages"]

#: relative excess over the top value that rounding cannot explain (half an ulp of E5M2's top)
CLAMP_EXCESS = 1.125


class _Percentages:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __call__(self, layer: str, gemm: str, role: str, hp: torch.Tensor, used: Any) -> None:
        if (gemm, role) not in NATURAL_OPERANDS:
            return
        if isinstance(used, QTensor):
            used = used.dequantize()
        if used is hp:  # fp32 as is: nothing quantized
            return
        with torch.no_grad():
            a, b = hp.detach().float(), used.detach()
            nz = a != 0
            n_nz = int(nz.sum())
            under = 100.0 * int((nz & (b == 0)).sum()) / max(1, n_nz)
            babs = b.abs()
            top = babs.max()
            sat = 0.0
            if top > 0:  # an all-zero operand (everything underflowed) has nothing clamped
                clamped = (babs == top) & (a.abs() > top * CLAMP_EXCESS)
                sat = 100.0 * int(clamped.sum()) / max(1, a.numel())
        self.rows.append({"layer": layer, "gemm": gemm, "role": role,
                          "underflow_pct": under, "saturation_pct": sat})  # fmt: skip


@contextlib.contextmanager
def operand_percentages() -> Iterator[list[dict[str, Any]]]:
    """``with operand_percentages() as rows:`` run one forward and backward; ``rows`` then holds
    ``{layer, gemm, role, underflow_pct, saturation_pct}`` per natural-layout operand."""
    rows: list[dict[str, Any]] = []
    cb = _Percentages(rows)
    COLLECTORS.active.append(cb)
    try:
        yield rows
    finally:
        COLLECTORS.active.remove(cb)
