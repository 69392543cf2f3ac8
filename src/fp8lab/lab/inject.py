"""Outlier and spike injection: make scaling failures visible on a small model in minutes.

Real outliers (SwiGLU weight alignment, massive activations) appear only after hundreds of
billions of tokens (Fishman et al. 2024), so the lab injects them:

- **activation outliers**: from ``outlier_from_step`` on, a few input channels of the selected
  Linear layers (default the SwiGLU output feeding ``mlp.down``, where Fishman's outliers live)
  are multiplied by ``outlier_scale`` inside the forward pass. Every recipe gets the same
  injection, so the baseline sees the same function; what differs is how each recipe's scaling
  copes: one per-tensor scale is set by the outlier channels and the other channels lose
  precision, while 1x128 tiles / MX blocks isolate them. ``outlier_weights`` says what the
  layer does with those channels: ``"train"`` (default) trains the weights that read them like
  any other, so the layer's output and its weight gradient are dominated by the outliers (and
  at large scales even bf16 training turns noisy: Adam moves those weights by about its step
  size, times ``outlier_scale`` in the output); ``"zero"`` holds those weights at zero (zeroed
  when the injector is installed, their gradient masked), so the channels carry range but no
  signal, like the massive activations that act as fixed biases or "no-op" features (Sun et
  al. 2024, arXiv 2402.17762; Bondarenko et al. 2023, arXiv 2306.12929): the model's function
  no longer depends on ``outlier_scale`` and only a quantizer that shares one scale with the
  outliers sees them.
- **gradient spike**: at step ``grad_spike_step`` the loss is multiplied by ``grad_spike_scale``
  (rounded to a power of two) before backward and the parameter gradients are divided by it
  again afterwards. In exact fp32 arithmetic the update is unchanged, but every quantized
  grad_output operand sees a one-step spike: current scaling absorbs it, while a delayed scale
  saturates at the spike and then keeps the spiked amax in its history, underflowing the normal
  gradients for up to ``amax_history_len`` steps (stale scales).
- **NaN loss**: at step ``nan_step`` the loss is multiplied by NaN before backward (the loss and
  every gradient become NaN), as a hardware fault or a bad batch would.

Both step faults are one-shot events: the loop records each one that fired in its state
(``LoopState.injected``, saved in checkpoints), so a step replayed after an anomaly guard's
rollback runs clean (:meth:`Injector.fire`).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: what a layer does with its outlier channels (InjectConfig.outlier_weights)
OUTLIER_WEIGHTS = ("train", "zero")


@dataclass(frozen=True)
class InjectConfig:
    """What to inject. The defaults inject nothing."""

    outlier_channels: int = 0  # number of input channels scaled up per selected layer (0 = off)
    outlier_scale: float = 100.0
    outlier_layers: str = "blocks.*.mlp.down"  # glob over module names of Linear layers
    outlier_from_step: int = 0
    outlier_weights: str = "train"  # "train" or "zero": the weights reading the outlier channels
    grad_spike_step: int = -1  # step index of the one-step gradient spike (-1 = off)
    grad_spike_scale: float = 1024.0
    nan_step: int = -1  # step index whose loss becomes NaN, once (-1 = off)

    def __post_init__(self) -> None:
        if not (isinstance(self.outlier_channels, int) and self.outlier_channels >= 0):
            raise ValueError(f"outlier_channels must be an int >= 0, got {self.outlier_channels!r}")
        for name in ("outlier_scale", "grad_spike_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")
        if not (isinstance(self.outlier_from_step, int) and self.outlier_from_step >= 0):
            raise ValueError(
                f"outlier_from_step must be an int >= 0, got {self.outlier_from_step!r}"
            )
        if self.outlier_weights not in OUTLIER_WEIGHTS:
            raise ValueError(
                f"outlier_weights must be one of {', '.join(OUTLIER_WEIGHTS)}, got "
                f"{self.outlier_weights!r}"
            )
        if not (isinstance(self.grad_spike_step, int) and self.grad_spike_step >= -1):
            raise ValueError(f"grad_spike_step must be an int >= -1, got {self.grad_spike_step!r}")
        if not (isinstance(self.nan_step, int) and self.nan_step >= -1):
            raise ValueError(f"nan_step must be an int >= -1, got {self.nan_step!r}")

    @property
    def active(self) -> bool:
        return self.outlier_channels > 0 or self.grad_spike_step >= 0 or self.nan_step >= 0

    @property
    def spike_multiplier(self) -> float:
        """``grad_spike_scale`` rounded to a power of two, so dividing it out again is exact."""
        return 2.0 ** round(math.log2(self.grad_spike_scale))


def outlier_channel_index(in_features: int, n: int, layer_name: str) -> torch.Tensor:
    """The ``n`` channels of one layer that get scaled: spread evenly, offset per layer name."""
    if n > in_features:
        raise ValueError(f"outlier_channels={n} exceeds the {in_features} inputs of {layer_name}")
    offset = sum(layer_name.encode()) % max(1, in_features // n)
    return (torch.arange(n) * (in_features // n) + offset) % in_features


def _zero_columns(mod: nn.Module, idx: torch.Tensor) -> torch.utils.hooks.RemovableHandle:
    """Zero the weights of ``mod`` that read input channels ``idx`` and mask their gradient, so
    they stay zero under any optimizer (AdamW's update of a zero moment is zero, weight decay
    keeps zero). Returns the gradient hook's handle."""
    w = mod.weight
    # fp8lab's Linear may keep a transformers Conv1D's [in, out] layout
    in_out = getattr(mod, "weight_layout", "out_in") == "in_out"
    keep = torch.ones(w.shape, dtype=w.dtype, device=w.device)
    if in_out:
        keep[idx, :] = 0
    else:
        keep[:, idx] = 0
    with torch.no_grad():
        w.mul_(keep)
    return w.register_hook(lambda g: g * keep)


class Injector:
    """Installs the injection of ``cfg`` on ``model``; call :meth:`set_step` before each forward."""

    def __init__(self, model: nn.Module, cfg: InjectConfig) -> None:
        self.cfg = cfg
        self._step = 0
        self._handles = []
        self.layers: dict[str, torch.Tensor] = {}
        if cfg.outlier_channels == 0:
            return
        for name, mod in model.named_modules():
            if not fnmatch.fnmatchcase(name, cfg.outlier_layers):
                continue
            in_features = getattr(mod, "in_features", None)
            if in_features is None:
                raise ValueError(f"outlier_layers matches {name!r}, which is not a Linear layer")
            gain = torch.ones(in_features, device=mod.weight.device)  # the layer's device
            idx = outlier_channel_index(in_features, cfg.outlier_channels, name)
            gain[idx] = cfg.outlier_scale
            self.layers[name] = gain
            self._handles.append(mod.register_forward_pre_hook(self._hook(gain)))
            if cfg.outlier_weights == "zero":
                self._handles.append(_zero_columns(mod, idx))
        if not self.layers:
            raise ValueError(f"outlier_layers={cfg.outlier_layers!r} matches no layer of the model")

    def _hook(self, gain: torch.Tensor):
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            if self._step < self.cfg.outlier_from_step:
                return None
            return (args[0] * gain, *args[1:])

        return hook

    def set_step(self, step: int) -> None:
        self._step = step

    def grad_multiplier(self, step: int) -> float:
        """Factor for the loss before backward at ``step`` (1.0 except at the spike step)."""
        return self.cfg.spike_multiplier if step == self.cfg.grad_spike_step else 1.0

    def fire(self, step: int, fired: list[str]) -> tuple[float, bool]:
        """The one-shot faults of ``step``: (loss multiplier for backward, NaN loss?). A fault
        already in ``fired`` (the loop state's record) does not fire again; one that fires now
        is appended to it (``"grad_spike@T"``, ``"nan@T"``)."""
        mult, nan = 1.0, False
        if step == self.cfg.grad_spike_step and f"grad_spike@{step}" not in fired:
            fired.append(f"grad_spike@{step}")
            mult = self.cfg.spike_multiplier
        if step == self.cfg.nan_step and f"nan@{step}" not in fired:
            fired.append(f"nan@{step}")
            nan = True
        return mult, nan

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class InjectionHook:
    """The one-shot step faults as `fp8lab.step.TrainStep` hooks: the gradient spike's
    loss multiplier (divided out of ``params``' gradients after backward) and the NaN loss.
    ``fired``: the loop state's record of faults that fired (`Injector.fire`)."""

    def __init__(self, injector: Injector, params: list[torch.Tensor], fired: list[str]) -> None:
        self.injector, self.params, self.fired = injector, params, fired
        self.nan = False

    def on_before_forward(self, ctx: Any) -> None:
        self.injector.set_step(ctx.step)
        ctx.loss_mult, self.nan = self.injector.fire(ctx.step, self.fired)

    def on_after_forward(self, ctx: Any) -> None:
        if self.nan:  # injected fault: the loss and every gradient become NaN
            ctx.loss = ctx.loss * float("nan")
            ctx.global_loss = float("nan")

    def on_after_backward(self, ctx: Any) -> None:
        if ctx.loss_mult != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(ctx.loss_mult)
