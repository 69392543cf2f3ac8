"""Delayed scaling with Transformer Engine's exact semantics (plus HiFloat8's interval and Nguard).

Configuration and state are apart. `DelayedScalingConfig` is frozen, hashable plain data (history
length, algorithm, margin, interval, first step, Nguard, amax reduction, update path): what a
recipe or a `QuantSpec` holds, shareable by any number of tensors. `DelayedScalingState` is the
state of one per-tensor quantizer (TE's ``scale[i]`` and column ``amax_history[:, i]``) as plain
tensors, plus the runtime process group of the amax reduction. `DelayedScaling` pairs one config
with one state: the object a quantizing module (or the user) owns, one per tensor
(`DelayedScaling.bind`). Its life cycle within a training step ``t`` is TE's:

1. every quantize of the tensor uses the current ``scale`` (computed from amaxes up to step t-1)
   and max-combines the tensor's amax into the *staging slot* ``amax_history[0]``
   (TE ``atomicMaxFloat``: the slot is not zeroed first, a NaN amax is dropped) -- `observe`;
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

   with one correctly rounded float32 division, as TE's CUDA kernel.

   ``update_path="python"`` runs TE's unfused Python update instead
   (``transformer_engine/pytorch/fp8.py`` / ``quantization.py``: ``_amax_and_scale_update`` and
   ``_default_sf_compute``, used by TE for a callable algorithm or ``NVTE_UNFUSED_FP8_UPDATE=1``):
   it always rolls, its ``max`` is ``torch.max`` (NaN propagates, so a NaN in the window keeps the
   old scale until it rolls out) and it computes ``(fp8_max / amax) / 2**margin`` with a Python
   float ``fp8_max``, which eager PyTorch evaluates as ``amax.reciprocal() * fp8_max``
   (``Tensor.__rdiv__``: two roundings, ~half of the scales 1 ulp off the quotient). A callable
   ``algorithm(history)`` always takes this path (the history passed is ``[L]`` float32 with this
   step's amax at index 0).

Step 0 quantizes with scale 1.0 (``first_step="unit"``, TE) or, as the HiFloat8 training recipe
does ("HiFloat8:高性能训练之路", GCC / Huawei, 2025-12-19; arXiv 2409.16626), with current scaling
``fmt_max * 2**-(margin + nguard) / amax(x)`` (``first_step="current"``) until the first update
that produces a scale. Quantizing under a configuration alone (no state) is exactly step 0.

Extensions from the same HiFloat8 recipe:

* ``interval``: the amax is measured only on steps ``t % interval == 0``; on the other steps the
  quantizer neither records nor updates (the scale of the last measured step is reused);
* ``nguard``: a power-of-two guard margin added to TE's ``margin`` (FP8 ~3, HiF8 8-12).

``scale_inv = 1/scale`` (TE ``__frcp_rn``).

State (`state_dict`) is a plain dict of tensors: ``scale`` (float32 scalar), ``amax_history``
(float32 ``[L]``; index 0 is the staging slot, 1..L-1 the history from oldest to newest),
``step`` (int64), ``initialized`` (int64 0/1: whether an update has set the scale) and
``fmt_max`` (float32; 0 until a format has been seen).

Amax reduction (``reduce_amax``): this layer never communicates. A state's runtime ``group`` may
hold a reducer (an object with ``defer_update(state, fmt)``, e.g. `fp8lab.distributed.amax.AmaxBatch`)
that takes `update` over and calls back ``update(fmt, reduced=...)`` with the reduced amax; else
the reducer installed from above with `set_amax_reduction` serves a measured step while its
``active()`` says a process group is up. `fp8lab.distributed.set_amax_reduction()` installs TE's
default, an all-reduce MAX over the state's process group, when called (explicitly: never on
import, so every import style behaves alike); without it amaxes stay local.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8lab._keys import check_keys
from fp8lab.formats import FloatFormat, get_format

FLT_MAX = torch.finfo(torch.float32).max
ALGORITHMS = ("max", "most_recent")
FIRST_STEPS = ("unit", "current")
UPDATE_PATHS = ("fused", "python")
STATE_KEYS = ("scale", "amax_history", "step", "initialized", "fmt_max")

__all__ = [
    "DelayedScaling",
    "DelayedScalingConfig",
    "DelayedScalingState",
    "amax_reduction_installed",
    "delayed_scale",
    "set_amax_reduction",
]


@dataclass(frozen=True)
class DelayedScalingConfig:
    """Frozen configuration of TE delayed scaling (see the module doc): plain data, hashable.

    A callable ``algorithm(history) -> amax`` forces ``update_path="python"`` and cannot be
    serialised (`to_dict` raises).
    """

    history_len: int = 1024
    algorithm: str | Callable[[torch.Tensor], torch.Tensor] = "max"
    margin: int = 0
    interval: int = 1
    first_step: str = "unit"
    nguard: int = 0
    reduce_amax: bool = True
    update_path: str = "fused"

    def __post_init__(self) -> None:
        for name in ("history_len", "margin", "interval", "nguard"):
            object.__setattr__(self, name, _as_int(getattr(self, name), name))
        if self.history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")
        if not callable(self.algorithm) and self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {ALGORITHMS} or a callable(history) -> amax, "
                f"got {self.algorithm!r}"
            )
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.first_step not in FIRST_STEPS:
            raise ValueError(f"first_step must be one of {FIRST_STEPS}, got {self.first_step!r}")
        if self.update_path not in UPDATE_PATHS:
            raise ValueError(f"update_path must be one of {UPDATE_PATHS}, got {self.update_path!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"reduce_amax must be a bool, got {self.reduce_amax!r}")
        if callable(self.algorithm):
            object.__setattr__(self, "update_path", "python")

    @property
    def total_margin(self) -> int:
        """``margin + nguard``: the power-of-two headroom of the scale."""
        return self.margin + self.nguard

    def replace(self, **changes: Any) -> DelayedScalingConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (a callable algorithm cannot be serialised: ValueError)."""
        if callable(self.algorithm):
            raise ValueError("a DelayedScaling with a callable algorithm cannot be serialised")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DelayedScalingConfig:
        """Inverse of `to_dict`; unknown keys raise naming them."""
        check_keys(d, (f.name for f in dataclasses.fields(cls)), "DelayedScaling")
        return cls(**d)

    def __repr__(self) -> str:
        algo = (
            getattr(self.algorithm, "__name__", "callable")
            if callable(self.algorithm)
            else repr(self.algorithm)
        )
        return (
            f"DelayedScalingConfig(history_len={self.history_len}, algorithm={algo}, "
            f"margin={self.margin}, interval={self.interval}, first_step={self.first_step!r}, "
            f"nguard={self.nguard})"
        )


@dataclass(eq=False)
class DelayedScalingState:
    """The state of one per-tensor quantizer: plain tensors (`STATE_KEYS`) and the runtime
    process ``group`` of the amax all-reduce (None: the default group; never saved)."""

    scale: torch.Tensor
    amax_history: torch.Tensor
    step: torch.Tensor
    initialized: torch.Tensor
    fmt_max: torch.Tensor
    group: Any = None

    @classmethod
    def zeros(
        cls, history_len: int, group: Any = None, device: torch.device | str = "cpu"
    ) -> DelayedScalingState:
        """Step 0 on ``device``: scale 1, an all-zero history, no format known yet."""
        return cls(
            scale=torch.ones((), dtype=torch.float32, device=device),
            amax_history=torch.zeros(int(history_len), dtype=torch.float32, device=device),
            step=torch.zeros((), dtype=torch.int64, device=device),
            initialized=torch.zeros((), dtype=torch.int64, device=device),
            fmt_max=torch.zeros((), dtype=torch.float32, device=device),
            group=group,
        )

    @property
    def device(self) -> torch.device:
        """Where the tensors live (all on one device)."""
        return self.scale.device

    def to(self, device: torch.device | str) -> DelayedScalingState:
        """Move the tensors to ``device`` in place (no-op when they are there; dtypes kept);
        returns ``self``. From the ``meta`` device the tensors are allocated uninitialised (as a
        module's ``to_empty``): load a state afterwards."""
        device = torch.device(device)
        if self.scale.device == device:
            return self
        for name, t in self.tensors().items():
            new = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
            setattr(self, name, new)
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors by `STATE_KEYS` name (not copies)."""
        return {k: getattr(self, k) for k in STATE_KEYS}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the tensors (safe to save with ``torch.save``/safetensors)."""
        return {k: v.clone() for k, v in self.tensors().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy ``state`` in place (every `STATE_KEYS` entry; the history length must match)."""
        missing = set(STATE_KEYS) - set(state)
        if missing:
            raise KeyError(f"DelayedScaling state is missing {sorted(missing)}")
        hist = torch.as_tensor(state["amax_history"], dtype=torch.float32).reshape(-1)
        if hist.numel() != self.amax_history.numel():
            raise ValueError(
                f"amax_history has length {hist.numel()}, this object has "
                f"{self.amax_history.numel()}"
            )
        for k, v in self.tensors().items():
            v.copy_(torch.as_tensor(state[k]).reshape(v.shape).to(v.dtype))


def _as_int(v: Any, name: str) -> int:
    """``v`` as an int: ints and integral floats pass, anything else (bool, str) raises."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r}")
    return int(v)


def _config_field(name: str) -> property:
    return property(lambda self: getattr(self.cfg, name), doc=f"``cfg.{name}`` (read-only)")


class DelayedScaling:
    """Stateful TE delayed scaling for one per-tensor quantizer: a frozen `DelayedScalingConfig`
    (``cfg``) and its own `DelayedScalingState` (``state``). See the module doc.

    ``DelayedScaling(history_len=..., ...)`` takes the config's fields; ``group`` (the amax
    all-reduce's process group) and ``fmt`` (the format whose max the scale targets) are state.
    """

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
        cfg = DelayedScalingConfig(
            history_len=history_len,
            algorithm=algorithm,
            margin=margin,
            interval=interval,
            first_step=first_step,
            nguard=nguard,
            reduce_amax=bool(reduce_amax),
            update_path=update_path,
        )
        self._init(cfg, group, fmt)

    def _init(
        self,
        cfg: DelayedScalingConfig,
        group: Any,
        fmt: str | FloatFormat | None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.state = DelayedScalingState.zeros(cfg.history_len, group, device)
        if fmt is not None:
            self.set_format(fmt)

    history_len = _config_field("history_len")
    algorithm = _config_field("algorithm")
    margin = _config_field("margin")
    interval = _config_field("interval")
    first_step = _config_field("first_step")
    nguard = _config_field("nguard")
    reduce_amax = _config_field("reduce_amax")
    update_path = _config_field("update_path")

    # ------------------------------------------------------------------ configuration
    @classmethod
    def bind(
        cls,
        scaling: DelayedScalingConfig | DelayedScaling,
        fmt: str | FloatFormat | None = None,
        group: Any = None,
        device: torch.device | str = "cpu",
    ) -> DelayedScaling:
        """A new stateful object with ``scaling``'s configuration (a config, or a
        `DelayedScaling` whose state is not copied), a zero state on ``device`` and ``fmt``'s
        maximum: what a module that quantizes one tensor owns (one per tensor). ``group``
        defaults to the source object's group."""
        if isinstance(scaling, DelayedScaling):
            cfg, group = scaling.cfg, scaling.group if group is None else group
        elif isinstance(scaling, DelayedScalingConfig):
            cfg = scaling
        else:
            raise TypeError(
                "bind expects a DelayedScalingConfig or a DelayedScaling, "
                f"got {type(scaling).__name__}"
            )
        ds = cls.__new__(cls)
        ds._init(cfg, group, fmt, device)
        return ds

    def fresh(self) -> DelayedScaling:
        """Deprecated alias of ``DelayedScaling.bind(self)``: the same configuration and group,
        a zero state (no format set)."""
        warnings.warn(
            "DelayedScaling.fresh() is deprecated: use DelayedScaling.bind(ds, fmt)",
            DeprecationWarning,
            stacklevel=2,
        )
        return DelayedScaling.bind(self)

    def config(self) -> dict[str, Any]:
        """The configuration as plain data (`DelayedScalingConfig.to_dict`)."""
        return self.cfg.to_dict()

    to_dict = config

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DelayedScalingConfig) -> DelayedScaling:
        """A zero-state object from plain data (`config`) or a `DelayedScalingConfig`."""
        if not isinstance(cfg, DelayedScalingConfig):
            cfg = DelayedScalingConfig.from_dict(cfg)
        return cls.bind(cfg)

    from_dict = from_config

    @property
    def group(self) -> Any:
        """The process group of the amax all-reduce (runtime state; None = default group)."""
        return self.state.group

    @group.setter
    def group(self, group: Any) -> None:
        self.state.group = group

    def __repr__(self) -> str:
        return repr(self.cfg).replace("DelayedScalingConfig(", "DelayedScaling(", 1)[:-1] + (
            f", step={self.step})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the state: plain tensors only (safe to save with ``torch.save``/safetensors)."""
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a `state_dict` in place (from any device: the tensors stay where they are)."""
        self.state.load_state_dict(state)

    @property
    def device(self) -> torch.device:
        """The device of the state's tensors (the device of the tensor it observes)."""
        return self.state.device

    def to(self, device: torch.device | str) -> DelayedScaling:
        """Move the state to ``device`` in place (no-op when it is there); returns ``self``.
        A `fp8lab.qtensor.Quantizer` does this when it quantizes a tensor on another device."""
        self.state.to(device)
        return self

    @property
    def scale(self) -> torch.Tensor:
        """Current quantization multiplier (float32 scalar)."""
        return self.state.scale

    @property
    def scale_inv(self) -> torch.Tensor:
        """Current dequantization multiplier ``1/scale`` (TE ``scale_inv``)."""
        return torch.reciprocal(self.state.scale)

    @property
    def amax_history(self) -> torch.Tensor:
        return self.state.amax_history

    @property
    def step(self) -> int:
        return int(self.state.step)

    @property
    def initialized(self) -> bool:
        return bool(self.state.initialized)

    @property
    def measuring(self) -> bool:
        """Whether this step's amax is recorded (``step % interval == 0``)."""
        # interval 1 (TE) measures every step: no read of the step counter, which on a GPU
        # would be a host sync in every quantize
        return self.cfg.interval == 1 or self.step % self.cfg.interval == 0

    @property
    def total_margin(self) -> int:
        return self.cfg.total_margin

    def set_format(self, fmt: str | FloatFormat) -> None:
        self.state.fmt_max.fill_(get_format(fmt).max)

    def _fmt_max(self, fmt: str | FloatFormat | None) -> float:
        if fmt is not None:
            self.set_format(fmt)
        m = float(self.state.fmt_max)
        if m == 0.0:
            raise ValueError(
                "DelayedScaling does not know its format yet: quantize with it once, or pass "
                "fmt= to the constructor or to update()"
            )
        return m

    def _scaled_max(self, fmt_max: float) -> torch.Tensor:
        return self._const(fmt_max * 2.0 ** (-self.total_margin))

    def _const(self, v: float) -> torch.Tensor:
        """A float32 scalar on the state's device."""
        return torch.tensor(v, dtype=torch.float32, device=self.state.device)

    def _as_state(self, v: torch.Tensor | float) -> torch.Tensor:
        """``v`` as a float32 scalar on the state's device."""
        return torch.as_tensor(v, dtype=torch.float32, device=self.state.device).reshape(())

    # ------------------------------------------------------------------ per quantize call
    def observe(self, amax: torch.Tensor | float) -> None:
        """Max-combine an amax into the staging slot (TE ``atomicMaxFloat``: NaN is dropped).

        Does nothing on steps that are not measured (``interval``).
        """
        if not self.measuring:
            return
        a = self._as_state(amax)
        h0 = self.state.amax_history[0:1]
        h0.copy_(torch.fmax(h0, a.reshape(1)))

    def stage(self, amax: torch.Tensor | float) -> None:
        """Overwrite the staging slot ``amax_history[0]`` (as a reduced amax does; NaN kept)."""
        self.state.amax_history[0] = self._as_state(amax)

    def scale_for(
        self, amax: torch.Tensor | None = None, fmt: str | FloatFormat | None = None
    ) -> torch.Tensor:
        """The quantization multiplier to use now (float32 scalar).

        ``first_step="current"`` before the first update that set a scale: current scaling from
        ``amax`` (the tensor's amax) with the same margin; amax 0/inf/NaN -> the stored scale.
        """
        if self.cfg.first_step == "current" and not self.initialized and amax is not None:
            fmax = self._fmt_max(fmt)
            a = self._as_state(amax)
            s = torch.div(self._scaled_max(fmax), a)
            ok = torch.isfinite(a) & (a > 0)
            s = torch.where(ok, s, self.state.scale)
            return torch.where(torch.isinf(s), self._const(FLT_MAX), s)
        if fmt is not None:
            self.set_format(fmt)
        return self.state.scale.clone()

    # ------------------------------------------------------------------ once per step
    def _reduced_last(self, reduced: torch.Tensor | None = None) -> torch.Tensor:
        h0 = self.state.amax_history[0].clone()
        if not self.cfg.reduce_amax or reduced is None:
            return h0
        # reduced by a reducer (module doc); TE keeps the local amax where the reduction gave 0
        red = self._as_state(reduced)
        return torch.where(red != 0, red, h0)

    def _fused_update(self, last: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
        """TE ``kernel_bulk``: (new scale candidate, amax ok?) with the history rolled in place."""
        hist = self.state.amax_history
        if bool(last != 0):
            window = torch.cat([hist[1:], last.reshape(1)])
            amax_max = torch.where(torch.isnan(window), 0.0, window).amax().clamp_min(0.0)
            hist[:-1] = window[:-1].clone()
            hist[-1] = last
            hist[0] = 0.0
        else:
            amax_max = self._const(0.0)
        amax = last if self.cfg.algorithm == "most_recent" else amax_max
        ok = torch.isfinite(amax) & (amax > 0)
        return torch.where(ok, torch.div(self._scaled_max(fmax), amax), self.state.scale), ok

    def _python_update(self, last: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
        """TE's unfused ``_amax_and_scale_update`` + ``_default_sf_compute`` (module doc)."""
        hist = self.state.amax_history
        hist[0] = last
        algo = self.cfg.algorithm
        if callable(algo):
            amax = self._as_state(algo(hist.clone()))
        elif algo == "max":
            amax = torch.max(hist)  # NaN propagates, as in TE's Python path
        else:
            amax = hist[0].clone()
        if self.cfg.history_len > 1:
            hist.copy_(torch.roll(hist, -1, 0))
        hist[0] = 0.0
        # `fp8_max / amax` with a Python float numerator is Tensor.__rdiv__ in eager PyTorch:
        # amax.reciprocal() * fp8_max, two roundings (not one correctly rounded division)
        scale = (amax.reciprocal() * fmax) / (2.0**self.total_margin)
        ok = torch.isfinite(amax) & (amax > 0)
        return torch.where(ok, scale, self.state.scale), ok

    def update(
        self, fmt: str | FloatFormat | None = None, *, reduced: torch.Tensor | None = None
    ) -> torch.Tensor:
        """End of step: reduce, roll the history and compute the next scale (TE semantics).

        Returns the new scale. On steps that are not measured (``interval``) it only advances the
        step counter. ``reduced``: the staged amax already all-reduced by the caller (no
        collective here). Otherwise a reducer may take the call over (module doc): a batched one
        (`fp8lab.distributed.amax.AmaxBatch`) reduces every deferred state's amax in one all-reduce
        later and calls ``update(fmt, reduced=...)`` for each; until then the old scale is
        returned.
        """
        st = self.state
        if reduced is None:
            if hasattr(st.group, "defer_update"):
                st.group.defer_update(self, fmt)
                return st.scale.clone()
            red = _REDUCTION.reducer
            # active() first: torch's own check, no further fp8lab call when no group is up
            if red is not None and _REDUCTION.active() and self.cfg.reduce_amax and self.measuring:
                red.defer_update(self, fmt)
                return st.scale.clone()
        if not self.measuring:
            st.step += 1
            return st.scale.clone()
        fmax = self._fmt_max(fmt)
        last = self._reduced_last(reduced)
        if self.cfg.update_path == "fused":
            scale, ok = self._fused_update(last, fmax)
        else:
            scale, ok = self._python_update(last, fmax)
        scale = torch.where(torch.isinf(scale), self._const(FLT_MAX), scale)
        st.scale.copy_(scale)
        if bool(ok):
            st.initialized.fill_(1)
        st.step += 1
        return st.scale.clone()


class _Reduction:
    """The amax reducer installed from above (`set_amax_reduction`), and when it applies."""

    reducer: Any = None
    active: Callable[[], bool] = staticmethod(lambda: False)


_REDUCTION = _Reduction()


def set_amax_reduction(reducer: Any, active: Callable[[], bool]) -> None:
    """Install the amax reduction of delayed-scaling updates whose state has no reducer of its
    own: ``reducer.defer_update(state, fmt)`` serves a measured update of a ``reduce_amax``
    state while ``active()`` is true (e.g. while a process group is up). Called by
    `fp8lab.distributed.set_amax_reduction`; ``reducer=None`` keeps every amax local."""
    _REDUCTION.reducer = reducer
    _REDUCTION.active = active  # type: ignore[method-assign]


def amax_reduction_installed() -> bool:
    """Whether an amax reducer is installed (`set_amax_reduction`)."""
    return _REDUCTION.reducer is not None


def delayed_scale(
    scaling: DelayedScalingConfig | DelayedScaling, amax: torch.Tensor, fmt: str | FloatFormat
) -> torch.Tensor:
    """The multiplier for one quantize of a tensor whose amax is ``amax`` (float32 scalar).

    A `DelayedScaling` gives its current scale and records ``amax`` (`observe`); a config alone
    gives step 0's scale from a throwaway state (1.0, or current scaling with
    ``first_step="current"``) and records nothing anywhere.
    """
    if isinstance(scaling, DelayedScaling):
        ds = scaling
    else:
        ds = DelayedScaling.bind(scaling, device=amax.device)
    s = ds.scale_for(amax, fmt)
    ds.observe(amax)
    return s
