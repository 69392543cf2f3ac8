"""`fp8lab.guard`: keep FP8 runs alive -- detect numerical anomalies, then skip, roll back or
escalate (docs/guard.md).

* :class:`AnomalyGuard` -- the configuration (detectors and thresholds, policy off / skip /
  rollback, last-good checkpoints, escalation), passed to
  ``fp8lab.lab.train.train_run(..., guard=...)`` or ``fp8lab compare --guard``.
* :class:`GuardMonitor` -- the runtime of one run: signals and findings per step, the
  delayed-scaling restart (zero history, one current-scaling step, then delayed again).
* :mod:`fp8lab.guard.detectors` -- one pure function per detector.
* :class:`GuardedStep` -- the guard around a user's own training step (``.step(closure)``);
  :class:`GuardSession` -- the one definition of snapshots, skip, rollback and escalation;
  :class:`GuardHook` -- that session as a hook of `fp8lab.step.TrainStep`, the one step the
  lab's loop, `GuardedStep` and the framework callbacks (`fp8lab.integrations`) run.
* :class:`Snapshots` and :func:`current_scaling_rule` -- last-good in-memory checkpoints and
  the per-layer recipe rule an escalation adds.

Layer: above ``nn``/``observe`` and ``fp8lab.step`` (it reads their state; it is a hook of
the step), below ``lab`` and ``integrations`` (which run it).
"""

from fp8lab.guard.config import DETECTOR_DEFAULTS, ON_RESTART, POLICIES, AnomalyGuard
from fp8lab.guard.detectors import Finding
from fp8lab.guard.guarded_step import GuardedStep, GuardState, StepResult
from fp8lab.guard.hook import GuardHook
from fp8lab.guard.monitor import GuardMonitor, delayed_states, layer_states
from fp8lab.guard.restart import Snapshots, current_scaling_rule
from fp8lab.guard.session import GuardSession

__all__ = [
    "DETECTOR_DEFAULTS",
    "ON_RESTART",
    "POLICIES",
    "AnomalyGuard",
    "Finding",
    "GuardHook",
    "GuardMonitor",
    "GuardSession",
    "GuardState",
    "GuardedStep",
    "Snapshots",
    "StepResult",
    "current_scaling_rule",
    "delayed_states",
    "layer_states",
]
