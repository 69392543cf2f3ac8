"""Training probes of the debugger: full or continued runs of one recipe, in parallel.

A probe is :func:`fp8lab.lab.train.train_run` of one recipe (plain data, so it crosses process
boundaries) into ``OUT/probes/<name>``, from the same initial weights and batch order as every
other probe. Two additions, both built on the runner's own resume:

- ``snapshots``: steps at which a copy of the checkpoint is kept (``snapshots/step_<n>.pt``). The
  run is trained in segments (``stop_after``); resuming is bit-identical, so the segmented run
  equals an uninterrupted one.
- ``start``: the checkpoint of *another* run (another recipe), or of the user's own loop
  (`fp8lab.lab.debug.start`), to continue from. The lab refuses such a resume for users; the
  debugger converts the checkpoint explicitly (:func:`convert_checkpoint`: the weights,
  optimizer moments and master weights are kept, the loss scaler is the new recipe's fresh one
  and so is the scaling state, except on layers saved under the same numerics) and writes it as
  the probe's own.

:class:`TaskPool` (the lab's one pool, `fp8lab.lab.pool.WorkerPool`) runs module-level functions
``jobs`` at a time in spawned processes (or in this process for ``jobs=1``), forwarding their
progress events.

Under torchrun (``torch.distributed`` initialized with more than one rank) there is no pool: every
rank runs the same tasks in the same order in its own process (``jobs`` > 1 is refused), each
probe trains through the lab's distributed path (`fp8lab.lab.train.train_run` with
`fp8lab.distributed.ddp.DataParallel`: the global batch split across ranks, gradients summed), rank 0
alone writes files (:func:`is_writer`; the converted start checkpoint, copied metrics and
snapshots here, every file of the runs in ``train_run``), and every rank waits for the others
after each task (:func:`barrier`), so a file rank 0 wrote is there when the others read it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8lab.distributed.runtime import check_global_batch, check_jobs, rank, world_size
from fp8lab.lab.data import Corpus, load_corpus
from fp8lab.lab.parts import build_model, make_optimizer
from fp8lab.lab.pool import Callback, Job, WorkerPool
from fp8lab.lab.train import CHECKPOINT, LabConfig, checkpoint_config, read_metrics, train_run

SNAPSHOTS = "snapshots"


# ----------------------------------------------------------------------------- torchrun
def dist_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) unless torch.distributed is initialized with
    more than one rank (torchrun)."""
    return rank(), world_size()


def is_writer() -> bool:
    """Whether this process writes the debugger's files: rank 0 (or a single process)."""
    return dist_world()[0] == 0


def barrier() -> None:
    """Wait for every rank (no-op on one process)."""
    if dist_world()[1] > 1:
        torch.distributed.barrier()


def check_distributed(jobs: int, batch_size: int) -> None:
    """Under torchrun (an initialized group of more than one rank): ValueError for ``jobs`` > 1
    (the ranks are the parallelism) and for a global batch size not divisible by the world
    size (`fp8lab.distributed.runtime.check_jobs`, `check_global_batch`)."""
    world = dist_world()[1]
    check_jobs(jobs, "probes (each on every rank)", world)
    check_global_batch(batch_size, world)


def on_rank0(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on rank 0 alone (the others wait); a ValueError or OSError it raises is
    raised on every rank with the same message, so every rank stops the same way. Returns
    ``fn``'s result on rank 0, None elsewhere. On one process: ``fn(*args)``."""
    rank, world = dist_world()
    if world == 1:
        return fn(*args)
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except (ValueError, OSError) as exc:
            error = str(exc)
    box = [error]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    return result


def rank0_writes(fn: Callable[..., Any], ctx: Any, *args: Any) -> Any:
    """``fn(ctx, *args)`` where ``fn`` writes into ``ctx.out`` (the verdict: ``fix.toml`` and the
    result JSON): on rank 0 as is; on the other ranks into a private temporary directory
    (deleted after), the result's ``fix`` then naming rank 0's file. Every rank thus decides the
    same verdict and only rank 0 writes it."""
    import tempfile

    if is_writer():
        return fn(ctx, *args)
    out = ctx.out
    with tempfile.TemporaryDirectory(prefix="fp8lab-debug-rank") as tmp:
        ctx.out = Path(tmp)
        try:
            result = fn(ctx, *args)
        finally:
            ctx.out = out
    if getattr(result, "fix", None):
        result.fix = str(out / Path(result.fix).name)
    return result


def rebatch(dp: Any, module: torch.nn.Module) -> None:
    """After ``module.set_recipe`` (fresh delayed-scaling state objects): route their updates
    through ``dp``'s batched amax all-reduce again, as the model's other states."""
    if dp is None or dp.amax is None:
        return
    from fp8lab.nn.state import delayed_states

    for ds in delayed_states(module).values():
        ds.group = dp.amax


# ----------------------------------------------------------------------------- checkpoints
def load_state(path: str | Path) -> dict[str, Any]:
    """A run checkpoint as saved by the lab (``weights_only``: plain tensors and data)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def snapshot_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / SNAPSHOTS / f"step_{step}.pt"


def weights_only(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state without the converted layers' recipe fingerprints and scaling state
    (``*.fp8_*`` keys): what another recipe's model can load."""
    return {k: v for k, v in model_state.items() if not k.rpartition(".")[2].startswith("fp8_")}


def load_weights(model: torch.nn.Module, model_state: dict[str, torch.Tensor]) -> None:
    """Load another recipe's weights into ``model``, keeping ``model``'s own recipe
    fingerprints and (fresh) scaling state."""
    own = model.state_dict()
    merged = {k: v for k, v in own.items() if k.rpartition(".")[2].startswith("fp8_")}
    merged.update(weights_only(model_state))
    model.load_state_dict(merged)


def keep_same_numerics(model: torch.nn.Module, model_state: dict[str, torch.Tensor]) -> list[str]:
    """Load the saved scaling state of each converted layer of ``model`` whose saved recipe
    fingerprint (``fp8_recipe``) is its own (a run continued under the recipe it was trained
    with keeps its scales and histories); the other layers keep their fresh state. Returns the
    layers loaded."""
    from fp8lab.nn import Linear

    kept = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        pre = f"{name}." if name else ""
        saved = model_state.get(pre + "fp8_recipe")
        if saved is None or not torch.equal(saved, m.state_dict()["fp8_recipe"]):
            continue
        sub = {k[len(pre) :]: v for k, v in model_state.items()
               if k.startswith(pre + "fp8_") and "." not in k[len(pre) :]}  # fmt: skip
        m.load_state_dict(sub, strict=False)
        kept.append(name)
    return kept


def convert_checkpoint(
    src: str | Path, dst: str | Path, recipe: Any, cfg: LabConfig, corpus: Corpus
) -> None:
    """Write checkpoint ``src`` (any recipe) as a checkpoint of ``recipe`` under ``cfg`` at
    ``dst``: weights, optimizer moments, loop state and RNG kept; recipe fingerprints and loss
    scaler are ``recipe``'s, the scaling state fresh except on layers the checkpoint saved
    under the same numerics (:func:`keep_same_numerics`). The optimizer's storage formats
    become ``recipe``'s (the saved moments are float32 tensors either way); a saved master
    weight is kept for each parameter whose new optimizer keeps a master (FP8 parameter storage
    with a master included), dropped elsewhere."""
    from fp8lab.optim import LossScaler

    state = load_state(src)
    model = build_model(cfg.model, recipe, cfg.train.seed)
    load_weights(model, state["model"])
    keep_same_numerics(model, state["model"])
    opt = make_optimizer(model, recipe, cfg.train)
    osd = dict(state["optimizer"])
    mine = opt.state_dict()
    if "fp8lab" in mine:
        osd["fp8lab"] = {**mine["fp8lab"], "skipped_steps": osd.get("fp8lab", {}).get(
            "skipped_steps", 0)}  # fmt: skip
    # a saved master continues where this optimizer keeps one (an FP8-stored parameter's fp32
    # master too: restarting it from the FP8 value would lose what quantization rounds off)
    needs = getattr(opt, "_needs_master", None)
    params = [p for g in opt.param_groups for p in g["params"]]
    osd["state"] = {
        k: {n: v for n, v in s.items()
            if n != "master" or (needs is not None and needs(params[int(k)]))}
        for k, s in osd["state"].items()
    }  # fmt: skip
    opt.load_state_dict(osd)
    scaler = LossScaler.from_recipe(recipe)
    out = {
        "config": checkpoint_config(cfg, recipe, corpus),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "loop": state["loop"],
        "torch_rng": state["torch_rng"],
    }
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(dst)


@dataclass(frozen=True)
class ProbeSpec:
    """One training probe. ``recipe``: plain data (``Recipe.to_dict()``); ``start``: a
    checkpoint of another run to continue from (its metrics up to that step are copied from
    ``start_metrics``); ``snapshots``: steps whose checkpoints are kept."""

    name: str
    recipe: dict[str, Any]
    start: str | None = None
    start_metrics: str | None = None
    snapshots: tuple[int, ...] = ()
    label: str = ""  # what the probe tests, in words (for the report)
    kind: str = "probe"


@dataclass
class ProbeResult:
    name: str
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    run_dir: Path
    label: str = ""
    kind: str = "probe"
    extra: dict[str, Any] = field(default_factory=dict)


def run_probe(
    spec: ProbeSpec, cfg_dict: dict[str, Any], run_dir: str, events: Any = None
) -> dict[str, Any]:
    """Train one probe into ``run_dir`` (resuming what is there); return its summary."""
    from fp8lab.recipe import Recipe

    cfg = LabConfig.from_dict(cfg_dict)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    recipe = Recipe.from_dict(spec.recipe, where=f"probe {spec.name}")
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)

    def emit(ev: dict[str, Any]) -> None:
        if events is not None:
            events.put({**ev, "recipe": spec.name, "probe": spec.name})

    done = out / "run.json"
    if done.exists():
        run = json.loads(done.read_text())
        if run["summary"].get("complete") or run["summary"].get("diverged"):
            return run["summary"]
    if spec.start and not (out / CHECKPOINT).exists() and is_writer():
        convert_checkpoint(spec.start, out / CHECKPOINT, recipe, cfg, corpus)
        start_step = int(load_state(out / CHECKPOINT)["loop"]["step"])
        recs = read_metrics(Path(spec.start_metrics)) if spec.start_metrics else []
        with open(out / "metrics.jsonl", "w") as f:
            for r in recs:
                if r["step"] <= start_step:
                    f.write(json.dumps(r) + "\n")
    barrier()  # torchrun: the other ranks resume from rank 0's converted checkpoint
    result = None
    for stop in [*sorted(s for s in spec.snapshots if 0 < s < cfg.train.steps), None]:
        snap = None if stop is None else snapshot_path(out, stop)
        if snap is not None and snap.exists():
            continue
        result = train_run(recipe, cfg, corpus, out, callback=emit, stop_after=stop)
        if snap is not None and is_writer():
            snap.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / CHECKPOINT, snap)
        if result.summary.get("diverged"):
            break
    if result is None:  # every segment was there already
        result = train_run(recipe, cfg, corpus, out, callback=emit)
    return result.summary


def _job(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Job:
    """A task as a named `fp8lab.lab.pool.Job`: a probe by its name, a screen by its snapshot."""
    spec = kwargs.get("spec")
    name = spec.name if isinstance(spec, ProbeSpec) else Path(kwargs.get("snapshot", "")).stem
    return Job(name or fn.__name__, fn, kwargs)


class TaskPool(WorkerPool):
    """The lab's `fp8lab.lab.pool.WorkerPool` for the debugger's tasks ``(fn, kwargs)`` (called
    ``fn(**kwargs, events=...)``): ``jobs`` spawned workers kept for the pool's life (one
    start-up, not one per stage), or this process for ``jobs`` 1 (under torchrun: a barrier
    after each task, so rank 0's files are written). A failed task's error names it (probe
    ``'name'``). Use as a context manager."""

    def __init__(self, jobs: int = 1, threads: int = 0) -> None:
        check_jobs(jobs, "tasks", dist_world()[1])
        super().__init__(jobs, threads, label="probe", after_each=barrier)

    def run(  # type: ignore[override]
        self,
        tasks: Sequence[tuple[Callable[..., Any], dict[str, Any]] | Job],
        callback: Callback | None = None,
    ) -> list[Any]:
        """Results in task order; events go to ``callback``; the first error is raised."""
        jobs = [t if isinstance(t, Job) else _job(*t) for t in tasks]
        return super().run(jobs, callback)


def run_tasks(
    tasks: Sequence[tuple[Callable[..., Any], dict[str, Any]]],
    jobs: int = 1,
    threads: int = 0,
    callback: Callback | None = None,
) -> list[Any]:
    """:class:`TaskPool` for one batch of tasks."""
    with TaskPool(jobs, threads) as pool:
        return pool.run(tasks, callback)
