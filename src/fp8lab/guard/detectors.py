"""The guard's detectors: one function per signal, pure arithmetic on numbers fp8lab already
computes (the loss, the gradient norm, each delayed-scaling state's amax history and scale, the
per-operand underflow and saturation percentages). Definitions and thresholds: docs/guard.md.

Each detector takes its parameters (`fp8lab.guard.config.DETECTOR_DEFAULTS`) and returns
`Finding`\\ s: ``detector``, ``tensor`` (``"layer:role"``, None for whole-model signals),
``value`` and ``threshold``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "FLUSH_BINADES",
    "Finding",
    "headroom_findings",
    "loss_spike",
    "nonfinite",
    "percent_findings",
    "robust_z",
    "staleness_findings",
    "zscore",
]

#: smallest spread of a log-signal's window (1 %): a flat window would make any wiggle an alarm
MIN_SIGMA = 0.01
#: log2(amax * scale / smallest subnormal) at or below this: the largest element (at most half
#: the smallest subnormal) rounds to zero, and so does every other element
FLUSH_BINADES = -1.0


@dataclass(frozen=True)
class Finding:
    """One detector firing: ``value`` crossed ``threshold`` (``tensor`` None: whole model)."""

    detector: str
    value: float | None
    threshold: float
    tensor: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def robust_z(x: float, window: Sequence[float]) -> float:
    """``(x - median) / (1.4826 * MAD)`` over ``window``; the spread is at least `MIN_SIGMA`.
    (1.4826 * MAD estimates the standard deviation of a normal sample, unmoved by outliers.)"""
    med = statistics.median(window)
    mad = statistics.median(abs(w - med) for w in window)
    return (x - med) / max(1.4826 * mad, MIN_SIGMA)


def nonfinite(
    loss: float, grad_norm: float, amax_ok: bool, overflow_run: int, params: Mapping[str, float],
    dynamic_scaler: bool,
) -> list[Finding]:  # fmt: skip
    """A non-finite loss or amax history; a non-finite gradient norm, except while a dynamic
    loss scaler handles it (fewer than ``overflow_steps`` overflows in a row)."""
    out = []
    if not math.isfinite(loss):
        out.append(Finding("nonfinite", None, 0.0, "loss"))
    elif not math.isfinite(grad_norm) and (
        not dynamic_scaler or overflow_run >= params["overflow_steps"]
    ):
        out.append(Finding("nonfinite", None, 0.0, "grad_norm"))
    if not amax_ok:
        out.append(Finding("nonfinite", None, 0.0, "amax_history"))
    return out


def loss_spike(loss: float, max_first: float, count: int, params: Mapping[str, float]):
    """Megatron-LM's spiky-loss rule (``RerunStateMachine.is_unexpectedly_large``): after
    ``samples`` finite values, ``|loss| >= factor * max(|first samples|)``."""
    if not math.isfinite(loss) or count < params["samples"] or max_first <= 0:
        return []
    ratio = abs(loss) / max_first
    return [Finding("loss_spike", ratio, params["factor"])] if ratio >= params["factor"] else []


def zscore(
    name: str, x: float, window: Sequence[float], params: Mapping[str, float], two_sided: bool
) -> tuple[float | None, list[Finding]]:
    """Robust z-score of log(x) against the window of earlier log-values (None until
    ``min_samples`` values were seen); fires at ``|z| >= threshold`` (upward only unless
    ``two_sided``)."""
    if not (_finite(x) and x > 0) or len(window) < params["min_samples"]:
        return None, []
    z = robust_z(math.log(x), window)
    hit = abs(z) if two_sided else z
    return z, ([Finding(name, z, params["threshold"])] if hit >= params["threshold"] else [])


def headroom_findings(values: Iterable[tuple[str, float]], params: Mapping[str, float]):
    """Tensors whose amax exceeded the delayed scale's range by ``threshold`` binades or more."""
    t = params["threshold"]
    return [Finding("headroom", v, t, name) for name, v in values if v >= t]


def staleness_findings(
    values: Iterable[tuple[str, float]],
    params: Mapping[str, float],
    floor: Mapping[str, float] | None = None,
) -> tuple[list[Finding], list[Finding]]:
    """(acting, warnings): tensors whose history max is ``threshold`` binades or more above this
    step's amax. Staleness *predicts* underflow; how much of the tensor it flushes depends on
    the tensor's distribution, which this check does not see. So a stale tensor is a warning,
    and acts only when the flush is certain: ``floor`` (tensor -> log2(amax * scale / smallest
    subnormal) of this step) at or below -1, i.e. the step's largest element, and so every
    element, rounded to zero (the whole operand was flushed). A measured underflow jump is the
    ``underflow`` detector's to act on."""
    t = params["threshold"]
    floor = floor or {}
    act, warn = [], []
    for name, v in values:
        if v >= t:
            (act if floor.get(name, math.inf) <= FLUSH_BINADES else warn).append(
                Finding("staleness", v, t, name)
            )
    return act, warn


def percent_findings(
    rows: Iterable[Mapping[str, Any]],
    last: Mapping[str, Sequence[float | None]],
    detectors: Mapping[str, Mapping[str, float]],
) -> list[Finding]:
    """Saturation % at or above ``threshold_pct``; underflow % up by ``jump_pct`` points since
    the previous measurement of the same operand (``last``: tensor -> [underflow, saturation])."""
    out = []
    for r in rows:
        name = f"{r['layer']}:{r['role']}"
        sat, und = r.get("saturation_pct"), r.get("underflow_pct")
        if "saturation" in detectors and _finite(sat):
            t = detectors["saturation"]["threshold_pct"]
            if sat >= t:
                out.append(Finding("saturation", sat, t, name))
        prev = last.get(name)
        if "underflow" in detectors and _finite(und) and prev is not None and _finite(prev[0]):
            t = detectors["underflow"]["jump_pct"]
            if und - prev[0] >= t:
                out.append(Finding("underflow", und - prev[0], t, name))
    return out
