"""One row of statistics per GEMM operand, from the operands the GEMMs really consumed.

The operand hook (`fp8lab.nn.on_operand`) hands over, per ``(layer, gemm, role)``,
the high-precision operand ``hp`` (natural layout) and what the GEMM consumed: the QTensor the
quantization pass made (reused or re-tiled for a backward GEMM), or the bf16/fp16-rounded
tensor. The statistics are those of `fp8lab.stats.error_stats` on ``hp`` and the dequantized
copy; scale and saturation read the QTensor's own scaled values and scales, so nothing is
quantized again (and a stochastic rounding's draw is the one the GEMM used). A quantized operand
handed over as a plain tensor has no scaled values: ``scale``/``saturation_pct`` None and
``exact`` false rather than a guess. FP8 attention (`fp8lab.nn.DotProductAttention`) hands over
its quantization points the same way, as ``gemm = "dpa"`` with TE's roles Q, K, V, S, O, dO, dP
and dQKV.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8lab.nn import DotProductAttention, Linear, active_recipe
from fp8lab.nn.plan import OperandPlan
from fp8lab.qtensor import QTensor
from fp8lab.stats import error_stats

__all__ = ["FIELDS", "NATURAL_OPERANDS", "OperandStats", "operand_row"]

#: the columns of a record, in order (JSONL keys, CSV header)
FIELDS = (
    "step",
    "layer",
    "gemm",
    "role",
    "call",
    "format",
    "spec",
    "numel",
    "amax",
    "scale",
    "scale_inv",
    "scale_min",
    "scale_max",
    "underflow_pct",
    "saturation_pct",
    "sqnr_db",
    "exact",
)

#: each role once, as its forward or dgrad GEMM consumed it in its natural layout: the operands
#: a per-role summary (the lab's report) reads; the other (GEMM, role) cells are the wgrad's
#: and dgrad's copies of the same tensors, re-used or re-tiled
NATURAL_OPERANDS = (("fprop", "input"), ("fprop", "weight"), ("dgrad", "grad_output"))


class OperandStats:
    """Turns hook calls into rows for one model: finds each layer's operand plan (for the spec's
    description and the high-precision cells) and measures the operand the GEMM consumed."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.modules: dict[str, Linear] = {}
        #: the model's attention modules by name: their records (``gemm = "dpa"``, roles Q, K, V,
        #: S, O, dO, dP, dQKV) carry their QTensors' own specs
        self.attention: set[str] = set()
        if model is not None:
            for n, m in model.named_modules():
                if isinstance(m, Linear | DotProductAttention):
                    if m.name is None:
                        m.name = n
                    if isinstance(m, Linear):
                        self.modules[m.name] = m
                    else:
                        self.attention.add(m.name)
        self.plans: dict[str, Any] = {}
        # this step's measured (QTensor, source) pairs: a backward GEMM reusing the forward's
        # QTensor as is hands over the same two objects, measured once (held until new_step,
        # so an id is not reused by another tensor meanwhile)
        self.seen: dict[tuple[int, int], tuple[QTensor, torch.Tensor, dict[str, Any]]] = {}

    def knows(self, layer: str) -> bool:
        """Whether ``layer`` is one of this model's converted Linear or attention modules."""
        return layer in self.modules or layer in self.attention

    def new_step(self) -> None:
        self.seen.clear()

    def plan(self, layer: str, gemm: str, role: str) -> OperandPlan | None:
        m = self.modules.get(layer)
        if m is None:
            return None
        plan = self.plans.get(layer)
        if gemm == "fprop" or plan is None:
            # the module's cached plan for the recipe in force (fp8lab.nn.autocast may override
            # it); the backward runs under the forward's plan, also after autocast has exited
            plan, _ = m._plan(active_recipe(m.recipe))
            self.plans[layer] = plan
        return getattr(plan, gemm)[role]

    def row(self, layer: str, gemm: str, role: str, hp: torch.Tensor,
            used: Any) -> dict[str, Any] | None:  # fmt: skip
        """The statistics of one operand (None for an operand the GEMM took unchanged in fp32)."""
        if isinstance(used, QTensor):  # a hook handing over the QTensor itself
            q: QTensor | None = used
            used = used.dequantize()
        else:
            q = None
        op = self.plan(layer, gemm, role)
        hp32 = hp.detach()
        if hp32.dtype != torch.float32:
            hp32 = hp32.float()
        if op is not None and op.high_precision is not None:
            if op.high_precision == "fp32":
                return None
            return operand_row(hp32, used, op.high_precision, op.high_precision, None)
        if op is None or op.spec is None:
            if q is None:
                return None
            spec = q.spec
        else:
            spec = op.spec
        if q is None:
            return operand_row(hp32, used, spec.fmt.name, spec.describe(), q)
        key = (id(q), id(hp))
        hit = self.seen.get(key)
        if hit is not None and hit[0] is q and hit[1] is hp:
            return {**hit[2], "spec": spec.describe()}  # the GEMM's own orientation
        r = operand_row(hp32, used, spec.fmt.name, spec.describe(), q)
        self.seen[key] = (q, hp, r)
        return r


def operand_row(
    hp: torch.Tensor, used: torch.Tensor, fmt: str, spec: str, q: QTensor | None
) -> dict[str, Any]:
    """Statistics of one operand pair (`fp8lab.stats.error_stats`, float64 sums).

    ``amax``: max |hp| (the tensor scaling looks at). ``underflow_pct``: % of the nonzero
    elements of ``hp`` that are 0 in ``used``. ``saturation_pct``: % of all elements whose scaled
    value sits at +-max of ``fmt`` while |hp| > |used| (clamped), or overflowed to Inf/NaN from a
    finite input; needs the scaled values (``q``), else None -- except for a plain rounding to
    bf16/fp16 (scale 1, ``q`` None, ``spec`` equal to ``fmt``). ``sqnr_db``: 10 log10(sum hp^2 /
    sum (hp - used)^2), +inf (JSON null) when exact. ``scale``: the per-tensor quantization
    multiplier (values = cast(hp * scale)) and ``scale_inv`` the dequantization multiplier
    (used = values * scale_inv), when one serves the whole tensor; ``scale_min``/``scale_max``
    over the blocks (quantization multipliers).
    """
    plain = q is None and spec == fmt
    values = q.values.reshape(used.shape) if q is not None else (used if plain else None)
    st = error_stats(hp, used, fmt if values is not None else None, values)
    row: dict[str, Any] = {
        "format": fmt,
        "spec": spec,
        "numel": int(st["numel"]),
        "amax": st["amax"],
        "scale": None,
        "scale_inv": None,
        "scale_min": None,
        "scale_max": None,
        "underflow_pct": st["underflow_pct"],
        "saturation_pct": None if values is None else st["saturation_pct"],
        "sqnr_db": st["sqnr_db"],
        "exact": q is not None or plain,
    }
    if plain:
        row["scale"] = row["scale_inv"] = row["scale_min"] = row["scale_max"] = 1.0
    elif q is not None:
        m = q.scale_multipliers
        if m is None:  # multipliers = 1 / dequantization scales
            m = torch.reciprocal(q.scale_tensor())
        m = m.reshape(-1)
        if m.numel():
            lo, hi = float(m.min()), float(m.max())
            row["scale_min"], row["scale_max"] = lo, hi
            if lo == hi:  # one multiplier for the whole tensor
                row["scale"] = lo
                row["scale_inv"] = float(q.scale_tensor().reshape(-1)[0])
    return row
