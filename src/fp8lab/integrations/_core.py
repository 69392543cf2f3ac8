"""What the framework callbacks share (`fp8lab.integrations.hf`, `fp8lab.integrations.lightning`):
`CallbackCore`, the watch records and the anomaly guard of a loop that someone else runs.

A framework calls the core at its own events: `start` (the model and optimizer exist, any
checkpoint is loaded), `step_begin` (before the first forward of an optimizer step), `add_loss`
(each micro-batch's loss), `before_update` (gradients final, before ``optimizer.step()``: the
detectors run, and when the guard acts every gradient is set to None, so the framework's
``optimizer.step()`` changes nothing), `step_end` (after the optimizer step and the scheduler:
skip, rollback or escalation, `fp8lab.guard.session.GuardSession`, the lab's one definition).

A rollback restores model, optimizer, loss scaler, scheduler, torch RNG and the guard's
statistics from the newest last-good snapshot; the framework's own step counter and data
order go on (the rolled-back steps' batches are not replayed).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fp8lab.guard import AnomalyGuard, GuardSession, GuardState
from fp8lab.guard.guarded_step import guard_checkpoint, load_guard_checkpoint
from fp8lab.integrations.accelerate import check_prepared

__all__ = ["DEFAULT_GUARD", "GUARD_FILE", "CallbackCore", "CoreCallback"]

#: ``guard=`` left out: every detector, policy "rollback" (``None`` means no guard)
DEFAULT_GUARD: Any = object()

#: the guard's state in a framework checkpoint directory (beside `fp8lab.nn.FP8_STATE_FILE`)
GUARD_FILE = "fp8lab_guard.json"


def _converted_names(model: torch.nn.Module) -> list[str]:
    from fp8lab.nn import Linear

    return [n for n, m in model.named_modules() if isinstance(m, Linear)]


class CallbackCore:
    """The framework-neutral part of a callback (see the module doc). ``guard``: an
    `fp8lab.AnomalyGuard` (None: watch only); ``watch_every``: operand statistics of every
    N-th optimizer step (0 = off), the lab's records (`fp8lab.observe.sample`, ``step`` = steps
    done after the sampled step) in ``records``."""

    def __init__(self, guard: AnomalyGuard | None, watch_every: int) -> None:
        if guard is not None and not isinstance(guard, AnomalyGuard):
            raise TypeError(f"guard must be an fp8lab.AnomalyGuard or None, got {guard!r}")
        if isinstance(watch_every, bool) or not isinstance(watch_every, int) or watch_every < 0:
            raise ValueError(f"watch_every must be an integer >= 0, got {watch_every!r}")
        self.guard, self.watch_every = guard, watch_every
        self.records: list[dict[str, Any]] = []
        self.session: GuardSession | None = None
        self.state = GuardState()
        self.expected: list[str] | None = None  # converted layers before the framework wrapped
        self.last_action: str | None = None
        self._stack: contextlib.ExitStack | None = None
        self._guard_rows: list[dict[str, Any]] | None = None
        self._watch_rows: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self._model: torch.nn.Module | None = None
        self._converted = False
        self._params: list[torch.Tensor] = []

    @property
    def events(self) -> list[dict[str, Any]]:
        """The guard's event records (skip, rollback, escalate), as the lab's ``guard_events``."""
        return self.state.guard_events

    # ------------------------------------------------------------------ lifecycle
    def remember(self, model: torch.nn.Module) -> None:
        """Note the converted layers before the framework prepares the model (`check_prepared`
        then names those another FP8 library replaced)."""
        self.expected = _converted_names(model)

    def start(
        self, model: torch.nn.Module, optimizer: Any, scaler: Any = None, scheduler: Any = None,
        step: int = 0,
    ) -> None:  # fmt: skip
        """Training begins at ``step`` steps done (model and optimizer loaded)."""
        check_prepared(model, self.expected)
        self._model, self._converted = model, bool(_converted_names(model))
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self.state.step = self.state.cursor = step
        if self.guard is not None:
            stateful = {"scheduler": scheduler} if scheduler is not None else None
            self.session = GuardSession(self.guard, model, optimizer, scaler, None, stateful)
            self.session.snapshot(self.state)  # the first last-good state: the start

    def step_begin(self) -> None:
        """Before the first forward of the optimizer step ``state.step``."""
        t, model = self.state.step, self._model
        if model is None:
            raise RuntimeError("fp8lab callback: a training step began before training started")
        self.close()
        self._losses, self._watch_rows, self._guard_rows = [], [], None
        self._stack = contextlib.ExitStack()
        ses = self.session
        if ses is not None:
            ses.before_step()
            if self._converted and ses.wants_rows(t):
                from fp8lab.guard.percent import operand_percentages

                self._guard_rows = self._stack.enter_context(operand_percentages())
        if self.watch_every and (t + 1) % self.watch_every == 0:
            from fp8lab.observe import sample

            self._watch_rows = self._stack.enter_context(sample(model, t + 1))

    def add_loss(self, loss: Any) -> None:
        """One micro-batch's loss (a tensor or a number), as it was computed."""
        self._losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))

    def before_update(self, grad_norm: float | None = None) -> bool:
        """The gradients are final: run the detectors; True when the guard acts (every
        gradient is then set to None so that the optimizer step changes nothing).
        ``grad_norm``: the norm before the framework clipped (default: the norm now)."""
        self.close()
        self.records.extend(self._watch_rows)
        ses = self.session
        if ses is None:
            return False
        from fp8lab.optim import grad_norm as norm_now

        if not self._losses:
            raise RuntimeError(
                "fp8lab callback: no training loss was seen this step (the model's output has "
                "no 'loss'); the guard needs it"
            )
        loss = sum(self._losses) / len(self._losses)
        gnorm = float(norm_now(self._params)) if grad_norm is None else float(grad_norm)
        veto = ses.check(self.state.step, loss, gnorm, self._guard_rows)
        if veto:
            for p in self._params:
                p.grad = None
        return veto

    def step_end(self) -> str | None:
        """After the optimizer step (and the scheduler's): None (kept), "skip" or "rollback"."""
        self.state.step += 1
        self.state.cursor += 1
        if self.session is None:
            return None
        self.last_action = self.session.after_step(self.state)
        return self.last_action

    def close(self) -> None:
        """Stop collecting this step's operands (after backward, or when training ends)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's state as plain data (JSON): detectors, configuration, counters."""
        return guard_checkpoint(self.session, self.state)

    def save(self, directory: str | Path) -> None:
        """Write the FP8 state (`fp8lab.nn.save_fp8_state`) and the guard's (`GUARD_FILE`) into
        a checkpoint directory, each atomically."""
        from fp8lab.nn import save_fp8_state

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self._model is not None and self._converted:
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
                f"fp8lab callback: {directory} holds no fp8lab state ({GUARD_FILE}); the guard "
                "starts afresh", UserWarning, stacklevel=3,
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
