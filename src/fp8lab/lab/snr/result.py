"""`SnrResult` and the SNR arithmetic: per-sample and pooled SNR in dB, inf-aware quantiles."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8lab.lab.snr.config import SnrConfig

__all__ = ["SnrResult", "quantile", "snr_db"]


@dataclass
class SnrResult:
    """Per-sample outcome of one `SnrConfig`.

    ``snr_db``: float64 [samples], ``+inf`` where the result is exact. ``reference``/``result``:
    the float64 reference dot products and the low-precision results, [samples].
    """

    config: SnrConfig
    snr_db: np.ndarray
    reference: np.ndarray
    result: np.ndarray
    #: fraction of samples with at least one product clamped at the accumulator's max (or
    #: overflowed): a sign that the scale target is too high for the accumulator format
    acc_overflow_fraction: float = 0.0

    @property
    def median_db(self) -> float:
        return quantile(self.snr_db, 0.5)

    @property
    def p10_db(self) -> float:
        return quantile(self.snr_db, 0.1)

    @property
    def p90_db(self) -> float:
        return quantile(self.snr_db, 0.9)

    @property
    def below_0db_fraction(self) -> float:
        return float(np.mean(self.snr_db < 0.0))

    @property
    def exact_fraction(self) -> float:
        """Fraction of samples whose result equals the reference (infinite SNR)."""
        return float(np.mean(np.isposinf(self.snr_db)))

    @property
    def pooled_db(self) -> float:
        """Pooled SNR over all samples, as the simfloat notebook of "从DeepSeek V3看FP8训练的挑战"
        computes it: ``10*log10(sum(ref**2) / sum((ref - result)**2))``."""
        return snr_db(self.reference, self.result, pooled=True).item()

    def to_json(self, pooled: bool = False) -> dict[str, Any]:
        """The run as JSON-safe data: non-finite values (infinite SNR) become None."""
        out: dict[str, Any] = {
            "config": self.config.to_dict(),
            "median_db": _finite_or_none(self.median_db),
            "p10_db": _finite_or_none(self.p10_db),
            "p90_db": _finite_or_none(self.p90_db),
            "below_0db_fraction": self.below_0db_fraction,
            "snr_db": [_finite_or_none(v) for v in self.snr_db.tolist()],
        }
        if pooled:
            out["pooled_db"] = _finite_or_none(self.pooled_db)
        return out


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def quantile(values: np.ndarray, q: float) -> float:
    """Linear-interpolation quantile that keeps ``+-inf`` meaningful (inf where it interpolates
    towards an infinite sample) instead of returning NaN."""
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if v.size == 0:
        return math.nan
    pos = q * (v.size - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    frac = pos - lo
    if frac == 0.0 or v[lo] == v[hi]:
        return float(v[lo])
    if not (math.isfinite(v[lo]) and math.isfinite(v[hi])):
        return float(v[hi]) if math.isinf(v[hi]) else float(v[lo])
    return float(v[lo] + (v[hi] - v[lo]) * frac)


def snr_db(reference: np.ndarray, result: np.ndarray, pooled: bool = False) -> np.ndarray:
    """SNR in dB of ``result`` against ``reference``, per element (or pooled over all elements).

    ``+inf`` where the error is 0 (also for a zero reference), ``-inf`` where only the reference
    is 0. Computed as ``20*log10(|ref|/|err|)`` so tiny values do not underflow when squared.
    """
    ref = np.asarray(reference, dtype=np.float64)
    err = ref - np.asarray(result, dtype=np.float64)
    if pooled:
        ref = np.sqrt(np.sum(ref * ref, keepdims=True))
        err = np.sqrt(np.sum(err * err, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 20.0 * np.log10(np.abs(ref)) - 20.0 * np.log10(np.abs(err))
    out[err == 0] = math.inf
    return out
