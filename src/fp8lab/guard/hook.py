"""`GuardHook`: the anomaly guard as a `fp8lab.step.TrainStep` hook -- one definition for the
lab's loop (`fp8lab.lab.loop`), a user's loop (`fp8lab.guard.GuardedStep`) and the framework
callbacks (`fp8lab.integrations`, which call the same hooks at the framework's events).

It is a `fp8lab.guard.session.GuardSession` (detectors, last-good snapshots, skip, rollback,
escalation) with three hook methods: ``on_before_forward`` remembers the scaling state (and, on
the steps that measure them and for a model with converted layers, collects the per-operand
underflow / saturation %), ``on_before_optimizer_step`` runs the detectors and vetoes the update
when the guard acts, ``on_checkpoint`` adds the guard's state. The loop calls
`GuardSession.after_step` once the step is counted (skip, rollback, escalation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fp8lab.guard.config import AnomalyGuard
from fp8lab.guard.session import GuardSession
from fp8lab.step import ScopedHook, StepContext

__all__ = ["GuardHook", "as_guard"]


def as_guard(guard: Any, what: str) -> AnomalyGuard:
    """``guard`` as an `AnomalyGuard` (its plain dict is read with `AnomalyGuard.from_dict`);
    TypeError naming ``what`` for anything else, e.g. the policy's name alone."""
    if isinstance(guard, Mapping):
        return AnomalyGuard.from_dict(guard)
    if not isinstance(guard, AnomalyGuard):
        hint = (f" (a policy name: AnomalyGuard(policy={guard!r}))"
                if isinstance(guard, str) else "")  # fmt: skip
        raise TypeError(
            f"{what}: guard must be an fp8lab.AnomalyGuard{hint}, got {type(guard).__name__} "
            f"{guard!r}"
        )
    return guard


class GuardHook(ScopedHook, GuardSession):
    """The guard of one run as a `fp8lab.step.TrainStep` hook (see the module doc); the
    arguments are `GuardSession`'s."""

    def __init__(
        self,
        guard: AnomalyGuard,
        model: torch.nn.Module,
        opt: Any,
        scaler: Any,
        recipe: Any = None,
        stateful: Mapping[str, Any] | None = None,
    ) -> None:
        from fp8lab.nn import converted

        GuardSession.__init__(self, guard, model, opt, scaler, recipe, stateful)
        self._rows = bool(converted(model))  # operand percentages need converted layers

    def on_before_forward(self, ctx: StepContext) -> None:
        """Remember the scaling state; on the steps that measure them, collect the per-operand
        underflow / saturation % (per-rank numbers under torchrun: `agree` settles them)."""
        self.before_step()
        if self._rows and self.wants_rows(ctx.step):
            from fp8lab.guard.percent import operand_percentages

            ctx.extra["guard_rows"] = self.enter(operand_percentages())

    def on_before_optimizer_step(self, ctx: StepContext) -> bool:
        """Run the detectors; False (veto the update) when the guard acts on a finding."""
        return not self.check(ctx.step, ctx.loss_value, ctx.grad_norm, ctx.extra.get("guard_rows"))

    def on_checkpoint(self, ctx: StepContext, state: dict[str, Any]) -> None:
        state.update(self.checkpoint_extra())
