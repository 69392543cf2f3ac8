"""One training step with public hooks: `TrainStep`, for every loop that fp8lab runs or joins.

``TrainStep(loss_fn, optimizer, scaler, clip, hooks)`` runs forward, loss scaling, backward,
unscale, clipping, the optimizer step, the scaler update and ``zero_grad`` on one batch. It
takes no lab configuration: a loss function, an optimizer, an optional
`fp8lab.optim.LossScaler` (or ``torch.amp.GradScaler``) and a clip value. One definition for
every loop: the lab's (`fp8lab.lab.loop` runs its steps through it, so a hook-free step is
bit-identical to the lab's), the debugger's replay on a model copy, a user's own loop under the
anomaly guard (`fp8lab.guard.GuardedStep`: ``backward=False``, the user's closure runs forward
and backward) and the framework callbacks (`fp8lab.integrations`: the framework runs the
arithmetic, the callback calls the same hooks through `Hooks` with a `StepContext`).

Hooks are objects with any subset of these methods (`HOOKS`), called in list order with the
step's `StepContext` (named as Lightning names its callback methods):

- ``on_before_forward(ctx)``: before the forward pass (may replace ``ctx.batch``, e.g. a rank's
  shard, or set ``ctx.loss_mult``, a factor on the loss for backward divided out of the
  gradients again by whoever set it);
- ``on_after_forward(ctx)``: ``ctx.loss`` is set (may replace it, e.g. a fault injection);
- ``on_after_backward(ctx)``: the gradients exist, still scaled by the loss scale;
- ``on_before_optimizer_step(ctx)``: unscaled and clipped, ``ctx.grad_norm`` and
  ``ctx.found_inf`` set; returning ``False`` vetoes the update (the anomaly guard's "block"),
  every hook is called either way;
- ``on_after_optimizer_step(ctx)``: the update was applied or not (``ctx.skipped``), the scaler
  updated; the gradients still exist (``zero_grad`` follows);
- ``on_checkpoint(ctx, state)``: `TrainStep.checkpoint` asks each hook for what it adds to a
  checkpoint (``state``: the dict being saved, updated in place);
- ``on_error(ctx)``: the step raised; hooks close what they opened (operand collectors).

A hook method with another ``on_*`` name (``on_after_bakward``), or with a name of the
earlier ``before_*``/``after_*`` style (``after_backward``), would never be called: it is a
TypeError naming it when the step is built (`check_hooks`).

Devices: the first step checks that the batch's tensors are on the parameters' device
(`check_devices`; once per TrainStep, not per step) and raises ValueError naming both devices.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import numbers
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "HOOKS",
    "Hooks",
    "ScopedHook",
    "StepContext",
    "TrainStep",
    "WatchHook",
    "check_devices",
    "check_hooks",
    "warn_unconverted",
]

#: the hook methods a TrainStep calls, in the order of a step (``on_checkpoint`` on demand,
#: ``on_error`` when the step raised)
HOOKS = (
    "on_before_forward",
    "on_after_forward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_checkpoint",
    "on_error",
)

#: the names of the earlier style -> the hook method of that name now
_RENAMED = {h.removeprefix("on_"): h for h in HOOKS if h.startswith(("on_before_", "on_after_"))}

#: what a loss function returns: the loss tensor to backpropagate, or (that tensor, the loss to
#: report), e.g. a data-parallel rank's local loss and the global batch's
LossFn = Callable[[Any], "torch.Tensor | tuple[torch.Tensor, float]"]


@dataclass
class StepContext:
    """What a hook sees of one step. ``step``: the 0-based step index; ``batch``: the batch the
    loss function receives; ``loss``: the loss tensor backpropagated (after
    ``on_after_forward``; None when a closure returned a plain number); ``global_loss``: the
    loss to report when it is not ``loss`` (data parallel, or a closure's number);
    ``loss_scale``: the scaler's scale of this step (1.0 without one); ``loss_mult``: an extra
    factor on the loss for backward; ``grad_norm``: the global gradient norm before clipping
    (NaN when the gradients are not finite); ``found_inf``: the scaler found non-finite
    gradients; ``vetoed``: a hook vetoed the update; ``skipped``: the update was not applied;
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


def check_hooks(hooks: Sequence[Any], what: str = "TrainStep") -> list[Any]:
    """``hooks`` as a list; TypeError naming a hook's method that looks like a hook method but
    is none (an ``on_*`` name not in `HOOKS`, or an earlier ``before_*``/``after_*`` name), so
    that a misspelled hook is an error instead of a method never called."""
    out = list(hooks)
    for h in out:
        for name in dir(h):
            if name in HOOKS or not (name.startswith("on_") or name in _RENAMED):
                continue
            if not callable(inspect.getattr_static(h, name, None)):
                continue
            kind = type(h).__name__
            if name in _RENAMED:
                hint = f"hook methods are named with on_: {_RENAMED[name]!r}"
            else:
                close = difflib.get_close_matches(name, HOOKS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"the hook methods: {HOOKS}"
            raise TypeError(f"{what}: hook {kind} has a method {name!r} that no step calls; {hint}")
    return out


class Hooks:
    """A checked list of hooks (`check_hooks`) and the one way to call them: `TrainStep` calls
    them at each phase of its step, a framework callback at the framework's events."""

    def __init__(self, hooks: Sequence[Any] = (), what: str = "TrainStep") -> None:
        self.hooks = check_hooks(hooks, what)

    def __iter__(self) -> Any:
        return iter(self.hooks)

    def call(self, name: str, ctx: StepContext, *args: Any) -> bool:
        """Call hook method ``name`` on every hook that has it, in list order; False when one
        returned False (a veto; every hook is called either way)."""
        ok = True
        for h in self.hooks:
            fn = getattr(h, name, None)
            if fn is not None and fn(ctx, *args) is False:
                ok = False
        return ok


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


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


class TrainStep:
    """One training step (see the module doc for the hooks).

    ``loss_fn(batch)``: runs the model, returns the loss (or ``(loss, reported_loss)``);
    ``optimizer``: None runs no update (gradients are kept: ``zero_grad`` is skipped too, for a
    replay that reads them); ``scaler``: an `fp8lab.optim.LossScaler`, a ``torch.amp.GradScaler``
    or None; ``clip``: the max global gradient norm (0 = off); ``params``: the parameters
    clipped and measured (default the optimizer's). ``backward``: True (the default) backpropagates
    ``loss * loss_scale * loss_mult``; False: ``loss_fn`` is a closure that runs backward itself
    (``scaler.scale(loss).backward()`` under a scaler) and returns the loss, a one-element
    tensor or a number. ``what``: the name errors give (``"GuardedStep"``).

    Errors: a loss function that returns anything but the loss is a TypeError (a tensor of
    more than one element a ValueError); a closure after which no parameter's gradient changed
    (it never called backward) a ValueError; each names ``what``."""

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: Any = None,
        scaler: Any = None,
        clip: float = 0.0,
        hooks: Sequence[Any] = (),
        params: Sequence[torch.Tensor] | None = None,
        *,
        backward: bool = True,
        what: str = "TrainStep",
    ) -> None:
        if params is None:
            if optimizer is None:
                raise ValueError(f"{what} without an optimizer needs params")
            params = [p for g in optimizer.param_groups for p in g["params"]]
        self.loss_fn, self.optimizer, self.scaler = loss_fn, optimizer, scaler
        self.clip = float(clip)
        self.params = list(params)
        self.what, self.backward = what, bool(backward)
        self._hooks = Hooks(hooks, what)
        self._devices_checked = False  # check_devices on the first batch only

    @property
    def hooks(self) -> list[Any]:
        return self._hooks.hooks

    def __call__(self, step: int, batch: Any) -> StepContext:
        """Run step ``step`` on ``batch``; return its context."""
        if not self._devices_checked:
            check_devices(self.params, batch, self.what)
            self._devices_checked = True
        t0 = time.perf_counter()
        scaler = self.scaler
        ctx = StepContext(step, batch, loss_scale=scaler.get_scale() if scaler is not None else 1.0)
        try:
            self._run(ctx)
        except BaseException:
            self._hooks.call("on_error", ctx)  # hooks close what they opened
            if self.optimizer is not None:  # the next step must not add to a failed one's
                self.optimizer.zero_grad(set_to_none=True)
            raise
        ctx.time_s = time.perf_counter() - t0
        return ctx

    def _run(self, ctx: StepContext) -> None:
        call, scaler = self._hooks.call, self.scaler
        call("on_before_forward", ctx)
        if self.backward:
            self._set_loss(ctx, self.loss_fn(ctx.batch))
            call("on_after_forward", ctx)
            (ctx.loss * (ctx.loss_scale * ctx.loss_mult)).backward()
        else:
            before = [(p.grad, None if p.grad is None else p.grad._version) for p in self.params]
            self._set_loss(ctx, self.loss_fn(ctx.batch))
            if not any(p.grad is not g or (g is not None and g._version != v)
                       for p, (g, v) in zip(self.params, before, strict=True)):  # fmt: skip
                raise ValueError(
                    f"{self.what}: the closure returned the loss but no parameter's gradient "
                    "changed: it must call backward (loss.backward(), or "
                    "scaler.scale(loss).backward() with a scaler)"
                )
            call("on_after_forward", ctx)
        call("on_after_backward", ctx)
        self._unscale_and_clip(ctx)
        ctx.vetoed = not call("on_before_optimizer_step", ctx)
        if self.optimizer is not None:
            if not ctx.found_inf and math.isfinite(ctx.grad_norm) and not ctx.vetoed:
                self.optimizer.step()
                ctx.skipped = bool(getattr(self.optimizer, "last_step_skipped", False))
            if scaler is not None:
                scaler.update()
        call("on_after_optimizer_step", ctx)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _set_loss(self, ctx: StepContext, out: Any) -> None:
        """``ctx.loss`` (and ``ctx.global_loss``) from what the loss function returned."""
        who = "the loss function" if self.backward else "the closure"
        if self.backward and isinstance(out, tuple) and len(out) == 2:
            out, ctx.global_loss = out[0], float(out[1])
        if isinstance(out, torch.Tensor):
            if out.numel() != 1:
                raise ValueError(
                    f"{self.what}: {who} returned {_describe(out)}; it must return the loss, "
                    "one number (reduce it, e.g. .mean())"
                )
            ctx.loss = out
        elif (not self.backward and isinstance(out, numbers.Real)
              and not isinstance(out, bool)):  # fmt: skip
            ctx.global_loss = float(out)
        else:
            wanted = "a scalar tensor" if self.backward else "a scalar tensor or a number"
            raise TypeError(
                f"{self.what}: {who} returned {_describe(out)}; it must return the loss ({wanted})"
            )

    def _unscale_and_clip(self, ctx: StepContext) -> None:
        """Unscale the gradients (the scaler's found_inf), then the norm and clipping."""
        from fp8lab.optim import unscale_and_clip

        # without an optimizer (a replay) the scaler unscales the step's parameters; it is not
        # updated either, so such a step needs a fresh scaler (or one loaded from a state)
        target = self.optimizer if self.optimizer is not None else self.params
        ctx.found_inf, ctx.grad_norm = unscale_and_clip(self.scaler, target, self.params, self.clip)

    def checkpoint(self, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """Let every hook add to the checkpoint ``state`` (``on_checkpoint(ctx, state)``)."""
        self._hooks.call("on_checkpoint", StepContext(step, None), state)
        return state


class ScopedHook:
    """Base of hooks that hold context managers (operand collectors) open over the forward
    and backward: `enter` them in ``on_before_forward``; they close after backward, on an
    error, or at `close`."""

    _stack: contextlib.ExitStack | None = None

    def enter(self, cm: Any) -> Any:
        """Enter ``cm`` until the end of this step's backward; return what it yields."""
        if self._stack is None:
            self._stack = contextlib.ExitStack()
        return self._stack.enter_context(cm)

    def close(self) -> None:
        """Close what `enter` opened (idempotent)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def on_after_backward(self, ctx: StepContext) -> None:
        self.close()

    def on_error(self, ctx: StepContext) -> None:
        self.close()


def warn_unconverted(model: torch.nn.Module, every: int, what: str) -> bool:
    """Warn (UserWarning naming ``what``) when operand statistics are asked for every ``every``
    steps of a model without converted layers: they would give no record, silently. True when
    the model has converted layers."""
    from fp8lab.nn import converted

    if converted(model):
        return True
    if every > 0:
        warnings.warn(
            f"{what}: watch_every={every} but the model has no fp8lab layers (fp8lab.nn.convert "
            "it first): the operand statistics give no records",
            UserWarning,
            stacklevel=3,
        )
    return False


class WatchHook(ScopedHook):
    """`fp8lab.observe.sample` as a hook: every ``every`` steps (0 = never) the operand
    statistics of the step's forward and backward go to ``rows`` (``step``: steps done). A
    model without converted layers under ``every > 0`` warns (`warn_unconverted`)."""

    def __init__(self, model: torch.nn.Module, every: int, what: str = "WatchHook") -> None:
        self.model, self.every = model, every
        self.rows: list[dict[str, Any]] = []
        warn_unconverted(model, every, what)

    def on_before_forward(self, ctx: StepContext) -> None:
        self.rows = []
        if self.every > 0 and (ctx.step + 1) % self.every == 0:
            self.rows = self.enter(sample_rows(self.model, True, ctx.step + 1))


def sample_rows(model: torch.nn.Module, enabled: bool, step: int) -> Any:
    """``fp8lab.observe.sample``: the rows of this step's operands (the watch records), or []."""
    if not enabled:
        return contextlib.nullcontext([])
    from fp8lab.observe import sample

    return sample(model, step)
