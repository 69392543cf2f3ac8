"""Several recipes side by side: one initial model, one batch order, one set of results.

The model is the built-in GPT or a user's (``[model] factory``: a ``MODULE:FACTORY`` function, a
``path/to/file.py:FACTORY`` function or a ``hf:CONFIG.json`` transformers config; see
:mod:`fp8lab.lab.models`), built once per recipe under ``train.seed`` before conversion.

``run_comparison(cfg, recipes, baseline, out_dir)`` validates everything first (recipes, config,
corpus, output directory), then trains every recipe with :func:`train_run` (one after another,
or ``jobs`` at a time in separate processes), summarises each run against the baseline, writes
the data files and returns a :class:`ComparisonResult`; ``compare(...)`` returns its summary. The
report (figures, ``report.md`` / ``report.html``) is written from that result by
``fp8lab.report.training.write_report``, which the ``fp8lab compare`` command calls. Layout::

    OUT/config.json             the lab config + baseline + corpus hash (a different one is refused)
    OUT/runs/<recipe>/          metrics.jsonl, stats.jsonl, checkpoint.pt, run.json
    OUT/metrics.csv             every step of every recipe
    OUT/summary.json            the --json summary (schema_version 1) + per-recipe extras
    OUT/report.html, report.md, figures/*.png   (written by the report layer)

Rerunning with the same OUT resumes each unfinished run from its checkpoint (bit-identical to an
uninterrupted run); finished runs are read back, not retrained. Nothing is written before every
input has been checked, an OUT holding no run yet may be reused under another configuration, and
a non-empty OUT that fp8lab did not make is refused (its files are never overwritten).

A run is diverged when its losses are not finite or its final validation loss exceeds
ln(vocabulary) by more than ``DIVERGED_MARGIN_NATS`` = 0.5 (clearly worse than a uniform guess;
an untrained model sits just above ln(vocabulary), `fp8lab.lab.train.diverged_loss`). A
diverged baseline makes every relative gap meaningless: the summary then says
``"baseline_diverged": true`` and every gap is null.

The lab's recipe names (presets, its own negative control, recipe files, seed replicas) are
:mod:`fp8lab.lab.recipes`; training the runs into ``OUT`` is :mod:`fp8lab.lab.compare_runs`;
summarising them against the baseline (gaps, noise, predicted step time, memory) is
:mod:`fp8lab.lab.compare_summary`; this module runs the three in order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab import models
from fp8lab.lab.compare_runs import (
    machine_of_runs,
    prepare_out_dir,
    run_dir,
    run_order,
    run_recipes,
)
from fp8lab.lab.compare_summary import (
    DEFAULT_COST_DEVICE,
    summarize_comparison,
    write_metrics_csv,
)
from fp8lab.lab.data import load_corpus
from fp8lab.lab.pool import Callback, check_count
from fp8lab.lab.recipes import NEGATIVE_CONTROL, SEED_SEP, resolve_recipe, split_replica
from fp8lab.lab.train import LabConfig, read_metrics, read_stats

#: what `fp8lab compare` runs without --recipes (and what `make demo` shows): the bf16 baseline,
#: one recipe per FP8 family (TE, DeepSeek-V3, MX, HiF8), fp32 for the fp32-vs-bf16 gap, and the
#: negative control.
#: te-current is left out only for `make demo`'s 10-minute budget (`make demo-long` adds it).
DEFAULT_RECIPES = (
    "fp32",
    "bf16",
    "te-delayed",
    "deepseek-v3",
    "mxfp8",
    "hif8-delayed",
    NEGATIVE_CONTROL,
)
DEFAULT_BASELINE = "bf16"


@dataclass
class ComparisonResult:
    """What a comparison produced, as plain data: everything the report is written from."""

    out: Path
    summary: dict[str, Any]  # see summarize_comparison
    metrics: dict[str, list[dict[str, Any]]]  # recipe -> per-step records
    stats: dict[str, list[dict[str, Any]]]  # recipe -> operand statistics rows
    lab_config: dict[str, Any]  # LabConfig.to_dict()


def run_comparison(
    cfg: LabConfig,
    recipes: Sequence[str] = DEFAULT_RECIPES,
    baseline: str = DEFAULT_BASELINE,
    out_dir: str | Path = "runs/compare",
    jobs: int = 1,
    threads: int = 0,
    callback: Callback | None = None,
    device: str = DEFAULT_COST_DEVICE,
    guard: Any = None,
    dist: dict[str, Any] | None = None,
    noise_seeds: int = 0,
) -> ComparisonResult:
    """Train every recipe of ``recipes`` (the baseline is added if missing) into ``out_dir``,
    write ``summary.json`` and ``metrics.csv`` there and return the results. ``noise_seeds``:
    also train the baseline under that many other seeds (``train.seed`` + 1, + 2, ...; run
    directories ``runs/BASELINE@seedS``) for the noise estimate
    (`fp8lab.lab.compare_summary.noise_estimate`); the runs and their order are
    `fp8lab.lab.compare_runs.run_order`'s.

    Everything is checked before anything is written: recipe names and files, ``jobs``,
    ``threads``, the config (:meth:`LabConfig.check`), the corpus and the output directory
    (:func:`prepare_out_dir`), the cost ``device`` of the predicted step time; a bad one raises
    ValueError (FileNotFoundError for a missing data path). ``guard``: an
    `fp8lab.guard.AnomalyGuard` every run trains under (None: unguarded)."""
    names = list(dict.fromkeys(recipes))
    if not names:
        raise ValueError("no recipes given")
    for n in [*names, baseline]:
        resolve_recipe(n)  # fail fast on a typo, before any training
    dirs: dict[Path, str] = {}
    for n in dict.fromkeys([*names, baseline]):
        other = dirs.setdefault(run_dir(Path(), n), n)
        if other != n:
            raise ValueError(f"recipes {other!r} and {n!r} would share the run directory "
                             f"runs/{run_dir(Path(), n).name}; rename one file")  # fmt: skip
    check_count("jobs", jobs, 1)
    check_count("threads", threads, 0, " (0 = the defaults)")
    check_count("noise_seeds", noise_seeds, 0)
    names, replicas = run_order(names, baseline, cfg.train.seed, noise_seeds)
    if any(split_replica(n)[1] is not None for n in names):
        raise ValueError(f"a recipe name may not end in {SEED_SEP}N (a seed replica's name)")
    cfg.check()
    from fp8lab.cost import get_device

    get_device(device)  # an unknown device fails before any training
    user_model = None
    if not models.is_builtin(cfg.model):  # a wrong output is an error before anything is written
        with torch.random.fork_rng(devices=[]):  # built once: checked here, summarized below
            user_model = models.build(cfg.model, cfg.train.seed)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    out = Path(out_dir)
    machine = machine_of_runs(threads)
    prepare_out_dir(out, cfg, baseline, corpus, machine)
    run_recipes(cfg, [*names, *replicas], out, jobs=jobs, threads=threads, callback=callback,
                corpus=corpus, guard=guard, dist=dist)  # fmt: skip
    if dist is not None:  # torchrun: the ranks are done; what follows is rank 0's alone
        from fp8lab.distributed.runtime import leave_group

        leave_group()
    metrics = {n: read_metrics(run_dir(out, n)) for n in names}  # read once
    summary = summarize_comparison(cfg, names, baseline, out, device, metrics=metrics,
                                   user_model=user_model, machine=machine,
                                   replicas=replicas)  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    write_metrics_csv(names, out, metrics)
    return ComparisonResult(
        out=out,
        summary=summary,
        metrics=metrics,
        stats={n: read_stats(run_dir(out, n)) for n in names},
        lab_config=cfg.to_dict(),
    )


def compare(cfg: LabConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`run_comparison` (the same arguments), returning only the summary (see
    :func:`summarize_comparison`). The report is not written here:
    ``fp8lab.report.training.write_report`` does that."""
    return run_comparison(cfg, *args, **kwargs).summary
