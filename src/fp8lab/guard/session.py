"""`GuardSession`: the anomaly guard of one training run, whoever runs the loop -- last-good
snapshots, skip, rollback and escalation around `GuardMonitor`'s detectors (docs/guard.md).

One definition for every loop: `fp8lab.guard.hook.GuardHook` makes it a hook of the one
training step, `fp8lab.step.TrainStep`, which the lab's loop, a user's loop
(`fp8lab.guard.GuardedStep`) and the framework callbacks (`fp8lab.integrations`) all run. Per step a loop calls `before_step` (and, on the steps
`wants_rows` names, collects the operand percentages), `check` after backward and clipping
(True: do not apply the update), and `after_step(st)` once the step is counted. ``st`` is the
loop's state: ``step`` (steps done), ``cursor`` (the batch index of the next step) and the
*sticky* fields `STICKY`, which a rollback never rewinds: ``guard_events``, ``injected``,
``skip_batches``, ``escalations``. A rollback restores model (weights and delayed-scaling
state), optimizer, loss scaler, torch RNG, any `stateful` objects, the loop's other fields and
the detectors' statistics from the newest snapshot at or before the offending step (the n-th
rollback within ``window`` steps goes n snapshots back), then restarts the flagged
delayed-scaling histories (``on_restart``). An anomaly that comes back on the replay of its own
step is reproducible: the guard escalates (or skips the batch) at once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from fp8lab.distributed.runtime import agree_any, world_size
from fp8lab.guard.config import AnomalyGuard
from fp8lab.guard.detectors import Finding
from fp8lab.guard.monitor import GuardMonitor
from fp8lab.guard.restart import Snapshots, current_scaling_rule

__all__ = ["STICKY", "GuardSession", "agree", "dynamic_scaler"]

#: loop-state fields a rollback keeps (everything else is restored from the snapshot)
STICKY = ("injected", "guard_events", "skip_batches", "escalations")


def _loop_fields(st: Any) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in vars(st).items() if k not in STICKY}


def agree(findings: list[Finding]) -> list[Finding]:
    """The findings every rank acts on: the union of all ranks' findings (rank order, then each
    rank's order; one per detector and tensor), the same list on every rank. The loss, the
    gradient norm and (with ``--amax-group world``) the amaxes are global, but per-rank
    signals (local amaxes with ``--amax-group none``, a rank's own operand percentages) can
    differ, and ranks that decided apart would roll back to different states. One all-reduce
    of a flag per step; the findings themselves are gathered only when a rank has one.
    Without torch.distributed (or on one rank): ``findings``."""
    if world_size() == 1:
        return findings
    if not agree_any(bool(findings)):
        return []
    everyone: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(everyone, [f.to_dict() for f in findings])
    out, seen = [], set()
    for rank_findings in everyone:
        for f in rank_findings:
            if (f["detector"], f["tensor"]) not in seen:
                seen.add((f["detector"], f["tensor"]))
                out.append(Finding(**f))
    return out


def dynamic_scaler(scaler: Any) -> bool:
    """Whether ``scaler`` backs off by itself on an overflow: a dynamic `fp8lab.optim.LossScaler`
    or an enabled ``torch.amp.GradScaler`` (then a gradient overflow is routine until it
    repeats)."""
    if scaler is None:
        return False
    if isinstance(scaler, torch.amp.GradScaler):
        return bool(scaler.is_enabled())
    return bool(getattr(scaler, "dynamic", False))


class GuardSession:
    """The guard of one run (see the module doc). ``recipe``: the run's recipe, which an
    escalation extends by per-layer rules (`effective_recipe`); None (a user's converted model)
    extends each escalated layer's own recipe. ``stateful``: more objects with
    ``state_dict``/``load_state_dict`` (a learning-rate scheduler) that snapshots hold and a
    rollback restores."""

    def __init__(
        self,
        guard: AnomalyGuard,
        model: torch.nn.Module,
        opt: Any,
        scaler: Any,
        recipe: Any,
        stateful: Mapping[str, Any] | None = None,
    ) -> None:
        self.guard = guard
        self.model, self.opt, self.scaler, self.recipe = model, opt, scaler, recipe
        self.stateful = dict(stateful or {})
        self.monitor = GuardMonitor(guard, model, dynamic_scaler=dynamic_scaler(scaler))
        self.snapshots = Snapshots(guard.keep)
        self.findings: list[Any] = []
        self.pending: list[dict[str, Any]] = []  # events not yet attached to a metrics record
        self.effective_recipe = recipe

    @property
    def acts(self) -> bool:
        return self.guard.policy != "off"

    # ------------------------------------------------------------------ per step
    def wants_rows(self, step: int) -> bool:
        return self.monitor.wants_rows(step)

    def before_step(self) -> None:
        self.monitor.before_step()

    def check(self, step: int, loss: float, grad_norm: float, rows: Any = None) -> bool:
        """Run the detectors on step ``step``; True when the update must not be applied. Under
        torch.distributed every rank acts on the same findings (`agree`)."""
        self.findings = self.monitor.check(step, loss, grad_norm, rows)
        if self.acts:
            self.findings = agree(self.findings)
        return bool(self.findings) and self.acts

    def take_events(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out

    def after_step(self, st: Any) -> str | None:
        """Act on the findings of the step just counted (``st.step`` steps done): None (kept),
        ``"skip"`` or ``"rollback"`` (``st`` and the model were restored)."""
        if not self.findings or not self.acts:
            self.monitor.accept()
            self.monitor.end_step()
            if st.step % self.guard.checkpoint_every == 0:
                self.snapshot(st)
            return None
        t, batch = st.step - 1, st.cursor - 1
        first = self.findings[0]
        tensors = sorted({f.tensor for f in self.findings if f.tensor and ":" in f.tensor})
        base = {"step": t, "detector": first.detector, "tensor": first.tensor,
                "value": first.value, "threshold": first.threshold, "batch": batch}  # fmt: skip
        restart = self.guard.on_restart != "keep"
        if self.guard.policy == "skip":
            return self._skip(st, base, tensors, restart)
        recent = [e for e in st.guard_events
                  if e["action"] == "rollback" and e["step"] > t - self.guard.window]  # fmt: skip
        skip_batch = self.guard.on_restart == "skip_batch"
        pins: list[list[str]] = []
        if len(recent) >= 2 * self.guard.max_rollbacks:
            # escalating and skipping batches did not help: stop rolling back (no endless loop);
            # from here the offending updates are skipped
            return self._skip(st, base, tensors, restart)
        # the replay after a rollback ran into the same anomaly on the same step: it is
        # reproducible, not a transient fault (Megatron-LM re-runs a step to tell the two
        # apart), and rolling back again would only replay it: escalate (or skip the batch) now
        last = st.guard_events[-1] if st.guard_events else None
        reproduced = last is not None and last["action"] == "rollback" and last["step"] == t
        if len(recent) >= self.guard.max_rollbacks or reproduced:
            done = {tuple(p) for p in st.escalations}
            delayed = set(self.monitor.tensor_names)  # only delayed scaling can be pinned
            pins = [list(x.rsplit(":", 1)) for x in tensors if x in delayed]
            pins = [p for p in pins if tuple(p) not in done]
            if self.guard.escalate and pins:
                for layer, key in pins:
                    self._event(st, {"action": "escalate", **base, "tensor": f"{layer}:{key}",
                                     "pinned": "current"})  # fmt: skip
            else:
                pins = []
                skip_batch = True
                self._event(st, {"action": "skip", **base, "reset": []})
        snap = self.snapshots.pick(t, back=len(recent))
        if snap is None:  # nothing to go back to: do not apply the update, as skip does
            return self._skip(st, base, tensors, restart)
        to_step, payload = snap
        self.restore(st, payload)
        if pins:
            st.escalations.extend(pins)
            self.apply_escalations(st.escalations)
            self.snapshots.clear()
            self.snapshot(st)
        else:
            self.snapshots.drop_after(to_step)
        if skip_batch and batch not in st.skip_batches:
            st.skip_batches.append(batch)
        reset = self.monitor.reset_scaling(tensors) if restart else []
        self._event(st, {"action": "rollback", **base, "to_step": to_step, "reset": reset,
                         "skip_batch": skip_batch})  # fmt: skip
        return "rollback"

    def _skip(self, st: Any, base: dict[str, Any], tensors: list[str], restart: bool) -> str:
        """The update was not applied; restart the flagged delayed histories."""
        reset = self.monitor.reset_scaling(tensors) if restart else []
        self.monitor.end_step()
        self._event(st, {"action": "skip", **base, "reset": reset})
        return "skip"

    def _event(self, st: Any, event: dict[str, Any]) -> None:
        v = event.get("value")
        event["value"] = v if v is None or math.isfinite(v) else None
        st.guard_events.append(event)
        self.pending.append(event)

    # ------------------------------------------------------------------ snapshots
    def payload(self, st: Any) -> dict[str, Any]:
        """Everything a rollback restores (references: `Snapshots.save` deep-copies)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "torch_rng": torch.get_rng_state(),
            # a run on a GPU draws its dropout masks from the CUDA generators
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            "loop": _loop_fields(st),
            "guard": self.monitor.state_dict(),
            "stateful": {k: obj.state_dict() for k, obj in self.stateful.items()},
        }

    def snapshot(self, st: Any) -> None:
        self.snapshots.save(st.step, self.payload(st))

    def restore(self, st: Any, payload: dict[str, Any]) -> None:
        self.model.load_state_dict(payload["model"])
        self.opt.load_state_dict(copy.deepcopy(payload["optimizer"]))
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(payload["scaler"]))
        torch.set_rng_state(payload["torch_rng"])
        if payload.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(payload["cuda_rng"])
        for k, obj in self.stateful.items():
            obj.load_state_dict(copy.deepcopy(payload["stateful"][k]))
        for k, v in payload["loop"].items():
            setattr(st, k, copy.deepcopy(v))
        self.monitor.load_state_dict(payload["guard"])

    # ------------------------------------------------------------------ escalation
    def apply_escalations(self, pins: list[list[str]]) -> None:
        """Pin each ``[layer, key]`` to current scaling: a per-layer rule on the run's recipe
        (the effective recipe), given to the named layers (their other delayed states kept).
        Without a run recipe each named layer's own recipe takes the rules."""
        from fp8lab.nn import Linear

        if not pins:
            return
        rules = [current_scaling_rule(layer, key) for layer, key in pins]
        if self.recipe is not None:
            self.effective_recipe = self.recipe.with_layers(*rules)
        layers = {layer for layer, _ in pins}
        for name, mod in self.model.named_modules():
            if isinstance(mod, Linear) and (mod.name or name) in layers:
                own = mod.recipe.with_layers(*rules)  # resolved for this layer's name
                mod.set_recipe(self.effective_recipe if self.recipe is not None else own,
                               keep_state=True)  # fmt: skip
        self.monitor.refresh()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint holds of the guard: detector statistics, the configuration
        (`fp8lab replay` runs the same detectors) and the states mid-restart."""
        return {
            "guard": self.monitor.state_dict(),
            "guard_config": self.guard.to_dict(),
            "guard_pinned": self.monitor.pinned_names(),
        }

    def prepare_load(self, state: dict[str, Any]) -> None:
        """Before a checkpoint's model state loads: re-apply its escalations (their layers'
        state was saved under the escalated recipe) and restore the detectors' statistics."""
        self.apply_escalations(list(state.get("loop", {}).get("escalations", [])))
        if state.get("guard") is not None:
            self.monitor.load_state_dict(state["guard"])
        self.monitor.pin_current(state.get("guard_pinned", []))
