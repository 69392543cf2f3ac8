"""The lab's one noise rule: how far two runs that differ only in rounding drift apart.

`fp8lab compare` and `fp8lab debug` both leave a gap between a recipe's and the baseline's final
validation loss unranked (compare) or unattributed (debug) when it is within a few times the
run-to-run noise. Both estimate that noise from two curves that differ only in rounding (fp32
and bf16) with :func:`late_gap_pct`, and both take the "few times" from here:

- :data:`WITHIN` (2): a gap (%) at most ``WITHIN`` x the noise (%) is *within noise*.
  `fp8lab compare` lists such recipes without ranking them (`lab.compare_summary.within_noise`,
  the summary's ``noise.factor``); the debugger counts a probe that ends there as explaining
  the gap (`lab.debug.method`), R's recovery as recovered (`lab.debug.verdict`), and its report
  draws the band (`report.debug`).
- :data:`ATTRIBUTE` (3): the debugger attributes a gap to FP8 only above ``ATTRIBUTE`` x the
  noise (and above ``lab.debug.method.MIN_GAP_PCT``): `lab.debug.method.gap_floor`.

Read them as ``noise.WITHIN`` at the point of use (never copied into another constant), so that
one value holds everywhere. The debugger's scenario table (docs/debug.md) was measured with
these values: a change of either comes with that table re-measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: the two recipes that differ only in rounding, whose gap is the noise
PAIR = ("fp32", "bf16")
#: a gap at most this many times the noise is within noise (compare: not ranked; debug: a
#: probe explains the gap, R recovers)
WITHIN = 2.0
#: the debugger attributes a gap to FP8 only above this many times the noise (`gap_floor`)
ATTRIBUTE = 3.0

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
