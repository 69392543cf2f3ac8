"""`FP8LabCallback` for the HF ``transformers`` ``Trainer`` (``pip install fp8lab[hf]``).

::

    model = fp8lab.nn.convert(model, "te-delayed")
    cb = FP8LabCallback(guard=fp8lab.AnomalyGuard(checkpoint_every=50), watch_every=50)
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    cb.records  # the operand statistics (the lab's watch records)
    cb.events   # what the guard did (the lab's guard_events records)

* **watch**: every ``watch_every`` optimizer steps, the operand statistics of the step's forward
  and backward (`fp8lab.observe.sample`: the same records as the lab's for the same model and
  batch), in ``records``;
* **guard**: the lab's detectors, skip / rollback / escalation (`fp8lab.guard.session`). The
  loss is read from the model's output (``.loss``, as transformers models return it; the mean
  over gradient-accumulation micro-batches), the gradient norm before the Trainer's clipping
  (with ``max_grad_norm > 0``: summed from per-parameter hooks on the step's last backward, as
  the lab measures it), the detectors in ``on_pre_optimizer_step``. When the guard acts, the
  gradients are set to None so the Trainer's ``optimizer.step()`` changes nothing; a rollback
  restores model, optimizer (its moments; the learning rate stays the schedule's) and RNG from
  the last-good snapshot at ``on_step_end``. The guard counts steps as the Trainer does
  (``state.global_step``); the Trainer's step counter, learning-rate schedule and data order go
  on: rolled-back steps' batches are not replayed. Each guard event also goes to the Trainer's
  ``state.log_history`` as ``{"fp8lab_guard": event, "step": global_step}`` (so it is in
  ``trainer_state.json``);
* **checkpoints**: ``on_save`` writes `fp8lab.nn.FP8_STATE_FILE` (the converted layers'
  scaling state, safetensors) and ``fp8lab_guard.json`` into ``checkpoint-N``; a run resumed
  from it restores both at ``on_train_begin``, from the directory given to
  ``trainer.train(resume_from_checkpoint=PATH)`` (wherever it is; ``True``: the Trainer's
  latest checkpoint), else from ``TrainingArguments.resume_from_checkpoint``, else from
  ``output_dir/checkpoint-N``;
* **accelerate**: a model whose fp8lab layers ``mixed_precision="fp8"`` replaced is refused
  (`fp8lab.integrations.accelerate.check_prepared`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from fp8lab.guard import AnomalyGuard
from fp8lab.integrations._core import DEFAULT_GUARD, CoreCallback

__all__ = ["FP8LabCallback"]


def _loss_of(output: Any) -> Any:
    """The ``loss`` of a model output: a transformers ModelOutput, a dict or an object with
    ``loss``, or a tuple whose first element is a scalar tensor (the Trainer's ``outputs[0]``)."""
    if isinstance(output, Mapping):
        return output.get("loss")
    if isinstance(output, tuple | list) and output:
        first = output[0]
        return first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
    return getattr(output, "loss", None)


def _resume_path() -> str | None:
    """The checkpoint directory the running ``Trainer.train`` resumes from: the one given to
    ``train(resume_from_checkpoint=...)`` (``True`` already resolved to the latest), read from
    the Trainer's own training-loop frame, since a callback is never told; None when not
    found."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        if "resume_from_checkpoint" in local and isinstance(local.get("self"), Trainer):
            where = local["resume_from_checkpoint"]
            return os.fspath(where) if isinstance(where, str | os.PathLike) else None
        frame = frame.f_back
    return None


def _resume_dir(args: Any, global_step: int) -> str:
    """Where a resumed run's fp8lab state is: the path given to ``train()``, else the
    ``TrainingArguments`` field, else ``output_dir/checkpoint-N``."""
    for where in (_resume_path(), args.resume_from_checkpoint):
        if isinstance(where, str) and os.path.isdir(where):
            return where
    return os.path.join(args.output_dir, f"checkpoint-{global_step}")


class FP8LabCallback(CoreCallback, TrainerCallback):
    """Watch statistics, the anomaly guard and FP8 state in checkpoints for the HF Trainer
    (see the module doc). ``guard``: an `fp8lab.AnomalyGuard` (default: every detector, policy
    ``"rollback"``; None: watch only); ``watch_every``: operand statistics every N optimizer
    steps (0 = off)."""

    def __init__(self, guard: AnomalyGuard | None = DEFAULT_GUARD, watch_every: int = 0) -> None:  # type: ignore[assignment]
        CoreCallback.__init__(self, guard, watch_every)
        self._hook: Any = None
        self._grad_hooks: list[Any] = []
        self._sq: list[torch.Tensor] = []  # per-parameter gradient norms of this step

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        if model is not None:  # before accelerator.prepare: which layers fp8lab converted
            self.core.remember(model)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
        lr_scheduler: Any = None, **kw: Any,
    ) -> None:  # fmt: skip
        self.core.start(model, optimizer, None, step=state.global_step)
        if state.global_step > 0:  # resumed: the checkpoint this run continues from
            self.core.resume(_resume_dir(args, state.global_step))
        if self._hook is None:
            self._hook = model.register_forward_hook(self._on_forward)
        if args.max_grad_norm and args.max_grad_norm > 0 and self.core.session is not None:
            self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                                for p in model.parameters() if p.requires_grad]  # fmt: skip

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():  # evaluation forwards do not count
            loss = _loss_of(output)
            if loss is not None:
                self.core.add_loss(loss)

    def _on_grad(self, p: torch.Tensor) -> None:
        # the Trainer clips before on_pre_optimizer_step: the lab's norm (before clipping) is
        # taken here, on the step's last micro-batch, whose backward completes the gradients
        from accelerate.state import GradientState

        if GradientState().sync_gradients and p.grad is not None:
            self._sq.append(torch.linalg.vector_norm(p.grad.detach().float()))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._sq = []
        self.core.step_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        before = float(torch.linalg.vector_norm(torch.stack(self._sq))) if self._sq else None
        self.core.before_update(before)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.core.step_end(state.global_step)
        for event in self.core.take_events():  # into trainer_state.json with the Trainer's logs
            state.log_history.append({"fp8lab_guard": event, "step": state.global_step})

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if args.should_save:  # the main process writes, as the Trainer does
            self.core.save(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.core.close()
        for h in [self._hook, *self._grad_hooks]:
            if h is not None:
                h.remove()
        self._hook, self._grad_hooks = None, []
