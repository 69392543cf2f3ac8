"""Underflow and saturation percentages of the FP8 GEMM operands, on the steps the guard samples
(its ``saturation`` / ``underflow`` detectors, every ``every`` steps).

One definition with `fp8lab.watch`: `fp8lab.stats.clip_percentages`, whose per-element counts
are those of `fp8lab.stats.error_stats` (which the watch's `fp8lab.observe.records.operand_row`
runs), on the same three arrays -- the high-precision operand, the QTensor the GEMM consumed
(dequantized) and its scaled values --, so the numbers are equal (tested):

- ``underflow_pct``: % of the nonzero elements of the high-precision operand that are 0 in the
  dequantized operand;
- ``saturation_pct``: % of all elements whose scaled value sits at the format's max while the
  high-precision magnitude exceeds the dequantized one (clamped), or whose scaled value
  overflowed to Inf/NaN from a finite input. Exact for per-tensor and block scales alike.

The pass is lean (`clip_percentages`: three integer counts, one numba loop) where the watch's
`error_stats` also accumulates float64 sums for SQNR, cosine and the dynamic range: the guard
samples every 10 steps and has a 3 % overhead budget (docs/guard.md). Only quantized
operands (a `QTensor`: high-precision roundings such as bf16 are left out) in their natural
layout (fprop input and weight, dgrad grad_output) are measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fp8lab.nn import on_operand
from fp8lab.observe.records import NATURAL_OPERANDS
from fp8lab.qtensor import QTensor
from fp8lab.stats import clip_percentages

__all__ = ["operand_percentages", "percentages"]


def percentages(hp: torch.Tensor, q: QTensor) -> tuple[float, float]:
    """(underflow %, saturation %) of one quantized operand (see the module doc)."""
    return clip_percentages(hp, q)


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
