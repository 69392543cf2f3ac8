"""The levels a percentage of underflowed or saturated elements is flagged at (docs/observe.md).

Below ``FINE_PCT`` (0.5 %) fine; above ``CRITICAL_PCT`` (4 %) critical; in between (both ends
included) a warning. The same thresholds for underflow and saturation."""

from __future__ import annotations

import math

__all__ = ["CRITICAL_PCT", "FINE_PCT", "LEVELS", "THRESHOLDS", "flag"]

FINE_PCT = 0.5
CRITICAL_PCT = 4.0
THRESHOLDS = {"fine_below_pct": FINE_PCT, "critical_above_pct": CRITICAL_PCT}
LEVELS = ("fine", "warning", "critical")


def flag(pct: float | None) -> str | None:
    """``"fine"`` (< 0.5 %), ``"warning"`` (0.5 % .. 4 %), ``"critical"`` (> 4 %); None for a
    missing or NaN value."""
    if pct is None or (isinstance(pct, float) and math.isnan(pct)):
        return None
    if pct < FINE_PCT:
        return "fine"
    if pct > CRITICAL_PCT:
        return "critical"
    return "warning"
