"""Training the runs of a comparison into its output directory.

One run per recipe (and per seed replica of the baseline), each in ``OUT/runs/<name>``
(:func:`run_dir`) under :func:`config_for` its configuration. :func:`prepare_out_dir` creates or
checks ``OUT`` and writes ``OUT/config.json``; :func:`run_recipes` trains or resumes every
unfinished run (:func:`finished_run` reads a finished one back without training), one after
another or ``jobs`` at a time in the lab's process pool, the slowest first
(:func:`schedule_cost`). :func:`run_order` is the one definition of which runs a comparison
trains, in which order: rank 0 and the other torchrun ranks train the same list.
"""

from __future__ import annotations

import errno
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab.data import Corpus, load_corpus
from fp8lab.lab.pool import Callback, Job, WorkerPool, set_threads
from fp8lab.lab.recipes import resolve_recipe, seed_replica, split_replica
from fp8lab.lab.train import (
    CHECKPOINT,
    ConfigMismatchError,
    LabConfig,
    checkpoint_config,
    corpus_config,
    mismatch_message,
    train_run,
)


def run_dir(out: Path, name: str) -> Path:
    """Where the run of recipe ``name`` lives under a comparison's ``out``: ``out/runs/NAME``;
    a recipe file (``path/to/fix.toml``) runs in ``out/runs/fix.toml`` (its file name, so an
    absolute or nested path never escapes ``out/runs``)."""
    p = Path(name)
    return out / "runs" / (p.name if p.suffix in (".toml", ".json") else name)


def config_for(cfg: LabConfig, name: str) -> LabConfig:
    """The configuration run ``name`` trains under: ``cfg``, with a replica's own seed."""
    seed = split_replica(name)[1]
    return cfg if seed is None else cfg.replace_train(seed=seed)


def run_order(
    names: Sequence[str], baseline: str, seed: int, noise_seeds: int = 0
) -> tuple[list[str], list[str]]:
    """The runs a comparison trains, in order: ``(recipes, replicas)``. ``recipes``: ``names``
    without repeats, the baseline first when ``names`` lacks it (the rows of the table);
    ``replicas``: the baseline's ``noise_seeds`` seed replicas under ``seed`` + 1, + 2, ...
    (:func:`~fp8lab.lab.recipes.seed_replica`), trained after them for the noise estimate."""
    recipes = list(dict.fromkeys(names))
    if baseline not in recipes:
        recipes.insert(0, baseline)
    replicas = [seed_replica(baseline, seed + i) for i in range(1, noise_seeds + 1)]
    return recipes, replicas


def _guard_dict(guard: Any) -> dict[str, Any]:
    """A guard as plain data for a worker process (an AnomalyGuard or its dict)."""
    return guard if isinstance(guard, dict) else guard.to_dict()


def _named(name: str, emit: Callback) -> Callback:
    """``emit``, with a seed replica's events under its own name (not its recipe's)."""
    if split_replica(name)[1] is None:
        return emit
    return lambda ev: emit({**ev, "recipe": name})


def _train_job(name: str, cfg_dict: dict, run_dir: str, events: Any, guard: Any = None) -> None:
    """A worker's job (`fp8lab.lab.pool.WorkerPool`): train one recipe, events to the parent."""
    cfg = LabConfig.from_dict(cfg_dict)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    train_run(resolve_recipe(name), cfg, corpus, run_dir, callback=_named(name, events.put),
              guard=guard)  # fmt: skip


def _read_own_config(path: Path) -> dict[str, Any] | None:
    """The config.json fp8lab compare wrote into an output directory, or None (absent, or a
    file of someone else's)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and {"lab", "baseline"} <= set(d) else None


def _has_runs(out: Path) -> bool:
    runs = out / "runs"
    return runs.is_dir() and any(
        (d / CHECKPOINT).exists() or (d / "run.json").exists() for d in runs.iterdir()
    )


def machine_of_runs(threads: int = 0) -> dict[str, Any]:
    """`fp8lab.lab.machine.machine_info` of this process, with the thread counts the runs use
    (``threads`` > 0: what `set_threads` sets in every run)."""
    m = machines.machine_info()
    if threads > 0:
        m["torch_threads"] = threads
        m["numba_threads"] = min(threads, m["numba_threads"] or threads)
    return m


def _identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What a comparison must match to be continued: everything but the machine."""
    return {k: v for k, v in meta.items() if k != "machine"}


def prepare_out_dir(
    out: Path, cfg: LabConfig, baseline: str, corpus: Corpus, machine: dict | None = None
) -> None:
    """Create ``out`` (or check it can be continued) and write its ``config.json``.

    Refused (ValueError): ``out`` is a file; ``out`` is a non-empty directory fp8lab did not
    make; ``out`` holds runs made under another configuration, baseline or training text. A
    directory holding no run yet (e.g. a failed start) is reused under the new configuration.
    ``machine`` (`machine_of_runs`) is recorded as ``"machine"``, outside the identity: a
    comparison started on one machine continues on another.
    """
    meta = {"lab": cfg.to_dict(), "baseline": baseline, "corpus": corpus_config(corpus)}
    identity = models.model_identity(cfg.model)
    if identity is not None:  # a user's model: its source or config file hash
        meta["model"] = identity
    if machine is not None:
        meta["machine"] = machine
    path = out / "config.json"
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()):
        old = _read_own_config(path)
        if old is None:
            raise ValueError(
                f"{out}: a non-empty directory not made by fp8lab compare (no fp8lab "
                "config.json); refusing to write into it: choose a new or empty directory"
            )
        why = mismatch_message(_identity(old), _identity(meta))
        if why and _has_runs(out):
            raise ConfigMismatchError(
                f"{out} holds a comparison made with a different configuration; refusing to "
                f"mix them (choose another --out). {why}"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        raise ValueError(
            f"cannot write the output directory {out}: {exc.strerror or exc}"
        ) from None


def run_recipes(
    cfg: LabConfig,
    names: Sequence[str],
    out: Path,
    jobs: int = 1,
    threads: int = 0,
    callback: Callback | None = None,
    corpus: Corpus | None = None,
    guard: Any = None,
    dist: dict[str, Any] | None = None,
) -> None:
    """Train (or resume) each recipe into ``out/runs/<name>``; ``jobs`` > 1 uses processes.
    ``dist``: torchrun options for `train_run` (amax_group, grad_comm, fsdp, fp8_allgather).

    An error of a recipe is raised again as ValueError (bad input, corrupt checkpoint) or
    OSError (e.g. a full disk) naming the recipe, anything else as RuntimeError."""
    emit = callback or (lambda e: None)
    corpus = corpus or load_corpus(cfg.data, cfg.model.block_size)
    names = _unfinished(cfg, names, out, corpus, emit)
    if not names:
        return
    if jobs <= 1:
        set_threads(threads)
        for name in names:
            train_run(resolve_recipe(name), config_for(cfg, name), corpus, run_dir(out, name),
                      callback=_named(name, emit),
                      guard=guard, **(dist or {}))  # fmt: skip
        return
    gd = None if guard is None else _guard_dict(guard)  # plain data for the worker processes
    # longest first, so that the slow recipe overlaps with the others instead of running last
    order = sorted(names, key=lambda n: -schedule_cost(resolve_recipe(n)))
    todo = [Job(n, _train_job, {"name": n, "cfg_dict": config_for(cfg, n).to_dict(),
                                "run_dir": str(run_dir(out, n)), "guard": gd})
            for n in order]  # fmt: skip
    with WorkerPool(jobs, threads, label="recipe") as pool:
        pool.run(todo, emit)


def _unfinished(
    cfg: LabConfig, names: Sequence[str], out: Path, corpus: Corpus, emit: Callback
) -> list[str]:
    """The recipes of ``names`` still to train; a finished run is read back here (its start and
    end events emitted), without starting a process or building a model."""
    todo = []
    for name in names:
        run = finished_run(config_for(cfg, name), name, out, corpus)
        if run is None:
            todo.append(name)
            continue
        s = run["summary"]
        emit({"event": "start", "recipe": name, "step": s["steps_done"], "steps": cfg.train.steps})
        emit({"event": "end", **s, "recipe": name})
    return todo


def finished_run(cfg: LabConfig, name: str, out: Path, corpus: Corpus) -> dict[str, Any] | None:
    """The ``run.json`` of recipe ``name``'s run in ``out`` when that run is finished (complete,
    or ended as diverged) under this very configuration, recipe, model and training text (the
    machine aside); None otherwise (training it, or resuming it, is then `train_run`'s job,
    which refuses a mismatching checkpoint)."""
    d = run_dir(out, name)
    try:
        run = json.loads((d / "run.json").read_text())
    except (OSError, ValueError):
        return None
    s = run.get("summary") if isinstance(run, dict) else None
    # a truncated checkpoint (no zip directory; cheap to see) goes to train_run, which names it
    if not isinstance(s, dict) or not zipfile.is_zipfile(d / CHECKPOINT):
        return None
    if not (s.get("complete") or s.get("diverged")) or "steps_done" not in s:
        return None
    want = checkpoint_config(cfg, resolve_recipe(name), corpus)
    if "corpus" not in run or mismatch_message({k: run.get(k) for k in want}, want) is not None:
        return None
    return run


def schedule_cost(recipe: Any) -> float:
    """Rough cost of a recipe's training step relative to fp32 (to start the slow runs first;
    not the cost model's or the debugger's remedy cost; measured by
    benchmarks/bench_train_step.py): limited-precision accumulation, emulated with float64
    K-group GEMMs, ~3x; MX blocks ~1.2-1.7x; others ~1.2x."""
    gemms = [getattr(recipe, g) for g in ("fprop", "dgrad", "wgrad")]
    if any(g.accumulator.kind == "limited" for g in gemms):
        return 3.0
    if any(getattr(recipe, r) is not None and getattr(recipe, r).block[1] == 32 for r in
           ("input", "weight", "grad_output")):  # fmt: skip
        return 1.7
    return 1.2 if recipe.input is not None else 1.0
