"""`FP8LabCallback` for Lightning (``pip install fp8lab[lightning]``).

::

    fp8lab.nn.convert(lit_module, "te-delayed")
    cb = FP8LabCallback(guard=fp8lab.AnomalyGuard(checkpoint_every=50), watch_every=50)
    lightning.Trainer(callbacks=[cb], ...).fit(lit_module, data)
    cb.records, cb.events  # the lab's watch records and guard_events

The same duties as `fp8lab.integrations.hf.FP8LabCallback`, at Lightning's hooks (automatic
optimization, one optimizer): the loss from ``on_before_backward`` (the mean over
``accumulate_grad_batches``), the detectors in ``on_before_optimizer_step`` (before Lightning's
gradient clipping, so the norm is the lab's: before clipping), the skip / rollback decision at
``on_train_batch_end`` of the step's last micro-batch. When the guard acts, the gradients are
set to None so the optimizer step changes nothing; a rollback restores the LightningModule,
optimizer (its moments; the learning rate stays the schedule's) and RNG from the last-good
snapshot, while Lightning's step counter (the guard counts steps as ``trainer.global_step``),
learning-rate schedule and data order go on. Checkpoints: the converted layers' FP8 state is
part of the module's ``state_dict`` (``fp8_*`` tensors) and the guard's state is this callback's
``state_dict`` (plain data), both in Lightning's checkpoint and restored by ``ckpt_path=``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from fp8lab.guard import AnomalyGuard
from fp8lab.integrations._core import DEFAULT_GUARD, CoreCallback

__all__ = ["FP8LabCallback"]


class FP8LabCallback(CoreCallback, Callback):
    """Watch statistics, the anomaly guard and its state in checkpoints for Lightning (see the
    module doc). ``guard``: an `fp8lab.AnomalyGuard` (default: every detector, policy
    ``"rollback"``; None: watch only); ``watch_every``: operand statistics every N optimizer
    steps (0 = off)."""

    def __init__(self, guard: AnomalyGuard | None = DEFAULT_GUARD, watch_every: int = 0) -> None:  # type: ignore[assignment]
        CoreCallback.__init__(self, guard, watch_every)
        self._in_step = False  # step_begin ran, the optimizer step has not
        self._decide = False  # the optimizer step ran, the decision is due
        self._loaded: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.core.remember(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1 or not pl_module.automatic_optimization:
            raise ValueError(
                "fp8lab FP8LabCallback: Lightning with automatic optimization and one optimizer "
                f"only (got {len(trainer.optimizers)} optimizers, automatic_optimization="
                f"{pl_module.automatic_optimization}); a manual loop can use fp8lab.GuardedStep"
            )
        self.core.start(pl_module, trainer.optimizers[0], None, step=trainer.global_step)
        if self._loaded is not None:  # resumed with ckpt_path: model and optimizer are loaded
            self.core.load_state(self._loaded)
            self.core.snapshot()
            self._loaded = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._in_step:
            self.core.step_begin()
            self._in_step = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Lightning divides each micro-batch's loss by accumulate_grad_batches: undo it here
        self.core.add_loss(loss.detach() * trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.core.before_update()
        self._in_step, self._decide = False, True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._decide:
            self._decide = False
            self.core.step_end(trainer.global_step)
            self.core.take_events()  # kept in `events`; Lightning's loggers are the user's

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.core.close()
        self._in_step = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)  # applied at on_train_start, once the guard exists
