"""`AnomalyGuard`: what the guard watches and what it does about an anomaly (frozen data).

The detectors and their thresholds are documented in docs/guard.md. ``detectors`` accepts
``None`` (every detector with its default thresholds), a list of names, or a mapping
``name -> {param: value}`` (overrides; ``false`` switches a detector off). The TOML file of
``fp8lab compare --guard-config`` holds the same keys as the constructor.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8lab._keys import check_keys

__all__ = ["DETECTOR_DEFAULTS", "ON_RESTART", "POLICIES", "AnomalyGuard"]

POLICIES = ("off", "skip", "rollback")
#: after a rollback: "current_step" resets the affected delayed-scaling histories and runs one
#: current-scaling step; "skip_batch" does the same and also skips the offending batch; "keep"
#: keeps the restored histories (a plain replay)
ON_RESTART = ("current_step", "skip_batch", "keep")

#: detector -> default thresholds (docs/guard.md gives the definitions and the sources)
DETECTOR_DEFAULTS: dict[str, dict[str, float]] = {
    # non-finite loss, gradient norm or amax history; with a dynamic loss scaler a gradient
    # overflow is routine (the scaler skips the step and backs off) until it repeats
    "nonfinite": {"overflow_steps": 5},
    # Megatron-LM: |loss| >= factor x the max of the first `samples` finite losses
    "loss_spike": {"factor": 10.0, "samples": 100},
    # robust z-score (median / MAD) of log(loss) over the last `window` accepted steps
    "loss_zscore": {"threshold": 10.0, "window": 100, "min_samples": 20},
    # robust z-score of log(grad norm), both directions (a saturated spike shrinks the norm)
    "grad_norm_zscore": {"threshold": 10.0, "window": 100, "min_samples": 20},
    # binades by which this step's amax exceeded what the delayed scale could represent
    "headroom": {"threshold": 4.0},
    # log2(history max / this step's amax): the stale scale pushes values toward underflow
    "staleness": {"threshold": 16.0},
    # per-operand clamped % (every `every` steps)
    "saturation": {"threshold_pct": 5.0, "every": 10},
    # per-operand underflow %: a jump of `jump_pct` points since the previous measurement
    "underflow": {"jump_pct": 25.0, "every": 10},
}

_INT_PARAMS = {"overflow_steps", "samples", "window", "min_samples", "every"}


def _check_number(where: str, v: Any, integer: bool) -> float | int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{where}: expected a finite number, got {v!r}")
    if integer:
        if not (float(v).is_integer() and v >= 1):
            raise ValueError(f"{where}: expected an integer >= 1, got {v!r}")
        return int(v)
    if v < 0:
        raise ValueError(f"{where}: expected a number >= 0, got {v!r}")
    if where.endswith("_pct") and v > 100:
        raise ValueError(f"{where}: a percentage, expected 0..100, got {v!r}")
    return float(v)


def normalize_detectors(spec: Any) -> dict[str, dict[str, float]]:
    """``detectors=`` as ``{name: {param: value}}`` with every default filled in (see the
    module doc for the accepted forms); unknown names or parameters raise ValueError."""
    if spec is None:
        return copy.deepcopy(DETECTOR_DEFAULTS)
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    if isinstance(spec, Mapping):  # overrides of the defaults: unnamed detectors keep theirs
        check_keys(spec, DETECTOR_DEFAULTS, "detector")
        out = copy.deepcopy(DETECTOR_DEFAULTS)
        for name, v in spec.items():
            if v is False:
                del out[name]
                continue
            params = dict(DETECTOR_DEFAULTS[name])
            if v is not True:
                if not isinstance(v, Mapping):
                    raise ValueError(
                        f"detectors.{name}: expected a table of thresholds, true or false, "
                        f"got {v!r}"
                    )
                check_keys(v, params, f"detectors.{name}")
                for k, x in v.items():
                    params[k] = _check_number(f"detectors.{name}.{k}", x, k in _INT_PARAMS)
            out[name] = params
        return out
    if isinstance(spec, Sequence):
        names = list(spec)
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"detectors: expected detector names, got {spec!r}")
        check_keys(dict.fromkeys(names), DETECTOR_DEFAULTS, "detector")
        return {n: dict(DETECTOR_DEFAULTS[n]) for n in names}
    raise ValueError(f"detectors: expected None, a list of names or a table, got {spec!r}")


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


@dataclass(frozen=True)
class AnomalyGuard:
    """Watch a training run for numerical anomalies and act on them.

    ``policy``: ``"off"`` (detectors run and their signals are reported, nothing is done),
    ``"skip"`` (the offending step's update is not applied and the affected delayed-scaling
    histories restart with one current-scaling step) or ``"rollback"`` (restore model,
    optimizer, loss scaler, RNG and loop state from the newest in-memory last-good checkpoint,
    taken every ``checkpoint_every`` steps, ``keep`` of them, then restart as ``on_restart``
    says). After ``max_rollbacks`` rollbacks within ``window`` steps, or at once when the replay
    runs into the anomaly on the same step again (reproducible, not transient), the guard escalates
    (``escalate``: the flagged tensor's scaling is pinned to current scaling by a per-layer
    recipe rule, recorded in the run's effective recipe) or, without a tensor to pin or with
    ``escalate=False``, skips the offending batch.
    """

    detectors: Any = field(default=None, compare=False)
    policy: str = "rollback"
    checkpoint_every: int = 50
    keep: int = 3
    max_rollbacks: int = 3
    window: int = 200
    on_restart: str = "current_step"
    escalate: bool = True
    _detectors: dict[str, dict[str, float]] = field(
        init=False, repr=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_detectors", normalize_detectors(self.detectors))
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.on_restart not in ON_RESTART:
            raise ValueError(f"on_restart must be one of {ON_RESTART}, got {self.on_restart!r}")
        for name in ("checkpoint_every", "keep", "max_rollbacks", "window"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.escalate, bool):
            raise ValueError(f"escalate must be true or false, got {self.escalate!r}")

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    @property
    def detector_params(self) -> dict[str, dict[str, float]]:
        """Enabled detectors with every threshold (a copy)."""
        return copy.deepcopy(self._detectors)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` reads back (detectors fully expanded, a switched-off
        one as ``False``)."""
        params = self.detector_params
        return {
            # every detector: a switched-off one as false (a table overrides the defaults)
            "detectors": {n: params.get(n, False) for n in DETECTOR_DEFAULTS},
            "policy": self.policy,
            "checkpoint_every": self.checkpoint_every,
            "keep": self.keep,
            "max_rollbacks": self.max_rollbacks,
            "window": self.window,
            "on_restart": self.on_restart,
            "escalate": self.escalate,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **overrides: Any) -> AnomalyGuard:
        """Build from plain data (the constructor's keys; unknown keys raise naming them)."""
        keys = ("detectors", "policy", "checkpoint_every", "keep", "max_rollbacks", "window",
                "on_restart", "escalate")  # fmt: skip
        check_keys(d, keys, "guard")
        guard = cls(**dict(d))  # the file's own values are checked whole, then overridden
        return dataclasses.replace(guard, **overrides) if overrides else guard

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> AnomalyGuard:
        """Read a guard TOML file (the constructor's keys at the top level, ``[detectors.X]``
        tables for thresholds); every error starts with the file name."""
        try:
            with open(path, "rb") as f:
                d = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
        try:
            return cls.from_dict(d, **overrides)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
