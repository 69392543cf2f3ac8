"""One training step with public hooks: `TrainStep`.

``TrainStep(loss_fn, optimizer, scaler, clip, hooks)`` runs forward, loss scaling, backward,
unscale, clipping, the optimizer step, the scaler update and ``zero_grad`` on one batch, the
arithmetic of the lab's loop (`fp8lab.lab.train.train_run` runs its steps through it, so a
hook-free step is bit-identical to the lab's). It takes no lab configuration: a loss function,
an optimizer, an optional `fp8lab.optim.LossScaler` and a clip value, so a user's own loop (or
the debugger's replay on a model copy) can run it.

Hooks are objects with any subset of these methods, called in list order with the step's
`StepContext` (like Lightning callbacks):

- ``before_forward(ctx)``: before the forward pass (may replace ``ctx.batch``, e.g. a rank's
  shard, or set ``ctx.loss_mult``, a factor on the loss for backward divided out of the
  gradients again by whoever set it);
- ``after_forward(ctx)``: ``ctx.loss`` is set (may replace it, e.g. a fault injection);
- ``after_backward(ctx)``: the gradients exist, still scaled by the loss scale;
- ``before_optimizer_step(ctx)``: unscaled and clipped, ``ctx.grad_norm`` and
  ``ctx.found_inf`` set; returning ``False`` vetoes the update (the anomaly guard's "block"),
  every hook is called either way;
- ``after_optimizer_step(ctx)``: the update was applied or not (``ctx.skipped``), the scaler
  updated; the gradients still exist (``zero_grad`` follows);
- ``on_checkpoint(ctx, state)``: `TrainStep.checkpoint` asks each hook for what it adds to a
  checkpoint (``state``: the dict being saved, updated in place).

Devices: the first step checks that the batch's tensors are on the parameters' device
(`check_devices`; once per TrainStep, not per step) and raises ValueError naming both devices.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HOOKS", "ScopedHook", "StepContext", "TrainStep", "WatchHook", "check_devices"]

#: the hook methods a TrainStep calls, in the order of a step (``on_checkpoint`` on demand)
HOOKS = (
    "before_forward",
    "after_forward",
    "after_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "on_checkpoint",
    "on_error",
)

#: what a loss function returns: the loss tensor to backpropagate, or (that tensor, the loss to
#: report), e.g. a data-parallel rank's local loss and the global batch's
LossFn = Callable[[Any], "torch.Tensor | tuple[torch.Tensor, float]"]


@dataclass
class StepContext:
    """What a hook sees of one step. ``step``: the 0-based step index; ``batch``: the batch the
    loss function receives; ``loss``: the loss tensor backpropagated (after ``after_forward``);
    ``global_loss``: the loss to report when it is not ``loss`` (data parallel); ``loss_scale``:
    the scaler's scale of this step (1.0 without one); ``loss_mult``: an extra factor on the loss
    for backward; ``grad_norm``: the global gradient norm before clipping (NaN when the
    gradients are not finite); ``found_inf``: the scaler found non-finite gradients;
    ``vetoed``: a hook vetoed the update; ``skipped``: the update was not applied;
    ``time_s``: the step's wall time; ``extra``: scratch space for hooks."""

    step: int
    batch: Any
    loss: torch.Tensor | None = None
    global_loss: float | None = None
    loss_scale: float = 1.0
    loss_mult: float = 1.0
    grad_norm: float = float("nan")
    found_inf: bool = False
    vetoed: bool = False
    skipped: bool = True
    time_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_value(self) -> float:
        """The loss as a float: ``global_loss`` when set, else ``loss``."""
        if self.global_loss is not None:
            return self.global_loss
        return float("nan") if self.loss is None else float(self.loss.detach())


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch: a tensor, or tuples, lists and dicts of them (other values
    ignored)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return [t for item in batch for t in _batch_tensors(item)]
    return []


def check_devices(params: Sequence[torch.Tensor], batch: Any, what: str = "TrainStep") -> None:
    """ValueError when a tensor of ``batch`` is not on the device of ``params`` (checked only
    when every parameter is on one device: a model split over devices moves its own inputs).

    The message names both devices, e.g. ``TrainStep: the model is on cuda:0 but the batch is
    on cpu; ...``."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        return
    (model,) = devices
    for t in _batch_tensors(batch):
        if t.device != model:
            raise ValueError(
                f"{what}: the model is on {model} but the batch is on {t.device}; move the "
                "batch (or the model) to one device (fp8lab's commands: --torch-device)"
            )


class TrainStep:
    """One training step (see the module doc for the hooks).

    ``loss_fn(batch)``: runs the model, returns the loss (or ``(loss, reported_loss)``);
    ``optimizer``: None runs no update (gradients are kept: ``zero_grad`` is skipped too, for a
    replay that reads them); ``scaler``: an `fp8lab.optim.LossScaler` or None; ``clip``: the
    max global gradient norm (0 = off); ``params``: the parameters clipped and measured (default
    the optimizer's)."""

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: Any = None,
        scaler: Any = None,
        clip: float = 0.0,
        hooks: Sequence[Any] = (),
        params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if params is None:
            if optimizer is None:
                raise ValueError("TrainStep without an optimizer needs params")
            params = [p for g in optimizer.param_groups for p in g["params"]]
        self.loss_fn, self.optimizer, self.scaler = loss_fn, optimizer, scaler
        self.clip = float(clip)
        self.params = list(params)
        self.hooks = list(hooks)
        self._devices_checked = False  # check_devices on the first batch only

    def _call(self, name: str, ctx: StepContext) -> bool:
        """Call hook method ``name`` on every hook that has it; False when one returned False."""
        ok = True
        for h in self.hooks:
            fn = getattr(h, name, None)
            if fn is not None and fn(ctx) is False:
                ok = False
        return ok

    def __call__(self, step: int, batch: Any) -> StepContext:
        """Run step ``step`` on ``batch``; return its context."""
        if not self._devices_checked:
            check_devices(self.params, batch)
            self._devices_checked = True
        t0 = time.perf_counter()
        scaler = self.scaler
        ctx = StepContext(step, batch, loss_scale=scaler.get_scale() if scaler is not None else 1.0)
        try:
            self._run(ctx)
        except BaseException:
            self._call("on_error", ctx)  # hooks close what they opened (operand collectors)
            raise
        ctx.time_s = time.perf_counter() - t0
        return ctx

    def _run(self, ctx: StepContext) -> None:
        scaler = self.scaler
        self._call("before_forward", ctx)
        out = self.loss_fn(ctx.batch)
        ctx.loss, ctx.global_loss = out if isinstance(out, tuple) else (out, None)
        self._call("after_forward", ctx)
        (ctx.loss * (ctx.loss_scale * ctx.loss_mult)).backward()
        self._call("after_backward", ctx)
        self._unscale_and_clip(ctx)
        ctx.vetoed = not self._call("before_optimizer_step", ctx)
        if self.optimizer is not None:
            if not ctx.found_inf and math.isfinite(ctx.grad_norm) and not ctx.vetoed:
                self.optimizer.step()
                ctx.skipped = bool(getattr(self.optimizer, "last_step_skipped", False))
            if scaler is not None:
                scaler.update()
        self._call("after_optimizer_step", ctx)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _unscale_and_clip(self, ctx: StepContext) -> None:
        """Unscale the gradients (the scaler's found_inf), then the norm and clipping."""
        from fp8lab.optim import unscale_and_clip

        # without an optimizer (a replay) the scaler unscales the step's parameters; it is not
        # updated either, so such a step needs a fresh scaler (or one loaded from a state)
        target = self.optimizer if self.optimizer is not None else self.params
        ctx.found_inf, ctx.grad_norm = unscale_and_clip(self.scaler, target, self.params, self.clip)

    def checkpoint(self, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """Let every hook add to the checkpoint ``state`` (``on_checkpoint(ctx, state)``)."""
        ctx = StepContext(step, None)
        for h in self.hooks:
            fn = getattr(h, "on_checkpoint", None)
            if fn is not None:
                fn(ctx, state)
        return state


class ScopedHook:
    """Base of hooks that hold a context manager (an operand collector) open over the forward
    and backward: `enter` it in ``before_forward``; it closes after backward, or on an error."""

    _stack: contextlib.ExitStack | None = None

    def enter(self, cm: Any) -> Any:
        """Enter ``cm`` until the end of this step's backward; return what it yields."""
        self._stack = contextlib.ExitStack()
        return self._stack.enter_context(cm)

    def after_backward(self, ctx: StepContext) -> None:
        self.on_error(ctx)

    def on_error(self, ctx: StepContext) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


class WatchHook(ScopedHook):
    """`fp8lab.observe.sample` as a hook: every ``every`` steps (0 = never) the operand
    statistics of the step's forward and backward go to ``rows`` (``step``: steps done)."""

    def __init__(self, model: torch.nn.Module, every: int) -> None:
        self.model, self.every = model, every
        self.rows: list[dict[str, Any]] = []

    def before_forward(self, ctx: StepContext) -> None:
        self.rows = []
        if self.every > 0 and (ctx.step + 1) % self.every == 0:
            self.rows = self.enter(sample_rows(self.model, True, ctx.step + 1))


def sample_rows(model: torch.nn.Module, enabled: bool, step: int) -> Any:
    """``fp8lab.observe.sample``: the rows of this step's operands (the watch records), or []."""
    if not enabled:
        return contextlib.nullcontext([])
    from fp8lab.observe import sample

    return sample(model, step)
