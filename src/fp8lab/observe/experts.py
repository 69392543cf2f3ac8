"""Per-expert scale statistics: the watch rows of a `fp8lab.nn.GroupedLinear`'s experts side by
side, one summary per (step, grouped layer, GEMM, role).

Each expert is its own converted `fp8lab.nn.Linear` (``<layer>.experts.<e>``), so its operands
have their own rows in the watch records (amax, scales, underflow, SQNR of the tokens routed to
it, padding rows included in ``numel``). Per-tensor scaling gives each expert the scale of its
own tokens: an expert that sees few or unusual tokens gets a scale far from the others', which
the summary shows as the spread of the scales across experts (``scale_spread_log2``) and names
the experts at the extremes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fp8lab.nn.grouped import expert_of

__all__ = ["EXPERT_FIELDS", "expert_scales"]

#: the keys of one summary, in order
EXPERT_FIELDS = (
    "step",
    "layer",
    "gemm",
    "role",
    "experts",
    "amax_min",
    "amax_max",
    "scale_min",
    "scale_max",
    "scale_spread_log2",
    "underflow_pct_max",
    "underflow_expert",
    "sqnr_db_min",
    "sqnr_expert",
)


def expert_scales(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summaries (`EXPERT_FIELDS`) of the expert rows among watch records ``rows`` (the rows of
    other layers are ignored; a layer's first call per step is used). ``amax_*``: over the
    experts' amaxes; ``scale_*``: over their quantization multipliers (every block's), None
    where no expert has scales (high-precision operands); ``scale_spread_log2``:
    ``log2(scale_max / scale_min)``; ``underflow_pct_max`` and ``sqnr_db_min``, the worst expert
    and its index."""
    groups: dict[tuple[Any, str, str, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        hit = expert_of(str(r.get("layer", "")))
        if hit is None or r.get("call", 0) != 0:
            continue
        key = (r.get("step"), hit[0], r["gemm"], r["role"])
        groups.setdefault(key, {})[hit[1]] = r
    out = []
    for (step, layer, gemm, role), by_e in groups.items():
        es = sorted(by_e)
        lo = [by_e[e]["scale_min"] for e in es if by_e[e].get("scale_min") is not None]
        hi = [by_e[e]["scale_max"] for e in es if by_e[e].get("scale_max") is not None]
        s_min, s_max = (min(lo), max(hi)) if lo and hi else (None, None)
        spread = (
            math.log2(s_max / s_min) if s_min and s_max and math.isfinite(s_max / s_min) else None
        )
        under = max(es, key=lambda e: by_e[e].get("underflow_pct") or 0.0)
        sq = [e for e in es if by_e[e].get("sqnr_db") is not None]
        worst = min(sq, key=lambda e: by_e[e]["sqnr_db"]) if sq else None
        out.append(
            {
                "step": step,
                "layer": layer,
                "gemm": gemm,
                "role": role,
                "experts": len(es),
                "amax_min": min(by_e[e]["amax"] for e in es),
                "amax_max": max(by_e[e]["amax"] for e in es),
                "scale_min": s_min,
                "scale_max": s_max,
                "scale_spread_log2": spread,
                "underflow_pct_max": by_e[under].get("underflow_pct"),
                "underflow_expert": under,
                "sqnr_db_min": None if worst is None else by_e[worst]["sqnr_db"],
                "sqnr_expert": worst,
            }
        )
    return out
