"""Replay one training step of a finished or interrupted run, bit for bit (``fp8lab replay``).

``replay_step(run_dir, step)`` rebuilds the run from what its folder holds -- the configuration,
recipe and corpus fingerprint inside its checkpoints, the data cursor and one-shot fault record of
the loop state -- starts from the newest checkpoint taken at or before ``step`` (``checkpoint.pt``
or a guarded run's ``checkpoints/step-NNNNNN.pt``; without one, from the initial weights, which
depend on the seed only), trains up to ``step`` and runs that step under the anomaly guard's
detectors (policy off: nothing is changed). The loss and gradient norm are compared with the
run's metrics record of that step: equal bits mean the step was reproduced.

``step`` is the 0-based step index, as ``--grad-spike-step``; its metrics record has
``"step": step + 1`` (steps done).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fp8lab.lab import checkpoint as ckpt
from fp8lab.lab.checkpoint import CHECKPOINT, CHECKPOINTS, checkpoint_config, mismatch_message
from fp8lab.lab.data import load_corpus
from fp8lab.lab.loop import LoopState, make_step, next_batch, read_metrics, train_step
from fp8lab.lab.machine import deterministic_kernels, torch_device
from fp8lab.lab.parts import build_run_parts
from fp8lab.lab.train import LabConfig

__all__ = ["replay_step"]


def _load(path: Path) -> dict[str, Any]:
    """A checkpoint's contents; ValueError naming the file and the fix when it cannot be read
    (truncated, corrupt, or not fp8lab's), as `fp8lab compare` says on resume."""
    if path.parent.name == CHECKPOINTS:  # a kept older checkpoint: replay can do without
        fix = (f"delete {path} (replay then starts from an earlier checkpoint or the "
               "initial weights)")  # fmt: skip
    else:
        fix = (f"restore it, or delete the run folder {path.parent} and rerun the same "
               "`fp8lab compare` command to train the run again")  # fmt: skip
    state = ckpt.read(path, f"; {fix}", check=False)
    if not isinstance(state, dict) or not {"config", "model", "loop"} <= set(state):
        raise ValueError(f"{path}: not an fp8lab run checkpoint")
    return state


def _candidates(run: Path) -> list[Path]:
    out = [run / CHECKPOINT] if (run / CHECKPOINT).exists() else []
    if (run / CHECKPOINTS).is_dir():
        out += sorted((run / CHECKPOINTS).glob("step-*.pt"))
    return out


def _recipe(settings: dict[str, Any]) -> Any:
    if settings.get("name") == "fp32-torch" and "input" not in settings:
        return None
    from fp8lab.recipe import Recipe

    return Recipe.from_dict(settings)


def _undone_faults(events: list[dict[str, Any]], injected: list[str]) -> list[str]:
    """Faults whose step a rollback undid: the final trajectory replayed them clean."""
    out = []
    for f in injected:
        t = int(f.rsplit("@", 1)[1])
        if any(e["action"] == "rollback" and e["to_step"] <= t <= e["step"] for e in events):
            out.append(f)
    return out


def _start(paths: list[Path], step: int) -> tuple[Path, int] | None:
    """The newest checkpoint at or before ``step`` and its steps done (None: none)."""
    start = None
    for p in paths:
        done = int(_load(p)["loop"]["step"])
        if done <= step and (start is None or done > start[1]):
            start = (p, done)
    return start


def replay_step(run_dir: str | Path, step: int) -> dict[str, Any]:
    """Replay step ``step`` (0-based) of the run in ``run_dir`` (``OUT/runs/RECIPE``); return
    ``{recipe, step, record_step, start_step, checkpoint, batch, loss, grad_norm, record,
    matches_record, signals, findings, torch_device}`` (see the module doc). Raises ValueError for a folder
    without a checkpoint, a step beyond the run, or a training text that changed. On a GPU it
    runs with deterministic kernels, as the run did (`fp8lab.lab.machine.deterministic_kernels`).
    """
    with deterministic_kernels(torch_device()):
        return _replay(Path(run_dir), step)


def _replay(run: Path, step: int) -> dict[str, Any]:
    """`replay_step` under its kernel settings."""
    if not run.is_dir():
        raise ValueError(f"{run}: no such run folder (expected OUT/runs/RECIPE)")
    paths = _candidates(run)
    if not paths:
        raise ValueError(f"{run}: no checkpoint.pt; not an fp8lab run folder (OUT/runs/RECIPE)")
    newest = _load(run / CHECKPOINT) if (run / CHECKPOINT).exists() else _load(paths[-1])
    cfg = LabConfig.from_dict(newest["config"]["lab"])
    if not (isinstance(step, int) and 0 <= step < cfg.train.steps):
        raise ValueError(f"--step {step}: the run has steps 0..{cfg.train.steps - 1}")
    recipe = _recipe(newest["config"]["recipe"])
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    ckpt_cfg = checkpoint_config(cfg, recipe, corpus)
    why = mismatch_message(newest["config"], ckpt_cfg)
    if why:
        raise ValueError(f"{run}: cannot replay here: {why}")
    start = _start(paths, step)
    tc = cfg.train
    from fp8lab.guard import AnomalyGuard

    guard_cfg = dict(newest.get("guard_config") or AnomalyGuard().to_dict())
    parts = build_run_parts(cfg, recipe, {**guard_cfg, "policy": "off"})
    model, opt, scaler, grun, injector = (parts.model, parts.opt, parts.scaler, parts.grun,
                                          parts.injector)  # fmt: skip
    if start is not None:
        loop = ckpt.load(start[0], ckpt_cfg, model, opt, scaler, prepare=grun.prepare_load)
        st = LoopState(**loop)
    else:  # from the initial weights; the final run's sticky loop fields still hold
        loop = newest["loop"]
        st = LoopState(skip_batches=list(loop.get("skip_batches", [])))
        st.injected = _undone_faults(loop.get("guard_events", []), loop.get("injected", []))
        grun.apply_escalations(list(loop.get("escalations", [])))
    ts, watch = make_step(model, opt, scaler, injector, st, tc.grad_clip, tc.stats_every,
                          recipe, parts.dp, grun)  # fmt: skip
    try:
        while True:
            batch = next_batch(st.cursor, st.skip_batches)  # the index train_step trains on
            rec, _ = train_step(ts, watch, st, corpus, cfg)
            if st.step - 1 == step:
                break
            grun.monitor.accept()
            grun.monitor.end_step()
    finally:
        injector.remove()
    records = {r["step"]: r for r in read_metrics(run)}
    logged = records.get(step + 1)
    same = logged is not None and all(
        _same(rec[k], logged.get(k)) for k in ("train_loss", "grad_norm")
    )
    return {
        "run": str(run),
        "recipe": newest["config"]["recipe"].get("name"),
        "step": step,
        "record_step": step + 1,
        "start_step": 0 if start is None else start[1],
        "checkpoint": None if start is None else str(start[0]),
        "batch": batch,
        "loss": rec["train_loss"],
        "grad_norm": rec["grad_norm"],
        "record": None
        if logged is None
        else {k: logged.get(k) for k in ("train_loss", "grad_norm", "guard_events")},
        "matches_record": same,
        "signals": {k: v for k, v in grun.monitor.signals.items() if k != "step"},
        "findings": [f.to_dict() for f in grun.findings],
        "torch_device": str(torch_device()),
    }


def _same(a: Any, b: Any) -> bool:
    """Bit-equal as logged (JSON floats round-trip exactly; non-finite numbers are null)."""
    if a is None or b is None:
        return a is None and b is None
    return json.dumps(a) == json.dumps(b) and not (isinstance(a, float) and math.isnan(a))
