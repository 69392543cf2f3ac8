"""Underflow and saturation percentages of the FP8 GEMM operands, cheaply, on the steps the
guard samples (its ``saturation`` / ``underflow`` detectors, every ``every`` steps).

Only quantized operands (a `QTensor`: high-precision roundings such as bf16 are left out), in
their natural layout (fprop input and weight, dgrad grad_output), and only what the detectors
read:

- ``underflow_pct``: % of the nonzero elements of the high-precision operand whose quantized
  value is 0;
- ``saturation_pct``: % of the elements whose scaled value sits at the format's max while the
  scaled high-precision value exceeds it (clamped). Exact for per-tensor scaling (one fused
  numba pass over the operand and its scaled values, no dequantization); for block scaling the
  clamps are counted against the dequantized operand's top value (a lower bound).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab.nn.operand import COLLECTORS
from fp8lab.observe.records import NATURAL_OPERANDS
from fp8lab.qtensor import QTensor

__all__ = ["operand_percentages", "percentages"]


@njit(cache=True)
def _counts(hp: np.ndarray, values: np.ndarray, scale: float, fmax: float) -> tuple:
    """(nonzero, underflowed, clamped) over flat float32 arrays in one pass; ``scale`` 0: no
    clamp count."""
    nz = 0
    under = 0
    sat = 0
    for i in range(hp.size):
        a = hp[i]
        v = values[i]
        if a != 0.0:
            nz += 1
            if v == 0.0:
                under += 1
        if scale > 0.0 and abs(v) == fmax and abs(a) * scale > fmax:
            sat += 1
    return nz, under, sat


def _flat(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t.contiguous().reshape(-1).numpy()


def percentages(hp: torch.Tensor, q: QTensor) -> tuple[float, float]:
    """(underflow %, saturation %) of one quantized operand (see the module doc)."""
    fmax = float(q.spec.fmt.max)
    per_tensor = q.scale_multipliers is not None and q.scale_multipliers.numel() == 1
    scale = float(q.scale_multipliers.reshape(())) if per_tensor else 0.0
    nz, under, sat = _counts(_flat(hp), _flat(q.values), scale, fmax)
    n = max(1, hp.numel())
    if not per_tensor:  # block scales: clamps at the dequantized top value (lower bound)
        with torch.no_grad():
            b = q.dequantize().abs()
            top = b.max()
            if top > 0:
                clamped = (b == top) & (hp.detach().float().abs() > top * 1.125)
                sat = int(clamped.sum())
    return 100.0 * under / max(1, nz), 100.0 * sat / n


class _Percentages:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __call__(self, layer: str, gemm: str, role: str, hp: torch.Tensor, used: Any) -> None:
        if (gemm, role) not in NATURAL_OPERANDS or not isinstance(used, QTensor):
            return
        if used.values.shape != hp.shape:  # not the natural layout (cannot happen for these)
            return
        under, sat = percentages(hp, used)
        self.rows.append({"layer": layer, "gemm": gemm, "role": role,
                          "underflow_pct": under, "saturation_pct": sat})  # fmt: skip


@contextlib.contextmanager
def operand_percentages() -> Iterator[list[dict[str, Any]]]:
    """``with operand_percentages() as rows:`` run one forward and backward; ``rows`` then holds
    ``{layer, gemm, role, underflow_pct, saturation_pct}`` per quantized natural-layout operand."""
    rows: list[dict[str, Any]] = []
    cb = _Percentages(rows)
    COLLECTORS.active.append(cb)
    try:
        yield rows
    finally:
        COLLECTORS.active.remove(cb)
