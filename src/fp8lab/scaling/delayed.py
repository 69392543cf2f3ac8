"""Delayed scaling with Transformer Engine's exact semantics (plus seed 003's interval and Nguard).

One `DelayedScaling` object holds the state of one per-tensor quantizer (TE's ``scale[i]`` and
column ``amax_history[:, i]``). Its life cycle within a training step ``t`` is TE's:

1. every quantize of the tensor uses the current ``scale`` (computed from amaxes up to step t-1)
   and max-combines the tensor's amax into the *staging slot* ``amax_history[0]``
   (TE ``atomicMaxFloat``: the slot is not zeroed first, a NaN amax is dropped) — `observe`;
2. once per step, after the last use (TE: autocast exit for forward tensors, end of backward for
   gradients), `update` runs TE's fused CUDA update (``delayed_scaling.cu::kernel_bulk``)::

       last = reduced_amax if (distributed and reduced_amax != 0) else H[0]
       if last != 0:                       # fused path: a quantizer that did not run doesn't roll
           amax_max = fmax(H[1..L-1], last)  # L values, NaN ignored (fmaxf)
           H = roll(H, -1); H[L-1] = last; H[0] = 0
       amax = last if algorithm == "most_recent" else amax_max   (amax_max = 0 if no roll)
       scale = fmt_max * 2**-(margin + nguard) / amax   if isfinite(amax) and amax > 0
               old scale                                 otherwise (0, inf, NaN)
       if isinf(scale): scale = FLT_MAX

   ``update_path="python"`` runs TE's unfused Python update instead (``_amax_and_scale_update``,
   used by TE for a callable algorithm or ``NVTE_UNFUSED_FP8_UPDATE=1``): it always rolls, its
   ``max`` is ``torch.max`` (NaN propagates, so a NaN in the window keeps the old scale until it
   rolls out) and it computes ``(fmt_max / amax) / 2**margin``. A callable ``algorithm(history)``
   always takes this path (the history passed is ``[L]`` float32 with this step's amax at index 0).

Step 0 quantizes with scale 1.0 (``first_step="unit"``, TE) or, as seed 003 does, with current
scaling ``fmt_max * 2**-(margin + nguard) / amax(x)`` (``first_step="current"``) until the first
update that produces a scale.

Extensions from seed 003 (HiFloat8 delayed scaling):

* ``interval``: the amax is measured only on steps ``t % interval == 0``; on the other steps the
  quantizer neither records nor updates (the scale of the last measured step is reused);
* ``nguard``: a power-of-two guard margin added to TE's ``margin`` (FP8 ~3, HiF8 8-12).

Scales are computed with a correctly rounded float32 division (``torch.div(fmt_max, amax)``), not a
reciprocal times ``fmt_max``. ``scale_inv = 1/scale`` (TE ``__frcp_rn``).

State (`state_dict`) is a plain dict of tensors: ``scale`` (float32 scalar), ``amax_history``
(float32 ``[L]``; index 0 is the staging slot, 1..L-1 the history from oldest to newest),
``step`` (int64), ``initialized`` (int64 0/1: whether an update has set the scale) and
``fmt_max`` (float32; 0 until a format has been seen). When ``torch.distributed`` is initialized
and ``reduce_amax`` is true, `update` all-reduces the staging amax with MAX over ``group`` first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8lab.formats import FloatFormat, get_format

FLT_MAX = torch.finfo(torch.float32).max
ALGORITHMS = ("max", "most_recent")
FIRST_STEPS = ("unit", "current")
UPDATE_PATHS = ("fused", "python")

__all__ = ["DelayedScaling"]


class DelayedScaling:
    """Stateful TE delayed scaling for one per-tensor quantizer (see the module doc)."""

    def __init__(
        self,
        history_len: int = 1024,
        algorithm: str | Callable[[torch.Tensor], torch.Tensor] = "max",
        margin: int = 0,
        interval: int = 1,
        first_step: str = "unit",
        nguard: int = 0,
        reduce_amax: bool = True,
        update_path: str = "fused",
        group: Any = None,
        fmt: str | FloatFormat | None = None,
    ) -> None:
        if int(history_len) < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if not callable(algorithm) and algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {ALGORITHMS} or a callable(history) -> amax, "
                f"got {algorithm!r}"
            )
        if int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if first_step not in FIRST_STEPS:
            raise ValueError(f"first_step must be one of {FIRST_STEPS}, got {first_step!r}")
        if update_path not in UPDATE_PATHS:
            raise ValueError(f"update_path must be one of {UPDATE_PATHS}, got {update_path!r}")
        self.history_len = int(history_len)
        self.algorithm = algorithm
        self.margin = int(margin)
        self.interval = int(interval)
        self.first_step = first_step
        self.nguard = int(nguard)
        self.reduce_amax = bool(reduce_amax)
        self.update_path = "python" if callable(algorithm) else update_path
        self.group = group
        self._state: dict[str, torch.Tensor] = {
            "scale": torch.ones((), dtype=torch.float32),
            "amax_history": torch.zeros(self.history_len, dtype=torch.float32),
            "step": torch.zeros((), dtype=torch.int64),
            "initialized": torch.zeros((), dtype=torch.int64),
            "fmt_max": torch.zeros((), dtype=torch.float32),
        }
        if fmt is not None:
            self.set_format(fmt)

    # ------------------------------------------------------------------ configuration
    def config(self) -> dict[str, Any]:
        """The constructor arguments as plain data (a callable algorithm cannot be serialised)."""
        if callable(self.algorithm):
            raise ValueError("a DelayedScaling with a callable algorithm cannot be serialised")
        return {
            "history_len": self.history_len,
            "algorithm": self.algorithm,
            "margin": self.margin,
            "interval": self.interval,
            "first_step": self.first_step,
            "nguard": self.nguard,
            "reduce_amax": self.reduce_amax,
            "update_path": self.update_path,
        }

    to_dict = config

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> DelayedScaling:
        known = {
            "history_len",
            "algorithm",
            "margin",
            "interval",
            "first_step",
            "nguard",
            "reduce_amax",
            "update_path",
        }
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown DelayedScaling keys: {sorted(unknown)}")
        return cls(**cfg)

    from_dict = from_config

    def fresh(self) -> DelayedScaling:
        """A new object with the same configuration and a zero state (one per tensor)."""
        return DelayedScaling(
            history_len=self.history_len,
            algorithm=self.algorithm,
            margin=self.margin,
            interval=self.interval,
            first_step=self.first_step,
            nguard=self.nguard,
            reduce_amax=self.reduce_amax,
            update_path=self.update_path,
            group=self.group,
        )

    @classmethod
    def bind(cls, scaling: DelayedScaling, fmt: str | FloatFormat) -> DelayedScaling:
        """A new stateful object with ``scaling``'s configuration, a zero state and ``fmt``'s
        maximum: what a module that quantizes one tensor owns (one per tensor)."""
        ds = scaling.fresh()
        ds.set_format(fmt)
        return ds

    def __repr__(self) -> str:
        algo = (
            getattr(self.algorithm, "__name__", "callable")
            if callable(self.algorithm)
            else (repr(self.algorithm))
        )
        return (
            f"DelayedScaling(history_len={self.history_len}, algorithm={algo}, "
            f"margin={self.margin}, interval={self.interval}, first_step={self.first_step!r}, "
            f"nguard={self.nguard}, step={self.step})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the state: plain tensors only (safe to save with ``torch.save``/safetensors)."""
        return {k: v.clone() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self._state) - set(state)
        if missing:
            raise KeyError(f"DelayedScaling state is missing {sorted(missing)}")
        hist = torch.as_tensor(state["amax_history"], dtype=torch.float32).reshape(-1)
        if hist.numel() != self.history_len:
            raise ValueError(
                f"amax_history has length {hist.numel()}, this object has {self.history_len}"
            )
        for k, v in self._state.items():
            v.copy_(torch.as_tensor(state[k]).reshape(v.shape).to(v.dtype))

    @property
    def scale(self) -> torch.Tensor:
        """Current quantization multiplier (float32 scalar)."""
        return self._state["scale"]

    @property
    def scale_inv(self) -> torch.Tensor:
        """Current dequantization multiplier ``1/scale`` (TE ``scale_inv``)."""
        return torch.reciprocal(self._state["scale"])

    @property
    def amax_history(self) -> torch.Tensor:
        return self._state["amax_history"]

    @property
    def step(self) -> int:
        return int(self._state["step"])

    @property
    def initialized(self) -> bool:
        return bool(self._state["initialized"])

    @property
    def measuring(self) -> bool:
        """Whether this step's amax is recorded (``step % interval == 0``)."""
        return self.step % self.interval == 0

    @property
    def total_margin(self) -> int:
        return self.margin + self.nguard

    def set_format(self, fmt: str | FloatFormat) -> None:
        self._state["fmt_max"].fill_(get_format(fmt).max)

    def _fmt_max(self, fmt: str | FloatFormat | None) -> float:
        if fmt is not None:
            self.set_format(fmt)
        m = float(self._state["fmt_max"])
        if m == 0.0:
            raise ValueError(
                "DelayedScaling does not know its format yet: quantize with it once, or pass "
                "fmt= to the constructor or to update()"
            )
        return m

    def _scaled_max(self, fmt_max: float) -> torch.Tensor:
        return torch.tensor(fmt_max * 2.0 ** (-self.total_margin), dtype=torch.float32)

    # ------------------------------------------------------------------ per quantize call
    def observe(self, amax: torch.Tensor | float) -> None:
        """Max-combine an amax into the staging slot (TE ``atomicMaxFloat``: NaN is dropped).

        Does nothing on steps that are not measured (``interval``).
        """
        if not self.measuring:
            return
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
        h0 = self._state["amax_history"][0:1]
        h0.copy_(torch.fmax(h0, a.reshape(1)))

    def stage(self, amax: torch.Tensor | float) -> None:
        """Overwrite the staging slot ``amax_history[0]`` (as a reduced amax does; NaN kept)."""
        self._state["amax_history"][0] = torch.as_tensor(amax, dtype=torch.float32)

    def scale_for(
        self, amax: torch.Tensor | None = None, fmt: str | FloatFormat | None = None
    ) -> torch.Tensor:
        """The quantization multiplier to use now (float32 scalar).

        ``first_step="current"`` before the first update that set a scale: current scaling from
        ``amax`` (the tensor's amax) with the same margin; amax 0/inf/NaN -> the stored scale.
        """
        if self.first_step == "current" and not self.initialized and amax is not None:
            fmax = self._fmt_max(fmt)
            a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
            s = torch.div(self._scaled_max(fmax), a)
            ok = torch.isfinite(a) & (a > 0)
            s = torch.where(ok, s, self._state["scale"])
            return torch.where(torch.isinf(s), torch.tensor(FLT_MAX), s)
        if fmt is not None:
            self.set_format(fmt)
        return self._state["scale"].clone()

    # ------------------------------------------------------------------ once per step
    def _reduced_last(self) -> torch.Tensor:
        h0 = self._state["amax_history"][0].clone()
        if not self.reduce_amax:
            return h0
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return h0
        red = h0.clone().reshape(1)
        dist.all_reduce(red, op=dist.ReduceOp.MAX, group=self.group)
        red = red.reshape(())
        return torch.where(red != 0, red, h0)

    def update(self, fmt: str | FloatFormat | None = None) -> torch.Tensor:
        """End of step: reduce, roll the history and compute the next scale (TE semantics).

        Returns the new scale. On steps that are not measured (``interval``) it only advances the
        step counter.
        """
        st = self._state
        if not self.measuring:
            st["step"] += 1
            return st["scale"].clone()
        fmax = self._fmt_max(fmt)
        last = self._reduced_last()
        hist = st["amax_history"]
        old = st["scale"].clone()
        if self.update_path == "fused":
            if bool(last != 0):
                window = torch.cat([hist[1:], last.reshape(1)])
                amax_max = torch.where(torch.isnan(window), 0.0, window).amax().clamp_min(0.0)
                hist[:-1] = window[:-1].clone()
                hist[-1] = last
                hist[0] = 0.0
            else:
                amax_max = torch.zeros((), dtype=torch.float32)
            amax = last if self.algorithm == "most_recent" else amax_max
            scale = torch.div(self._scaled_max(fmax), amax)
            ok = torch.isfinite(amax) & (amax > 0)
            scale = torch.where(ok, scale, old)
        else:
            hist[0] = last
            if callable(self.algorithm):
                amax = torch.as_tensor(self.algorithm(hist.clone()), dtype=torch.float32)
                amax = amax.reshape(())
            elif self.algorithm == "max":
                amax = torch.max(hist)  # NaN propagates, as in TE's Python path
            else:
                amax = hist[0].clone()
            if self.history_len > 1:
                hist.copy_(torch.roll(hist, -1, 0))
            hist[0] = 0.0
            fm = torch.tensor(fmax, dtype=torch.float32)
            scale = torch.div(fm, amax) / (2.0**self.total_margin)
            scale = torch.where(amax > 0.0, scale, old)
            scale = torch.where(torch.isfinite(amax), scale, old)
            ok = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(torch.isinf(scale), torch.tensor(FLT_MAX), scale)
        st["scale"].copy_(scale)
        if bool(ok):
            st["initialized"].fill_(1)
        st["step"] += 1
        return st["scale"].clone()
