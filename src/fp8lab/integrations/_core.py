"""What the framework callbacks share (`fp8lab.integrations.hf`, `fp8lab.integrations.lightning`):
`CallbackCore`, the watch records and the anomaly guard of a loop that someone else runs.

The framework runs the arithmetic of each step (forward, backward, clipping, the optimizer);
the core calls the hooks of the one training step (`fp8lab.step.TrainStep`'s, through
`fp8lab.step.Hooks` with a `fp8lab.step.StepContext`) at the framework's events: the guard
(`fp8lab.guard.GuardHook`) and the watch (`fp8lab.step.WatchHook`), the same objects the lab's
loop and `fp8lab.guard.GuardedStep` run. `start` (the model and optimizer exist, any checkpoint
is loaded), `step_begin` (before the first forward of an optimizer step:
``on_before_forward``), `add_loss` (each micro-batch's loss), `before_update` (gradients final,
before ``optimizer.step()``: ``on_after_backward``, then ``on_before_optimizer_step``, whose
veto sets every gradient to None, so the framework's ``optimizer.step()`` changes nothing),
`step_end` (after the optimizer step and the scheduler: skip, rollback or escalation,
`fp8lab.guard.session.GuardSession`, the lab's one definition).

The guard counts steps as the framework does (`step_end` takes the framework's step count). A
rollback restores model, optimizer, loss scaler, torch RNG and the guard's statistics from the
newest last-good snapshot; the framework's own step counter, learning-rate schedule and data
order go on (the rolled-back steps' batches are not replayed; the optimizer's hyperparameters,
such as the scheduled learning rate, stay those of the framework's step).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fp8lab.guard import AnomalyGuard, GuardHook, GuardState
from fp8lab.guard.guarded_step import guard_checkpoint, load_guard_checkpoint
from fp8lab.guard.hook import as_guard
from fp8lab.integrations.accelerate import check_prepared
from fp8lab.step import Hooks, ScopedHook, StepContext, WatchHook

__all__ = ["DEFAULT_GUARD", "GUARD_FILE", "CallbackCore", "CoreCallback"]

#: ``guard=`` left out: every detector, policy "rollback" (``None`` means no guard)
DEFAULT_GUARD: Any = object()

#: the guard's state in a framework checkpoint directory (beside `fp8lab.nn.FP8_STATE_FILE`)
GUARD_FILE = "fp8lab_guard.json"

#: how the callbacks name themselves in errors and warnings
WHO = "fp8lab FP8LabCallback"


class CallbackCore:
    """The framework-neutral part of a callback (see the module doc). ``guard``: an
    `fp8lab.AnomalyGuard` (None: watch only); ``watch_every``: operand statistics of every
    N-th optimizer step (0 = off), the lab's records (`fp8lab.observe.sample`, ``step`` = steps
    done after the sampled step) in ``records``; a model without converted layers warns."""

    def __init__(self, guard: AnomalyGuard | None, watch_every: int) -> None:
        if guard is not None:
            guard = as_guard(guard, WHO)
        if isinstance(watch_every, bool) or not isinstance(watch_every, int) or watch_every < 0:
            raise ValueError(f"{WHO}: watch_every must be an integer >= 0, got {watch_every!r}")
        self.guard, self.watch_every = guard, watch_every
        self.records: list[dict[str, Any]] = []
        self.session: GuardHook | None = None
        self.state = GuardState()
        self.expected: list[str] | None = None  # converted layers before the framework wrapped
        self.last_action: str | None = None
        self._hooks: Hooks | None = None
        self._watch: WatchHook | None = None
        self._ctx: StepContext | None = None  # the step in progress
        self._losses: list[float] = []
        self._model: torch.nn.Module | None = None
        self._opt: Any = None
        self._params: list[torch.Tensor] = []

    @property
    def events(self) -> list[dict[str, Any]]:
        """The guard's event records (skip, rollback, escalate), as the lab's ``guard_events``."""
        return self.state.guard_events

    # ------------------------------------------------------------------ lifecycle
    def remember(self, model: torch.nn.Module) -> None:
        """Note the converted layers before the framework prepares the model (`check_prepared`
        then names those another FP8 library replaced)."""
        from fp8lab.nn import converted

        self.expected = converted(model)

    def start(
        self, model: torch.nn.Module, optimizer: Any, scaler: Any = None, step: int = 0
    ) -> None:
        """Training begins at ``step`` steps done (model and optimizer loaded)."""
        check_prepared(model, self.expected)
        self._model, self._opt = model, optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self.state.step = self.state.cursor = step
        self._watch = WatchHook(model, self.watch_every, WHO)
        hooks: list[Any] = [self._watch]
        if self.guard is not None:
            # the learning-rate scheduler is not the guard's to restore: it follows the
            # framework's step count, which a rollback does not rewind
            self.session = GuardHook(self.guard, model, optimizer, scaler)
            self.session.snapshot(self.state)  # the first last-good state: the start
            hooks.insert(0, self.session)
        self._hooks = Hooks(hooks, WHO)

    def step_begin(self) -> None:
        """Before the first forward of the optimizer step ``state.step``."""
        if self._hooks is None:
            raise RuntimeError(f"{WHO}: a training step began before training started")
        self.close()
        self._losses = []
        self._ctx = StepContext(self.state.step, None)
        self._hooks.call("on_before_forward", self._ctx)

    def add_loss(self, loss: Any) -> None:
        """One micro-batch's loss (a tensor or a number), as it was computed."""
        self._losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))

    def before_update(self, grad_norm: float | None = None) -> bool:
        """The gradients are final: run the detectors; True when the guard acts (every
        gradient is then set to None so that the optimizer step changes nothing).
        ``grad_norm``: the norm before the framework clipped (default: the norm now)."""
        ctx, hooks, watch = self._ctx, self._hooks, self._watch
        if ctx is None or hooks is None or watch is None:
            raise RuntimeError(f"{WHO}: an optimizer step came before its training step began")
        hooks.call("on_after_backward", ctx)  # the step's operand collectors close
        self.records.extend(watch.rows)
        watch.rows = []
        if self.session is None:
            return False
        from fp8lab.optim import grad_norm as norm_now

        if not self._losses:
            raise RuntimeError(
                f"{WHO}: no training loss was seen this step (the model's output has no "
                "'loss'); the guard needs it"
            )
        ctx.global_loss = sum(self._losses) / len(self._losses)
        ctx.grad_norm = float(norm_now(self._params)) if grad_norm is None else float(grad_norm)
        ctx.vetoed = not hooks.call("on_before_optimizer_step", ctx)
        if ctx.vetoed:
            for p in self._params:
                p.grad = None
        return ctx.vetoed

    def step_end(self, step: int | None = None) -> str | None:
        """After the optimizer step (and the scheduler's): None (kept), "skip" or "rollback".
        ``step``: the framework's count of steps done (default: one more than before), which
        the guard's count follows, a rollback included."""
        st = self.state
        st.step = st.cursor = st.step + 1 if step is None else int(step)
        self._ctx = None
        if self.session is None:
            return None
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self._opt.param_groups]
        self.last_action = self.session.after_step(st)
        if self.last_action == "rollback":
            # the framework's count, data order and schedule go on; the optimizer's moments
            # are the snapshot's, its scheduled hyperparameters (learning rate) this step's
            if step is not None:
                st.step = st.cursor = int(step)
            for g, h in zip(self._opt.param_groups, hyper, strict=True):
                g.update(h)
        return self.last_action

    def take_events(self) -> list[dict[str, Any]]:
        """The guard's event records since the last call (for the framework's log)."""
        return [] if self.session is None else self.session.take_events()

    def close(self) -> None:
        """Stop collecting this step's operands (after backward, or when training ends)."""
        for h in self._hooks or ():
            if isinstance(h, ScopedHook):
                h.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's state as plain data (JSON): detectors, configuration, counters."""
        return guard_checkpoint(self.session, self.state)

    def save(self, directory: str | Path) -> None:
        """Write the FP8 state (`fp8lab.nn.save_fp8_state`) and the guard's (`GUARD_FILE`) into
        a checkpoint directory, each atomically."""
        from fp8lab.nn import converted, save_fp8_state

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self._model is not None and converted(self._model):
            save_fp8_state(self._model, d)
        tmp = d / (GUARD_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state_dict(), allow_nan=False))
        os.replace(tmp, d / GUARD_FILE)

    def load(self, directory: str | Path) -> bool:
        """Restore what `save` wrote into ``directory`` (the guard first: an escalated layer's
        state was saved under its escalated recipe). False when the directory holds neither
        file; a ValueError names a file that does not fit."""
        from fp8lab.nn import FP8_STATE_FILE, load_fp8_state

        d = Path(directory)
        guard_file, fp8_file = d / GUARD_FILE, d / FP8_STATE_FILE
        if not guard_file.is_file() and not fp8_file.is_file():
            return False
        if guard_file.is_file():
            try:
                self.load_state(json.loads(guard_file.read_text()))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{guard_file}: not an fp8lab guard state ({exc})") from None
        if fp8_file.is_file() and self._model is not None:
            load_fp8_state(self._model, fp8_file)
        self.snapshot()
        return True

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s data (before the model's FP8 state loads)."""
        load_guard_checkpoint(self.session, self.state, state)

    def snapshot(self) -> None:
        """The current state is the first last-good one (after a checkpoint was loaded)."""
        if self.session is not None:
            self.session.snapshots.clear()
            self.session.snapshot(self.state)

    def resume(self, directory: str | Path | None) -> None:
        """`load` ``directory``, warning when a resumed run's checkpoint has no fp8lab state
        (the delayed-scaling histories then come from the model's own state_dict, if at all)."""
        if directory is not None and not self.load(directory):
            warnings.warn(
                f"{WHO}: {directory} holds no fp8lab state ({GUARD_FILE}); the guard starts "
                "afresh", UserWarning, stacklevel=3,
            )  # fmt: skip


class CoreCallback:
    """The part the framework callbacks share: a `CallbackCore` as ``core``, and its records and
    events."""

    def __init__(self, guard: AnomalyGuard | None = DEFAULT_GUARD, watch_every: int = 0) -> None:
        self.core = CallbackCore(AnomalyGuard() if guard is DEFAULT_GUARD else guard, watch_every)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The watch records so far (one dict per operand of each sampled step)."""
        return self.core.records

    @property
    def events(self) -> list[dict[str, Any]]:
        """The guard's event records so far (skip, rollback, escalate)."""
        return self.core.events
