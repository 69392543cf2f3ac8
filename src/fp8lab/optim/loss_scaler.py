"""Static and dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", arXiv
1710.03740; the overflow-skip loop as described in "混合精度训练:FP16、BF16、FP8深度对比";
Megatron-style hysteresis)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class LossScaler:
    """Multiply the loss by ``S`` before backward, divide gradients by ``S`` before the step.

    Dynamic scaling (default): start at ``init_scale`` (2^16); after an overflow (a NaN/inf
    gradient) the step is skipped and counted, and -- once ``hysteresis`` overflows have been seen
    since the last growth -- the scale is multiplied by ``backoff_factor`` (0.5); after
    ``growth_interval`` (2000) consecutive good steps it is multiplied by ``growth_factor`` (2).
    Static scaling (``dynamic=False``) keeps ``S`` fixed but still skips and counts overflowing
    steps. The API mirrors ``torch.amp.GradScaler``::

        scaler = LossScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)          # optional, e.g. before clipping
        scaler.step(opt)              # skipped when a grad is not finite
        scaler.update()

    Attributes: ``skipped_steps`` (overflows so far), ``steps`` (calls to ``update``),
    ``found_inf`` (last check).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        dynamic: bool = True,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be finite and > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        if not 0 < min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"need 0 < min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, "
                f"{max_scale}"
            )
        self.dynamic = dynamic
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis
        self._unscaled: set[int] = set()
        self.found_inf = False
        self.skipped_steps = 0
        self.steps = 0

    @classmethod
    def from_recipe(cls, recipe: Any, **kwargs: Any) -> LossScaler | None:
        """The recipe's loss scaler: ``loss_scaling`` "static"/"dynamic" starting at
        ``loss_scale``, or None for ``"none"`` and for no recipe (``recipe=None``). ``recipe`` is
        a `fp8lab.Recipe` or a preset name; ``kwargs`` go to the constructor (growth
        interval, hysteresis, ...). The one place a recipe becomes a loss scaler."""
        from fp8lab.recipe import get_recipe

        if recipe is None:
            return None
        rec = get_recipe(recipe)
        if rec.loss_scaling == "none":
            return None
        return cls(rec.loss_scale, dynamic=rec.loss_scaling == "dynamic", **kwargs)

    # ------------------------------------------------------------------ public API
    def get_scale(self) -> float:
        """Current loss scale ``S``."""
        return self._scale

    @property
    def loss_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (the tensor to call ``backward()`` on)."""
        return loss * self._scale

    def unscale_(self, optimizer_or_params: Any) -> bool:
        """Divide gradients by ``S`` in place (once per step); return True if any is non-finite."""
        key = id(optimizer_or_params)
        if key in self._unscaled:
            raise RuntimeError("unscale_() was already called for this optimizer since update()")
        grads = _grads(optimizer_or_params)
        found = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not found:
            inv = 1.0 / self._scale
            for g in grads:
                g.mul_(inv)
        self.found_inf = self.found_inf or found
        self._unscaled.add(key)
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale (if not done yet), then ``optimizer.step()`` unless a gradient overflowed.

        Returns True if the optimizer stepped. Skipped steps are counted at :meth:`update`.
        """
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """Adjust ``S`` after the step (dynamic mode) and reset the per-step bookkeeping."""
        self.steps += 1
        if self.found_inf:
            self.skipped_steps += 1
            if self.dynamic:
                self._growth_tracker = 0
                self._hysteresis_tracker -= 1
                if self._hysteresis_tracker <= 0:
                    self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                    self._hysteresis_tracker = self.hysteresis
        elif self.dynamic:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
        self.found_inf = False
        self._unscaled.clear()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            **{k: getattr(self, k) for k in _CONFIG},
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "skipped_steps": self.skipped_steps,
            "steps": self.steps,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(sd)
        if missing:
            raise ValueError(f"LossScaler state is missing {sorted(missing)}")
        self._scale = float(sd["scale"])
        for k in _CONFIG:
            if k in sd:
                setattr(self, k, sd[k])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.steps = int(sd.get("steps", 0))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self._scale:g}, skipped={self.skipped_steps})"


#: the scaler's configuration in its state_dict (restored when present)
_CONFIG = ("dynamic", "growth_factor", "backoff_factor", "growth_interval", "hysteresis")


def _grads(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.optim.Optimizer):
        params: Iterable = (p for g in obj.param_groups for p in g["params"])
    elif isinstance(obj, torch.Tensor):
        params = [obj]
    else:
        params = obj
    return [p.grad for p in params if p.grad is not None]
