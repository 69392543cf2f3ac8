"""The lab's run loop: resume, the steps (`fp8lab.step.TrainStep` with the lab's hooks),
evaluation, the metrics and stats files, the checkpoint cadence and the anomaly guard's rollback
bookkeeping. `fp8lab.lab.parts.build_run_parts` builds a run's objects (for training, `fp8lab
replay` and the debugger's step replay alike) and `fp8lab.lab.train.train_run` hands them to
`run_loop`; the file formats are described there. `next_batch` is the one rule for the batch a
step trains on."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab import checkpoint as ckpt
from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab.data import Corpus, get_batch, val_batches
from fp8lab.lab.inject import InjectionHook, Injector
from fp8lab.lab.parts import RunParts, write_resolved_recipe
from fp8lab.stats import json_safe
from fp8lab.step import TrainStep, WatchHook

Callback = Callable[[dict[str, Any]], None]
METRICS = "metrics.jsonl"
STATS = "stats.jsonl"


def _num(x: float | None) -> float | None:
    """JSON-safe number: non-finite -> None."""
    return x if x is not None and math.isfinite(x) else None


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats/byte) over fixed validation batches.

    Runs under ``no_grad``, where converted layers discard the forward amaxes instead of
    updating their delayed scales, so evaluating never changes the training trajectory
    (tested: a run evaluated every step equals one evaluated at the end only)."""
    was_training = model.training
    model.eval()
    try:
        losses = [float(model(x, y)[1]) for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only records with step <= max_step (work done after the last checkpoint is redone)."""
    records = [r for r in _read_jsonl(path) if r["step"] <= max_step]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics records (metrics.jsonl), [] before any."""
    return _read_jsonl(Path(run_dir) / METRICS)


def read_stats(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's operand statistics records (stats.jsonl), [] before any."""
    return _read_jsonl(Path(run_dir) / STATS)


#: nats above ln(vocab_size) a final validation loss may sit without counting as diverged: an
#: untrained model guesses nearly uniformly (the GPT after 2 steps: 5.5501 vs ln 256 = 5.5452),
#: a diverged one is far above (3449 in issue 11); 0.5 nats = 1.65x less likely than uniform
DIVERGED_MARGIN_NATS = 0.5


def diverged_loss(final_train: float | None, final_val: float | None, vocab_size: int) -> bool:
    """The loss rule of divergence: a non-finite (None) final loss, or a final validation loss
    more than :data:`DIVERGED_MARGIN_NATS` above ln(vocab_size) nats (clearly worse than a
    uniform guess: 6.05 for bytes)."""
    if final_train is None or final_val is None:
        return True
    return final_val > math.log(vocab_size) + DIVERGED_MARGIN_NATS


@dataclass
class RunResult:
    summary: dict[str, Any]
    model: torch.nn.Module
    records: list[dict[str, Any]]


@dataclass
class LoopState:
    step: int = 0  # steps done
    ema: float | None = None  # EMA of finite train losses (spike detector)
    skipped_steps: int = 0
    nonfinite_run: int = 0
    diverged: bool = False
    # anomaly guard (fp8lab.guard.GuardHook): the batch index of the next step (ahead of `step`
    # once batches were skipped) and the fields a rollback never rewinds
    cursor: int = 0
    injected: list[str] = field(default_factory=list)  # one-shot faults that fired ("nan@T")
    guard_events: list[dict[str, Any]] = field(default_factory=list)
    skip_batches: list[int] = field(default_factory=list)
    escalations: list[list[str]] = field(default_factory=list)  # [layer, key] pinned to current


def _timed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that measure speed: without warm-up, i.e. the first step (numba compiles or
    loads its kernels) and any step slower than 4x the median (kernels first used after a
    resume, or a newly seen shape)."""
    if len(records) < 3:
        return records
    rest = records[1:]
    med = statistics.median(r["step_time_s"] for r in rest)
    return [r for r in rest if r["step_time_s"] <= 4 * med]


def summarize(
    records: list[dict[str, Any]], steps: int, st: LoopState, vocab_size: int = 256
) -> dict[str, Any]:
    """Run summary from the per-step records.

    final_train_loss: mean train loss of the last ``min(10, steps)`` steps (one batch is noisy);
    final_val_loss: the last validation loss; tokens_per_s and step_time_ms: over the training
    steps after warm-up (see :func:`_timed`; evaluation excluded). Non-finite values are None;
    diverged: ``max_nonfinite_steps`` non-finite losses in a row, or a complete run whose final
    losses are not finite or whose validation loss exceeds ln(vocab_size).
    """
    tail = [r["train_loss"] for r in records[-min(10, len(records)) :]] if records else []
    finite_tail = [v for v in tail if v is not None]
    final_train = (
        sum(finite_tail) / len(finite_tail) if tail and len(finite_tail) == len(tail) else None
    )
    vals = [r for r in records if "val_loss" in r]
    final_val = vals[-1]["val_loss"] if vals else None
    timed = _timed(records)
    time_s = sum(r["step_time_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    complete = bool(records) and records[-1]["step"] == steps
    diverged = st.diverged or (complete and diverged_loss(final_train, final_val, vocab_size))
    return {
        "steps_done": records[-1]["step"] if records else 0,
        "complete": complete,
        "final_train_loss": final_train,
        "final_val_loss": final_val,
        "skipped_steps": records[-1]["skipped_steps"] if records else 0,
        "spikes": sum(bool(r["spike"]) for r in records),
        "tokens_per_s": tokens / time_s if time_s > 0 else None,
        "step_time_ms": 1000 * time_s / len(timed) if timed else None,
        "diverged": bool(diverged),
    }


# ----------------------------------------------------------------------------- the step
class DataParallelHook:
    """`fp8lab.distributed.ddp.DataParallel` as TrainStep hooks: each rank trains on its shard of the
    batch, the reported loss is the global batch's, the step's communication fields go to the
    metrics record (``ctx.extra["record"]``) and every rank's scaling state to the checkpoint."""

    def __init__(self, dp: Any) -> None:
        self.dp = dp

    def on_before_forward(self, ctx: Any) -> None:
        ctx.batch = self.dp.shard(*ctx.batch)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """This rank's loss (token sum / global token count) and the global loss, equal on
        every rank."""
        loss, loss_all, _ = self.dp.loss(*batch)
        return loss, loss_all

    def on_after_optimizer_step(self, ctx: Any) -> None:
        # ranks, amax group, gradient communication (collective with amax_group none)
        ctx.extra["record"] = self.dp.state()

    def on_checkpoint(self, ctx: Any, state: dict[str, Any]) -> None:
        state.update(self.dp.checkpoint_extra())  # collective: every rank's scaling state


def make_step(
    model: torch.nn.Module, opt: Any, scaler: Any, injector: Injector, st: LoopState,
    grad_clip: float, stats_every: int, recipe: Any, dp: Any = None, grun: Any = None,
) -> tuple[TrainStep, WatchHook]:  # fmt: skip
    """The lab's TrainStep: fault injection, the anomaly guard, the operand statistics (only
    for a recipe) and data parallelism as hooks, in that order."""
    params = [p for g in opt.param_groups for p in g["params"]]
    watch = WatchHook(model, stats_every if recipe is not None else 0)
    hooks: list[Any] = [InjectionHook(injector, params, st.injected)]
    hooks += [grun] if grun is not None else []
    hooks.append(watch)
    loss_fn: Any = lambda batch: model(*batch)[1]  # noqa: E731
    if dp is not None:
        hooks.append(DataParallelHook(dp))
        loss_fn = hooks[-1].loss
    return TrainStep(loss_fn, opt, scaler, grad_clip, hooks, params), watch


def next_batch(cursor: int, skip_batches: Sequence[int] = ()) -> int:
    """The index of the batch the next step trains on: ``cursor`` (the loop state's), or the
    first index after it that a guard rollback did not choose to skip."""
    skip = set(skip_batches)
    while cursor in skip:
        cursor += 1
    return cursor


def batch_at(corpus: Corpus, cfg: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training batch ``index`` of a run under ``cfg`` (`fp8lab.lab.data.get_batch`: the same
    batch for every recipe)."""
    tc = cfg.train
    return get_batch(corpus.train, tc.batch_size, cfg.model.block_size, tc.seed, index)


def train_step(
    ts: TrainStep, watch: WatchHook, st: LoopState, corpus: Corpus, cfg: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Step ``st.step`` of the run: learning rate, the next batch not skipped by a rollback,
    the TrainStep, the loop counters (spike, non-finite run); return the metrics record and
    the operand statistics rows."""
    tc = cfg.train
    step = st.step  # 0-based index of this step
    lr = tc.lr_at(step)
    for g in ts.optimizer.param_groups:
        g["lr"] = lr
    st.cursor = next_batch(st.cursor, st.skip_batches)
    batch = batch_at(corpus, cfg, st.cursor)
    st.cursor += 1
    ctx = ts(step, batch)
    loss_v = ctx.loss_value
    st.step += 1
    st.skipped_steps += int(ctx.skipped)
    spike = False
    if math.isfinite(loss_v):
        st.nonfinite_run = 0
        if st.ema is not None and loss_v > (1 + tc.spike_threshold) * st.ema:
            spike = True
        st.ema = loss_v if st.ema is None else 0.9 * st.ema + 0.1 * loss_v
    else:
        st.nonfinite_run += 1
        if st.nonfinite_run >= tc.max_nonfinite_steps:
            st.diverged = True
    rec = {
        "step": st.step,
        "lr": lr,
        "train_loss": _num(loss_v),
        "grad_norm": _num(ctx.grad_norm),
        "skipped": bool(ctx.skipped),
        "skipped_steps": st.skipped_steps,
        "loss_scale": ctx.loss_scale,
        "spike": spike,
        "tokens": tc.batch_size * cfg.model.block_size,
        "step_time_s": ctx.time_s,
    }
    rec.update(ctx.extra.get("record", {}))
    return rec, watch.rows


# ----------------------------------------------------------------------------- the run
@dataclass
class Run:
    """One run's objects (``parts``, `fp8lab.lab.parts.build_run_parts`) and files (what
    `run_loop` works on)."""

    cfg: Any
    recipe: Any
    corpus: Corpus
    parts: RunParts
    run_path: Path | None
    ckpt_cfg: dict[str, Any]
    emit: Callback
    name: str
    st: LoopState = field(default_factory=LoopState)
    records: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)  # open metrics / stats (rank 0)

    # the parts by name, as the loop reads them
    model = property(lambda self: self.parts.model)
    opt = property(lambda self: self.parts.opt)
    scaler = property(lambda self: self.parts.scaler)
    injector = property(lambda self: self.parts.injector)
    dp = property(lambda self: self.parts.dp)
    grun = property(lambda self: self.parts.grun)

    @property
    def writer(self) -> bool:
        return self.dp is None or self.dp.is_main  # rank 0 writes every file

    def resume(self) -> None:
        """Continue from ``checkpoint.pt`` (logs cut back to it), or start afresh (partial logs
        of a run that never checkpointed dropped)."""
        path, dp, grun = self.run_path, self.dp, self.grun
        if path is None:
            return
        path.mkdir(parents=True, exist_ok=True)
        if (path / ckpt.CHECKPOINT).exists():
            model, opt = (
                (self.model, self.opt) if dp is None else dp.for_checkpoint(self.opt, save=False)
            )
            loop = ckpt.load(path / ckpt.CHECKPOINT, self.ckpt_cfg, model, opt, self.scaler,
                             self.name, prepare=grun.prepare_load if grun else None)  # fmt: skip
            self.st = LoopState(**loop)
            if dp is not None:  # each rank's own scaling state (they differ with amax none)
                dp.load_checkpoint_extra(path / ckpt.CHECKPOINT)
            if self.writer:
                _truncate_jsonl(path / METRICS, self.st.step)
                _truncate_jsonl(path / STATS, self.st.step)
        elif self.writer:
            for f in (METRICS, STATS):
                (path / f).unlink(missing_ok=True)
            shutil.rmtree(path / ckpt.CHECKPOINTS, ignore_errors=True)
        self.records = read_metrics(path)

    def open_files(self) -> None:
        if self.run_path is not None and self.writer:
            write_resolved_recipe(self.run_path, self.recipe, self.model)
            self.files = {f: open(self.run_path / f, "a") for f in (METRICS, STATS)}  # noqa: SIM115

    def close_files(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    def checkpoint(self, ts: TrainStep, rollback: bool = False) -> None:
        """Save ``checkpoint.pt`` (FSDP: every rank gathers the full tensors for rank 0's
        consolidated checkpoint; the hooks' extras are collective), keep the guard's last
        ``keep``, then a barrier: no rank runs ahead of the last checkpoint."""
        dp, st = self.dp, self.st
        model, opt = (self.model, self.opt) if dp is None else dp.for_checkpoint(self.opt)
        extra = ts.checkpoint(st.step, {})
        if self.writer:
            for f in self.files.values():
                f.flush()
            ckpt.save(self.run_path / ckpt.CHECKPOINT, self.ckpt_cfg, model, opt, self.scaler,
                      st, extra)  # fmt: skip
            if self.grun is not None:
                ckpt.keep_last(self.run_path, st.step, self.grun.guard.keep, rollback=rollback)
        if dp is not None:
            dp.barrier()

    def rolled_back(self, ts: TrainStep) -> None:
        """The guard restored an earlier state: the abandoned steps leave the records, the logs
        and the checkpoint (the restored state saved at once)."""
        st = self.st
        self.records[:] = [r for r in self.records if r["step"] <= st.step]
        if self.files:
            self.close_files()
            _truncate_jsonl(self.run_path / METRICS, st.step)
            _truncate_jsonl(self.run_path / STATS, st.step)
            self.open_files()
        if self.run_path:
            self.checkpoint(ts, rollback=True)
        self.emit({"event": "guard", "recipe": self.name, **st.guard_events[-1]})

    def log(self, rec: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self.records.append(rec)
        if self.files:
            self.files[METRICS].write(json.dumps(rec) + "\n")
            for row in rows:
                self.files[STATS].write(json.dumps(json_safe({**row, "step": rec["step"]})) + "\n")


def run_loop(run: Run, stop_after: int | None = None) -> RunResult:
    """Resume ``run`` (or start it), train until ``train.steps`` (or ``stop_after`` steps in
    total) or divergence, and write its summary (run.json)."""
    tc = run.cfg.train
    run.resume()
    ts, watch = make_step(run.model, run.opt, run.scaler, run.injector, run.st, tc.grad_clip,
                          tc.stats_every, run.recipe, run.dp, run.grun)  # fmt: skip
    val = val_batches(run.corpus.val, tc.batch_size, run.cfg.model.block_size, tc.seed,
                      tc.eval_batches)  # fmt: skip
    run.emit({"event": "start", "recipe": run.name, "step": run.st.step, "steps": tc.steps})
    run.open_files()
    try:
        end = tc.steps if stop_after is None else min(tc.steps, stop_after)
        if run.grun is not None:
            run.grun.snapshot(run.st)  # the first last-good state: the start (or the checkpoint)
        while run.st.step < end and not run.st.diverged:
            _loop_step(run, ts, watch, val, end)
    finally:
        run.injector.remove()
        run.close_files()
    return _finish(run)


def _loop_step(run: Run, ts: TrainStep, watch: WatchHook, val: list[Any], end: int) -> None:
    """One step of the loop: the step, the guard's action, evaluation, logs, checkpoint."""
    st, grun, name, tc = run.st, run.grun, run.name, run.cfg.train
    rec, rows = train_step(ts, watch, st, run.corpus, run.cfg)
    if grun is not None:  # every detector signal of the step (the early-warning study)
        run.emit({"event": "guard_signals", "recipe": name, **grun.monitor.signals})
        if grun.after_step(st) == "rollback":
            run.rolled_back(ts)
            return
        rec["guard_events"] = grun.take_events()
        for ev in rec["guard_events"]:
            run.emit({"event": "guard", "recipe": name, **ev})
    done = st.step
    if done % tc.eval_every == 0 or done == tc.steps:
        rec["val_loss"] = _num(evaluate(run.model, val))
    run.log(rec, rows)
    last = done == tc.steps or st.diverged or done == end
    if run.run_path and (done % tc.checkpoint_every == 0 or last):
        run.checkpoint(ts)
    run.emit({"event": "step", "recipe": name, **rec, "steps": tc.steps})


def _finish(run: Run) -> RunResult:
    """The run's summary (with the guard's events and effective recipe) and run.json."""
    st, tc = run.st, run.cfg.train
    vocab = models.vocab_size_of(run.model, run.cfg.model)
    summary = summarize(run.records, tc.steps, st, vocab)
    summary["recipe"] = run.name
    if run.grun is not None:
        summary["guard_events"] = list(st.guard_events)
        if st.escalations:
            summary["effective_recipe"] = ckpt.recipe_settings(run.grun.effective_recipe)
    run.emit({"event": "end", "recipe": run.name, **summary})
    if run.run_path and run.writer:
        # the machine that computed it (fp8lab.lab.machine): recorded, not part of the identity
        out = {"summary": summary, "vocab_size": vocab, **run.ckpt_cfg,
               "machine": machines.machine_info()}  # fmt: skip
        ckpt.write_text(run.run_path / "run.json", json.dumps(out, indent=2))
    return RunResult(summary=summary, model=run.model, records=run.records)
