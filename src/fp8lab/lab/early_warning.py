"""Early warnings of a training failure: which signal fires, and how long before the loss moves.

Definitions (docs/early_warning.md gives the reasoning and the sources):

- **per-step record**: one dict per training step, keyed by the 0-based ``step``: the loss, the
  guard's signals (the ``guard_signals`` events `fp8lab.lab.train.train_run` emits with a guard,
  see `fp8lab.guard.monitor.GuardMonitor.check`: ``loss_ratio``, ``loss_zscore``,
  ``grad_norm_zscore``, ``headroom``, ``staleness``, ``saturation_pct``, ``underflow_pct`` and
  ``fired``, the detectors that fired) and the optional published indicators that
  `OptionalSignals` measures with forward hooks (``kurtosis_block``, ``kurtosis_linear_in``,
  ``attn_logit_max``, ``log_z``).
- **divergence step** (`divergence_step`): the first step whose loss is non-finite or above
  ``factor`` (1.5) x the minimum of the earlier losses.
- **firing**: a guard detector fires as the guard fires it (default thresholds; a warning
  counts, e.g. ``staleness``, which warns without acting unless the operand flushed); an optional
  indicator fires when the robust z-score of its (log) value against the previous ``window``
  (100) steps reaches ``threshold`` (10, the guard's z-score threshold) -- `zscore_firings`.
- **lead time** (`lead_time`): divergence step minus the first firing in the ``lookback`` (100)
  steps before it (0: fires on the divergence step; negative: fires only after it, within
  ``lookback`` steps; None: no firing in that span).
- **detection delay** (`detection_delay`): first firing at or after a planted fault's step minus
  that step (None: no firing within ``horizon`` steps).
- **false-alarm rate** (`false_alarm_rate`): firings (steps on which the signal fires) per 1000
  steps of healthy runs.

Everything here except `OptionalSignals` is pure arithmetic on lists of numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8lab.guard.config import DETECTOR_DEFAULTS
from fp8lab.guard.detectors import robust_z

__all__ = [
    "DIVERGENCE_FACTOR",
    "GUARD_SIGNALS",
    "LOOKBACK",
    "OPTIONAL_SIGNALS",
    "SIGNALS",
    "OptionalSignals",
    "SignalRecorder",
    "channel_kurtosis",
    "detection_delay",
    "divergence_step",
    "false_alarm_rate",
    "firing_steps",
    "guard_firings",
    "lead_time",
    "max_attention_logit",
    "recording",
    "zscore_firings",
]

#: a loss above this factor x its running minimum is a divergence
DIVERGENCE_FACTOR = 1.5
#: a firing counts as a warning when it comes at most this many steps before the divergence
LOOKBACK = 100
#: the guard's detectors, in table order (fp8lab.guard.config.DETECTOR_DEFAULTS)
GUARD_SIGNALS = tuple(DETECTOR_DEFAULTS)


@dataclass(frozen=True)
class Indicator:
    """An optional indicator: record key, transform before the z-score, both directions?"""

    key: str
    log: bool
    two_sided: bool
    source: str


#: the optional published indicators (docs/early_warning.md cites the sources)
OPTIONAL_SIGNALS: dict[str, Indicator] = {
    i.key: i
    for i in (
        Indicator("kurtosis_block", True, False, "He et al. 2024, arXiv 2405.19279"),
        Indicator("kurtosis_linear_in", True, False, "He et al. 2024, arXiv 2405.19279"),
        Indicator("attn_logit_max", True, False, "Dehghani et al. 2023, arXiv 2302.05442"),
        Indicator("log_z", False, True, "Wortsman et al. 2023, arXiv 2309.14322"),
    )
}
SIGNALS = GUARD_SIGNALS + tuple(OPTIONAL_SIGNALS)
#: z-score rule of the optional indicators: the guard's loss_zscore defaults
Z_THRESHOLD = float(DETECTOR_DEFAULTS["loss_zscore"]["threshold"])
Z_WINDOW = int(DETECTOR_DEFAULTS["loss_zscore"]["window"])
Z_MIN_SAMPLES = int(DETECTOR_DEFAULTS["loss_zscore"]["min_samples"])


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


# ----------------------------------------------------------------------------- arithmetic
def divergence_step(
    losses: Sequence[float | None], factor: float = DIVERGENCE_FACTOR
) -> int | None:
    """Index of the first loss that is non-finite (None counts as non-finite) or greater than
    ``factor`` x the minimum of the finite losses before it; None when no loss is. The first
    loss can only diverge by being non-finite (there is no minimum yet)."""
    low = math.inf
    for t, x in enumerate(losses):
        if not _finite(x):
            return t
        if x > factor * low:
            return t
        low = min(low, x)
    return None


def zscore_firings(
    values: Sequence[float | None],
    threshold: float = Z_THRESHOLD,
    window: int = Z_WINDOW,
    min_samples: int = Z_MIN_SAMPLES,
    log: bool = True,
    two_sided: bool = False,
) -> list[bool]:
    """Per step: does the robust z-score (`fp8lab.guard.detectors.robust_z`: median/MAD, spread
    at least 1 %) of the value against the previous ``window`` usable values reach
    ``threshold``? A value is usable when finite (and > 0 with ``log``: z of log(value)). An
    unusable value does not fire and does not join the window; fewer than ``min_samples`` earlier
    values: no firing."""
    out: list[bool] = []
    hist: list[float] = []
    for v in values:
        ok = _finite(v) and (not log or v > 0)
        if not ok:
            out.append(False)
            continue
        x = math.log(v) if log else float(v)
        fire = False
        if len(hist) >= min_samples:
            z = robust_z(x, hist[-window:])
            fire = (abs(z) if two_sided else z) >= threshold
        out.append(fire)
        hist.append(x)
        del hist[: max(0, len(hist) - window)]
    return out


def _refire(records: Sequence[Mapping[str, Any]], detector: str) -> list[bool]:
    """The guard's firings rebuilt from its signals with the default thresholds, for records
    without a ``fired`` list. Exact for the threshold rules (the signal is the max over
    tensors); approximate for ``nonfinite`` (loss or grad norm only: no amax history, no
    dynamic-scaler allowance), ``loss_spike`` (its 100 samples counted as steps) and
    ``underflow`` (a jump of the max over operands, not of each operand)."""
    p = DETECTOR_DEFAULTS.get(detector, {})
    out, prev_und = [], None
    for r in records:
        v = r.get(detector)
        if detector == "nonfinite":
            hit = not (_finite(r.get("loss")) and _finite(r.get("grad_norm")))
        elif detector == "loss_spike":
            ratio = r.get("loss_ratio")
            hit = r["step"] >= p["samples"] and _finite(ratio) and ratio >= p["factor"]
        elif detector in ("loss_zscore", "grad_norm_zscore"):
            z = abs(v) if _finite(v) and detector == "grad_norm_zscore" else v
            hit = _finite(z) and z >= p["threshold"]
        elif detector in ("headroom", "staleness"):
            hit = _finite(v) and v >= p["threshold"]
        elif detector == "saturation":
            v = r.get("saturation_pct")
            hit = _finite(v) and v >= p["threshold_pct"]
        else:  # underflow
            v = r.get("underflow_pct")
            hit = _finite(v) and prev_und is not None and v - prev_und >= p["jump_pct"]
            prev_und = v if _finite(v) else prev_und
        out.append(bool(hit))
    return out


def guard_firings(records: Sequence[Mapping[str, Any]], detector: str) -> list[bool]:
    """Per record: did the guard's ``detector`` fire? Read from the record's ``fired`` list (the
    detectors `GuardMonitor.check` returned findings for) when the records have one, else
    rebuilt from the signals (`_refire`, approximate for three detectors)."""
    if records and all("fired" in r for r in records):
        return [detector in (r.get("fired") or ()) for r in records]
    return _refire(records, detector)


def firing_steps(records: Sequence[Mapping[str, Any]], signal: str, **zscore_kw: Any) -> list[int]:
    """The ``step`` values of the records on which ``signal`` fires: a guard detector
    (`guard_firings`) or an optional indicator (`zscore_firings` of its record values, with the
    indicator's transform; ``zscore_kw`` overrides the threshold, window, min_samples)."""
    if signal in OPTIONAL_SIGNALS:
        ind = OPTIONAL_SIGNALS[signal]
        kw = {"log": ind.log, "two_sided": ind.two_sided, **zscore_kw}
        fires = zscore_firings([r.get(signal) for r in records], **kw)
    elif signal in GUARD_SIGNALS:
        fires = guard_firings(records, signal)
    else:
        raise ValueError(f"unknown signal {signal!r}; known: {', '.join(SIGNALS)}")
    return [int(r["step"]) for r, f in zip(records, fires, strict=True) if f]


def lead_time(fires: Sequence[int], div_step: int | None, lookback: int = LOOKBACK) -> int | None:
    """``div_step`` minus the first firing step in ``[div_step - lookback, div_step + lookback]``
    (positive: a warning that many steps ahead; 0: on the divergence step; negative: only after
    it). None without a divergence or without a firing in that span."""
    if div_step is None:
        return None
    near = [s for s in fires if div_step - lookback <= s <= div_step + lookback]
    return div_step - min(near) if near else None


def detection_delay(
    fires: Sequence[int], fault_step: int, horizon: int | None = None
) -> int | None:
    """Steps from a planted fault at ``fault_step`` to the first firing at or after it (0: the
    fault's own step); None when nothing fires (within ``horizon`` steps, if given)."""
    after = [s - fault_step for s in fires if s >= fault_step]
    after = [d for d in after if horizon is None or d <= horizon]
    return min(after) if after else None


def false_alarm_rate(n_firings: int, n_steps: int) -> float:
    """Firings per 1000 steps (``n_steps`` > 0)."""
    if n_steps <= 0:
        raise ValueError(f"n_steps must be > 0, got {n_steps}")
    return 1000.0 * n_firings / n_steps


# ----------------------------------------------------------------------------- indicators
def channel_kurtosis(x: torch.Tensor) -> float:
    """Outlier-feature kurtosis of activations ``x`` [..., channels] (He et al. 2024):
    with ``s_j`` the mean square of channel j over all tokens, ``mean(s^2) / mean(s)^2``.
    1 when every channel has the same scale, up to ``channels`` when one channel holds all
    the energy; NaN for an all-zero tensor."""
    s = x.detach().float().reshape(-1, x.shape[-1]).pow(2).mean(0)
    return float(s.pow(2).mean() / s.mean().pow(2))


def max_attention_logit(qkv: torch.Tensor, n_head: int) -> float:
    """Largest causal attention logit ``q·k / sqrt(head_dim)`` from a fused projection output
    ``qkv`` [B, T, 3C] (q, k, v concatenated, ``n_head`` heads), as the lab GPT splits it."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, _ = qkv.detach().float().split(C, dim=2)
    q, k = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(C // n_head)
    future = torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(1)
    return float(att.masked_fill(future, -math.inf).max())


class OptionalSignals:
    """Forward hooks measuring the optional indicators of ``model``'s training forwards
    (forwards in eval mode, e.g. validation, are ignored), keyed as in `OPTIONAL_SIGNALS`:

    - ``kurtosis_block``: max `channel_kurtosis` over the inputs and outputs of the modules
      named ``blocks.N`` (the residual stream);
    - ``kurtosis_linear_in``: max `channel_kurtosis` over the inputs of every Linear layer (the
      operands FP8 scaling sees, after the lab's outlier injection);
    - ``attn_logit_max``: max `max_attention_logit` over the ``*.attn.qkv`` projections (the
      model's ``n_head`` read from its ``cfg``; attention modules need an ``n_head``);
    - ``log_z``: mean over tokens of logsumexp of the ``lm_head`` logits.

    `take` returns the values of the last training forward and clears them. `remove` detaches
    the hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._vals: dict[str, float] = {}
        self._handles: list[Any] = []
        for name, mod in model.named_modules():
            parts = name.split(".")
            if len(parts) == 2 and parts[0] == "blocks":
                self._handles.append(mod.register_forward_hook(self._block))
            if hasattr(mod, "in_features") and hasattr(mod, "weight"):
                self._handles.append(mod.register_forward_hook(self._linear))
            if name.endswith("attn.qkv"):
                parent = model.get_submodule(name.rsplit(".", 1)[0])
                self._handles.append(mod.register_forward_hook(self._qkv(parent.n_head)))
            if name == "lm_head":
                self._handles.append(mod.register_forward_hook(self._head))

    def _max(self, key: str, v: float) -> None:
        if math.isfinite(v):
            self._vals[key] = max(self._vals.get(key, -math.inf), v)
        else:  # a non-finite value wins: it is the loudest warning there is
            self._vals[key] = math.inf if math.isnan(v) else v

    def _block(self, mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if mod.training:
            with torch.no_grad():
                self._max("kurtosis_block", channel_kurtosis(args[0]))
                self._max("kurtosis_block", channel_kurtosis(out))

    def _linear(self, mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if mod.training:
            with torch.no_grad():
                self._max("kurtosis_linear_in", channel_kurtosis(args[0]))

    def _qkv(self, n_head: int) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            if mod.training:
                with torch.no_grad():
                    self._max("attn_logit_max", max_attention_logit(out, n_head))

        return hook

    def _head(self, mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if mod.training:
            with torch.no_grad():
                self._vals["log_z"] = float(out.detach().float().logsumexp(-1).mean())

    def take(self) -> dict[str, float]:
        out, self._vals = self._vals, {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class SignalRecorder:
    """A `train_run` callback collecting one record per step: the ``guard_signals`` event (run
    with a guard, e.g. ``AnomalyGuard(policy="off")``) merged with the `OptionalSignals` of
    that step's forward (when `recording` attached them). ``records`` is in step order; a
    step replayed after a rollback replaces the abandoned records from that step on."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.hooks: OptionalSignals | None = None

    def __call__(self, event: Mapping[str, Any]) -> None:
        if event.get("event") != "guard_signals":
            return
        rec = {k: v for k, v in event.items() if k not in ("event", "recipe")}
        if self.hooks is not None:
            rec.update(self.hooks.take())
        while self.records and self.records[-1]["step"] >= rec["step"]:
            self.records.pop()
        self.records.append(rec)


@contextlib.contextmanager
def recording(recorder: SignalRecorder) -> Iterator[SignalRecorder]:
    """Within the block, every model `fp8lab.lab.parts.build_model` builds gets `OptionalSignals`
    attached and handed to ``recorder`` (`train_run` builds its model internally; this is how a
    caller reaches it without a hook parameter). Not thread-safe: one run at a time."""
    from fp8lab.lab import parts

    orig = parts.build_model

    def build(*args: Any, **kw: Any) -> torch.nn.Module:
        model = orig(*args, **kw)
        if recorder.hooks is not None:
            recorder.hooks.remove()
        recorder.hooks = OptionalSignals(model)
        return model

    parts.build_model = build
    try:
        yield recorder
    finally:
        parts.build_model = orig
        if recorder.hooks is not None:
            recorder.hooks.remove()
