"""Statistics hooks for any training loop (layer L6: imports nn, qtensor, scaling, stats).

* `watch` -- ``with fp8lab.watch(model, every=50, out="watch.jsonl") as w:`` records amax, scale,
  underflow %, saturation % and SQNR of the operands every converted GEMM consumed, per
  layer x GEMM x role, into JSONL / CSV / TensorBoard.
* `sample` -- one step's rows, for a loop with its own writer: the lab's ``stats.jsonl`` is
  written from it, so both have one definition of every statistic.
* `expert_scales` -- the rows of a mixture-of-experts layer's experts side by side: per
  (step, layer, GEMM, role) the spread of their amaxes and scales and the worst expert
  (`Watch.expert_scales` on a watch's records).
* `read_records`, `flag`, `THRESHOLDS` -- reading the files back and the fine / warning /
  critical levels `fp8lab observe-report` colours by (docs/observe.md).
"""

from __future__ import annotations

from fp8lab.observe.experts import EXPERT_FIELDS, expert_scales
from fp8lab.observe.levels import CRITICAL_PCT, FINE_PCT, LEVELS, THRESHOLDS, flag
from fp8lab.observe.records import FIELDS, NATURAL_OPERANDS, OperandStats, operand_row
from fp8lab.observe.sinks import read_records
from fp8lab.observe.watch import Watch, sample, watch

__all__ = [
    "CRITICAL_PCT",
    "EXPERT_FIELDS",
    "FIELDS",
    "FINE_PCT",
    "LEVELS",
    "NATURAL_OPERANDS",
    "THRESHOLDS",
    "OperandStats",
    "Watch",
    "expert_scales",
    "flag",
    "operand_row",
    "read_records",
    "sample",
    "watch",
]
