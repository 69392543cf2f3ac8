"""Underflow and saturation percentages of the FP8 GEMM operands, on the steps the guard samples
(its ``saturation`` / ``underflow`` detectors, every ``every`` steps).

One definition with `fp8lab.watch`: the two counts of `fp8lab.stats.error_stats` (which the
watch's `fp8lab.observe.records.operand_row` runs), on the same three arrays -- the
high-precision operand, the QTensor the GEMM consumed (dequantized) and its scaled values --
with the same tolerance, so the numbers are equal (tested):

- ``underflow_pct``: % of the nonzero elements of the high-precision operand that are 0 in the
  dequantized operand;
- ``saturation_pct``: % of all elements whose scaled value sits at the format's max while the
  high-precision magnitude exceeds the dequantized one (clamped), or whose scaled value
  overflowed to Inf/NaN from a finite input. Exact for per-tensor and block scales alike.

The pass is lean (`_counts`: two integer counts in float32, one numba loop) where the watch's
`error_stats` also accumulates float64 sums for SQNR, cosine and the dynamic range: the guard
samples every 10 steps and has a 3 % overhead budget (docs/guard.md). Only quantized
operands (a `QTensor`: high-precision roundings such as bf16 are left out) in their natural
layout (fprop input and weight, dgrad grad_output) are measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab.nn import on_operand
from fp8lab.observe.records import NATURAL_OPERANDS
from fp8lab.qtensor import QTensor
from fp8lab.stats import _SAT_TOL  # the watch's clamp tolerance (error_stats)

__all__ = ["operand_percentages", "percentages"]


@njit(cache=True)
def _counts(x: np.ndarray, xq: np.ndarray, v: np.ndarray, fmax: float, tol: float) -> tuple:
    """(nonzero, underflowed, saturated) over flat arrays: `fp8lab.stats.error_stats`'s
    ``nnz``, ``nuf`` and ``nsat`` (same comparisons, in the same float64)."""
    nnz = 0
    nuf = 0
    nsat = 0
    for i in range(x.size):
        a = np.float64(x[i])
        b = np.float64(xq[i])
        if a != 0.0:  # NaN counts as nonzero, as in error_stats
            nnz += 1
            if b == 0.0:
                nuf += 1
        vv = np.float64(v[i])
        if np.isfinite(vv):
            if abs(vv) == fmax and abs(a) > abs(b) * (1.0 + tol):
                nsat += 1
        elif np.isfinite(a):
            nsat += 1
    return nnz, nuf, nsat


def _flat(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t.contiguous().reshape(-1).numpy()


def percentages(hp: torch.Tensor, q: QTensor) -> tuple[float, float]:
    """(underflow %, saturation %) of one quantized operand (see the module doc)."""
    used = q.dequantize()
    nnz, nuf, nsat = _counts(_flat(hp), _flat(used), _flat(q.values), float(q.spec.fmt.max),
                             _SAT_TOL)  # fmt: skip
    n = hp.numel()
    return (100.0 * nuf / nnz if nnz else 0.0), (100.0 * nsat / n if n else 0.0)


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
    with on_operand(cb):
        yield rows
