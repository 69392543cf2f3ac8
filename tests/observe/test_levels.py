"""The fine / warning / critical levels at their documented boundaries."""

from __future__ import annotations

import math

from fp8lab.observe import CRITICAL_PCT, FINE_PCT, flag


def test_levels_at_the_boundaries():
    assert (FINE_PCT, CRITICAL_PCT) == (0.5, 4.0)
    assert flag(0.0) == flag(0.49999) == "fine"
    assert flag(0.5) == flag(4.0) == "warning"
    assert flag(4.000001) == flag(100.0) == "critical"
    assert flag(None) is None and flag(math.nan) is None
