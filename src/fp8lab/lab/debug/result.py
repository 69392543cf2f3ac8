"""The debugger's result: finished probes and the verdict (``DebugResult.to_json`` is the
``--json`` schema)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DebugResult", "Probe"]


@dataclass
class Probe:
    """A finished probe: its gap to the baseline and its validation curve."""

    name: str
    kind: str
    label: str
    summary: dict[str, Any]
    val: list[tuple[int, float | None]]  # (step, val_loss)
    gap_pct: float | None = None
    closure: float | None = None  # share of R's gap it closes (1 = none left)
    explains: bool = False
    recipe: Any = None


@dataclass
class DebugResult:
    """Everything the debugger found (see :meth:`to_json` for the ``--json`` schema)."""

    recipe: str
    baseline: str
    gap_pct: float | None
    noise_pct: float | None
    recovers: bool
    culprit: dict[str, Any] | None
    attribution: list[dict[str, Any]]
    remedies: list[dict[str, Any]]
    fix: str | None
    probes: dict[str, Probe]
    verdict: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"schema_version": 1, "recipe", "baseline", "gap_pct", "noise_pct", "recovers",
        "culprit", "attribution", "remedies", "fix", "probes"}``; non-finite numbers null."""
        return {
            "schema_version": 1,
            "recipe": self.recipe,
            "baseline": self.baseline,
            "gap_pct": _num(self.gap_pct),
            "noise_pct": _num(self.noise_pct),
            "recovers": bool(self.recovers),
            "culprit": self.culprit,
            "attribution": [
                {
                    "layer": a["layer"],
                    "gemm": a["gemm"],
                    "role": a["role"],
                    "score": _num(a["score"]),
                }
                for a in self.attribution
            ],
            "remedies": [
                {
                    "name": r["name"],
                    "gap_pct": _num(r["gap_pct"]),
                    "relative_cost": _num(r["relative_cost"]),
                }
                for r in self.remedies
            ],
            "fix": self.fix,
            "probes": [{"name": p.name, "gap_pct": _num(p.gap_pct)} for p in self.probes.values()],
        }


def _num(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _rel(v: float | None, b: float | None) -> float | None:
    if v is None or b is None or b == 0:
        return None
    g = 100.0 * (v - b) / b
    return g if math.isfinite(g) else None
