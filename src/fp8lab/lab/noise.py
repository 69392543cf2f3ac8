"""The lab's one noise rule: how far two runs that differ only in rounding drift apart.

`fp8lab compare` and `fp8lab debug` both leave a gap between a recipe's and the baseline's final
validation loss unranked (compare) or unattributed (debug) when it is within a few times the
run-to-run noise. Both estimate that noise from two curves that differ only in rounding (fp32
and bf16) with :func:`late_gap_pct`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: a validation curve: ``{step: loss}`` or ``[(step, loss), ...]`` (a loss may be None)
Curve = Mapping[int, float | None] | Iterable[tuple[int, float | None]]


def late_gap_pct(a: Curve, b: Curve, ref: Curve) -> float | None:
    """The largest ``|a(t) - b(t)| / ref(t)``, in %, over the second half of the run.

    The steps are those all three curves evaluated; "the second half" is every such step ``t``
    with ``2 t >= last``, ``last`` the latest of them, so the final common evaluation always
    counts. ``ref`` is the baseline the gaps under test are measured against (a relative gap of
    ``a`` and ``b`` over the reference keeps both in one unit). None when there is no common
    step, or when a value in the second half is missing (None), the reference is 0 there, or a
    gap is not finite (a diverged curve says nothing about noise).

    Why this rule and not "the gap over ``b`` from ``steps / 2`` on" (the debugger's former
    rule): the configured step count is not always the last evaluation (a run stopped early),
    and dividing by one of the two noise curves measures the noise in another unit than the
    gaps it is compared with; both agree when the baseline is ``b`` and the run completes.
    """
    va, vb, vr = dict(a), dict(b), dict(ref)
    steps = sorted(set(va) & set(vb) & set(vr))
    if not steps:
        return None
    gaps = []
    for t in (t for t in steps if 2 * t >= steps[-1]):
        x, y, r = va[t], vb[t], vr[t]
        if x is None or y is None or r is None or r == 0:
            return None
        gap = abs(100.0 * (x - y) / r)
        if not math.isfinite(gap):
            return None
        gaps.append(gap)
    return max(gaps)
