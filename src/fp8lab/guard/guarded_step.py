"""`GuardedStep`: the anomaly guard around a user's own training step (docs/guard.md).

::

    gs = fp8lab.guard.GuardedStep(model, opt, guard=fp8lab.AnomalyGuard(checkpoint_every=10))
    pos = 0  # the index of the next batch in the user's data order
    while gs.steps_done < steps:
        x, y = batch_at(pos)

        def closure():
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        result = gs.step(closure, position=pos)
        pos = result.next_position  # rewound after a rollback

The same detectors, policies (off / skip / rollback), last-good snapshots, event records and
escalation as the lab's loop, and the same step: a `fp8lab.step.TrainStep` whose closure runs
forward and backward (``backward=False``), with the guard as its hook (`fp8lab.guard.hook.
GuardHook`) and the watch as another (`fp8lab.step.WatchHook`). The step owns what happens
between backward and the next step: unscaling (``scaler``: an `fp8lab.optim.LossScaler` or a
``torch.amp.GradScaler``; the closure backpropagates ``scaler.scale(loss)`` then and returns the
unscaled loss), the gradient norm and clipping, the optimizer step (or not) and ``zero_grad``.

Refused with a TypeError or ValueError naming the argument: a guard that is not an
`AnomalyGuard` (``guard="rollback"``), an optimizer over parameters that are not the model's,
a closure that returns anything but the loss (None, a dict, a string) or never calls backward.
``watch_every`` on a model without converted layers warns (it would record nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8lab.guard.config import AnomalyGuard
from fp8lab.guard.detectors import Finding
from fp8lab.guard.hook import GuardHook, as_guard
from fp8lab.guard.session import GuardSession
from fp8lab.step import TrainStep, WatchHook

__all__ = [
    "ACTIONS",
    "GuardState",
    "GuardedStep",
    "StepResult",
    "guard_checkpoint",
    "load_guard_checkpoint",
]

#: what `GuardedStep.step` did with a step's update
ACTIONS = ("applied", "skipped", "rolled_back")


@dataclass
class GuardState:
    """A guarded loop's counters (the fields the lab's loop state shares with it): ``step``
    (steps done), ``cursor`` (the data position of the next step) and the sticky fields a
    rollback never rewinds (`fp8lab.guard.session.STICKY`)."""

    step: int = 0
    cursor: int = 0
    injected: list[str] = field(default_factory=list)
    guard_events: list[dict[str, Any]] = field(default_factory=list)
    skip_batches: list[int] = field(default_factory=list)
    escalations: list[list[str]] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """What one guarded step did. ``action``: ``"applied"`` (the update was applied; under
    policy ``"off"`` also with findings), ``"skipped"`` (not applied: the guard skipped it, or
    the gradients overflowed) or ``"rolled_back"`` (model, optimizer, scaler, RNG and counters
    restored to the snapshot after ``to_step`` steps). ``steps_done``: steps done now (after a
    rollback: ``to_step``); ``next_position``: the data position the loop trains on next
    (rewound after a rollback; batches the guard chose to skip are passed over); ``loss``,
    ``grad_norm``: the step's (non-finite kept as is); ``findings``: the detectors that fired;
    ``events``: the guard's event records of this step (the lab's ``guard_events`` records)."""

    action: str
    steps_done: int
    next_position: int
    loss: float
    grad_norm: float
    findings: tuple[Finding, ...] = ()
    events: tuple[dict[str, Any], ...] = ()
    to_step: int | None = None

    @property
    def applied(self) -> bool:
        return self.action == "applied"

    @property
    def rolled_back(self) -> bool:
        return self.action == "rolled_back"

    @property
    def reason(self) -> str | None:
        """``"detector on tensor"`` of the first finding the guard acted on (None: none)."""
        if not self.findings:
            return None
        f = self.findings[0]
        return f"{f.detector} on {f.tensor}" if f.tensor else f.detector


class GuardedStep:
    """The anomaly guard around a user's training step (see the module doc).

    ``model``, ``optimizer``: the user's (any ``torch.optim.Optimizer``); ``guard``: an
    `AnomalyGuard` (default: every detector, policy ``"rollback"``); ``scaler``: a loss scaler
    or None; ``clip``: max global gradient norm (0 = off); ``scheduler``: a learning-rate
    scheduler, stepped once per counted step (applied or skipped, as the lab's schedule counts
    steps) and restored by a rollback; ``stateful``: more objects with
    ``state_dict``/``load_state_dict`` that a rollback restores, as they are at the end of a
    step; ``position``: the data position of the first step; ``watch_every``: every N-th step's
    operand statistics (`fp8lab.observe.sample`, the lab's ``stats.jsonl`` records, ``step`` =
    steps done) go to ``records`` (0 = off; a rollback drops the abandoned steps'). The first
    last-good snapshot is taken here: construct it after loading a checkpoint."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        guard: AnomalyGuard | None = None,
        scaler: Any = None,
        *,
        clip: float = 0.0,
        scheduler: Any = None,
        stateful: Mapping[str, Any] | None = None,
        position: int = 0,
        watch_every: int = 0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"GuardedStep: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"GuardedStep: optimizer must be a torch optimizer, got {type(optimizer).__name__}"
            )
        guard = AnomalyGuard() if guard is None else as_guard(guard, "GuardedStep")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        own = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in own for p in params)
        if foreign:
            raise ValueError(
                f"GuardedStep: {foreign} of the optimizer's {len(params)} parameters are not "
                "parameters of the model; build the optimizer over this model's parameters "
                "(a rollback restores the model, and the update must be the model's)"
            )
        if not (isinstance(clip, int | float) and math.isfinite(clip) and clip >= 0):
            raise ValueError(f"GuardedStep: clip must be a number >= 0, got {clip!r}")
        stateful = {
            **(stateful or {}),
            **({"scheduler": scheduler} if scheduler is not None else {}),
        }
        for name, obj in stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"GuardedStep: stateful[{name!r}] has no state_dict/load_state_dict"
                )
        self.model, self.optimizer, self.scaler, self.clip = model, optimizer, scaler, float(clip)
        self.scheduler = scheduler
        self.params = params
        self.state = GuardState(cursor=_position(position))
        if isinstance(watch_every, bool) or not isinstance(watch_every, int) or watch_every < 0:
            raise ValueError(
                f"GuardedStep: watch_every must be an integer >= 0, got {watch_every!r}"
            )
        self.watch_every = watch_every
        self.records: list[dict[str, Any]] = []
        #: the guard, a `GuardHook` of the step (`GuardSession`: snapshots, rollback, events)
        self.session: GuardSession = GuardHook(guard, model, optimizer, scaler, None, stateful)
        self._watch = WatchHook(model, watch_every, "GuardedStep")
        self._step = TrainStep(_run_closure, optimizer, scaler, self.clip,
                               [self.session, self._watch], params, backward=False,
                               what="GuardedStep")  # fmt: skip
        self.session.snapshot(self.state)  # the first last-good state: the start

    @property
    def guard(self) -> AnomalyGuard:
        return self.session.guard

    @property
    def steps_done(self) -> int:
        return self.state.step

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event record so far (skip, rollback, escalate), as the lab's ``guard_events``."""
        return self.state.guard_events

    @property
    def signals(self) -> dict[str, Any]:
        """The last step's detector signals (the lab's ``guard_signals`` event)."""
        return self.session.monitor.signals

    def step(self, closure: Callable[[], Any], position: int | None = None) -> StepResult:
        """Run one guarded step: ``closure()`` computes the loss and runs backward and returns
        the loss (a tensor or a number); ``position``: the data position of this step's batch
        (default: the cursor, one past the previous step's)."""
        if not callable(closure):
            raise TypeError(
                f"GuardedStep.step: closure must be callable, got {type(closure).__name__}"
            )
        st, ses = self.state, self.session
        if position is not None:
            st.cursor = _position(position)
        ctx = self._step(st.step, closure)
        self.records.extend(self._watch.rows)
        if self.scheduler is not None:
            self.scheduler.step()
        st.step += 1
        st.cursor += 1
        action = ses.after_step(st)
        events = tuple(ses.take_events())
        to_step = next((e["to_step"] for e in events if e["action"] == "rollback"), None)
        act = "rolled_back" if action == "rollback" else "skipped" if ctx.skipped else "applied"
        if to_step is not None:  # the abandoned steps' records go, as in the lab's loop
            self.records = [r for r in self.records if r["step"] <= to_step]
        return StepResult(act, st.step, self.next_position(), ctx.loss_value, ctx.grad_norm,
                          tuple(ses.findings), events, to_step)  # fmt: skip

    def next_position(self) -> int:
        """The data position of the next step: the cursor, past batches the guard skips."""
        while self.state.cursor in self.state.skip_batches:
            self.state.cursor += 1
        return self.state.cursor

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's part of a user checkpoint (plain data: ``torch.load(weights_only=True)``
        reads it): detector statistics, configuration, states mid-restart and the counters."""
        return guard_checkpoint(self.session, self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s data. Call it *before* the model's state loads (an escalated
        layer's state was saved under its escalated recipe); a new last-good snapshot is taken
        once ``snapshot()`` is called after the model and optimizer are loaded."""
        load_guard_checkpoint(self.session, self.state, state)

    def snapshot(self) -> None:
        """Take a last-good snapshot now (after loading a checkpoint into model and optimizer)."""
        self.session.snapshots.clear()
        self.session.snapshot(self.state)


def guard_checkpoint(session: GuardSession | None, st: GuardState) -> dict[str, Any]:
    """A guarded loop's checkpoint data (plain, JSON-able): ``loop`` (the `GuardState`
    fields) and, with a session, its `GuardSession.checkpoint_extra`."""
    out: dict[str, Any] = {"loop": {k: copy.deepcopy(v) for k, v in vars(st).items()}}
    if session is not None:
        out.update(session.checkpoint_extra())
    return out


def load_guard_checkpoint(
    session: GuardSession | None, st: GuardState, state: Mapping[str, Any]
) -> None:
    """Restore `guard_checkpoint`'s data into ``session`` and ``st`` (escalations re-applied and
    detector statistics loaded first: call it before the model's state loads)."""
    loop = state.get("loop") if isinstance(state, Mapping) else None
    if not isinstance(loop, Mapping) or (session is not None and "guard" not in state):
        raise ValueError("not an fp8lab guard checkpoint: missing keys 'loop' or 'guard'")
    names = [f.name for f in dataclasses.fields(GuardState)]
    missing = [k for k in names if k not in loop]
    if missing:
        raise ValueError(f"not an fp8lab guard checkpoint: loop lacks {missing}")
    if session is not None:
        session.prepare_load(dict(state))
    for k in names:
        setattr(st, k, copy.deepcopy(loop[k]))


def _run_closure(closure: Callable[[], Any]) -> Any:
    """The step's loss function: the batch a GuardedStep hands its TrainStep is the closure."""
    return closure()


def _position(position: Any) -> int:
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"GuardedStep: position must be an integer >= 0, got {position!r}")
    return position
