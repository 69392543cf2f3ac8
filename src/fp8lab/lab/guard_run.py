"""The anomaly guard inside the lab's training loop (`fp8lab.lab.train.train_run(guard=...)`):
`GuardRun` is `fp8lab.guard.session.GuardSession` (detectors, last-good snapshots, skip,
rollback and escalation: one definition with `fp8lab.guard.GuardedStep` and the framework
callbacks) as a `fp8lab.lab.step.TrainStep` hook. Detectors: `fp8lab.guard`; docs/guard.md.

``before_forward`` remembers the scaling state (and collects the operand percentages on the
steps that measure them), ``before_optimizer_step`` runs the detectors (`GuardRun.check`) and
vetoes the update when the guard acts, ``on_checkpoint`` adds its state. A loop (the lab's
`fp8lab.lab.loop.run_loop`, or a user's) calls `GuardRun.after_step` once the step is counted,
and on ``"rollback"`` drops the abandoned steps' records. What happened stays in the loop
state's *sticky* fields (`STICKY`), which a rollback never rewinds: ``guard_events``,
``injected`` (one-shot faults that fired), ``skip_batches`` and ``escalations``.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8lab.guard import AnomalyGuard
from fp8lab.guard.session import STICKY, GuardSession, agree
from fp8lab.lab.step import ScopedHook

__all__ = ["STICKY", "GuardRun", "agree"]


class GuardRun(ScopedHook, GuardSession):
    """The guard of one `train_run` (see the module doc); a `fp8lab.lab.step.TrainStep` hook
    (the step's detectors and veto), the loop calling `after_step` (skip, rollback, escalation)."""

    def __init__(
        self, guard: AnomalyGuard, model: torch.nn.Module, opt: Any, scaler: Any, recipe: Any
    ) -> None:
        GuardSession.__init__(self, guard, model, opt, scaler, recipe)

    # ------------------------------------------------------------------ TrainStep hooks
    def before_forward(self, ctx: Any) -> None:
        """Remember the scaling state; on the steps that measure them, collect the per-operand
        underflow / saturation % (per-rank numbers under torchrun: `agree` settles them)."""
        self.before_step()
        if self.recipe is not None and self.wants_rows(ctx.step):
            from fp8lab.guard.percent import operand_percentages

            ctx.extra["guard_rows"] = self.enter(operand_percentages())

    def before_optimizer_step(self, ctx: Any) -> bool:
        """Run the detectors; False (veto the update) when the guard acts on a finding."""
        return not self.check(ctx.step, ctx.loss_value, ctx.grad_norm, ctx.extra.get("guard_rows"))

    def on_checkpoint(self, ctx: Any, state: dict[str, Any]) -> None:
        state.update(self.checkpoint_extra())
