"""Early-warning study: which signal warns of a training failure, how early, and how often it
cries wolf on healthy runs (issue 15; definitions in docs/early_warning.md).

One command: ``python benchmarks/study_early_warning.py [--steps 200] [--seeds 1] [--jobs 2]
[--out runs/early-warning]``. Every run trains the lab's default GPT (2 layers, d_model 256,
8 x 128 bytes per step, the built-in corpus) with ``AnomalyGuard(policy="off")``: the guard's
detectors run and report every step, nothing acts on them, so each run is bit-identical to an
unguarded one. `fp8lab.lab.early_warning.recording` adds the optional published indicators
(activation kurtosis, maximum attention logit, output log Z) with forward hooks. Scenarios:

- **healthy**: the ``make demo`` recipes (`fp8lab.lab.compare.DEFAULT_RECIPES`), default
  training config, no fault: the false-alarm rate (the negative control
  ``e4m3-unscaled-grads`` is reported apart: its gradients really do underflow);
- **spike**: te-delayed, a one-step gradient spike x 2^40 (``grad_spike_scale`` 1e12) at step
  steps/2;
- **outliers**: te-delayed, 4 input channels of each ``mlp.down`` x 1000 from step steps/2;
- **lr sweep**: te-delayed at the default peak learning rate x 4, 16, 64, 256 (x 1 is the
  healthy te-delayed run).

Evaluation runs only at the end (it never changes the trajectory) and ``stats.jsonl`` is off;
the guard's own per-operand rows are measured every 10 steps as in any guarded run. Each run's
per-step records are cached in OUT/runs/NAME.json (a rerun with the same settings reuses
them). Prints the table, writes OUT/early_warning.json and the figure OUT/early_warning.png
(``--figure PATH`` to put it elsewhere, e.g. docs/figures/early_warning.png).

Cost: at --steps 200 --seeds 1, 13 runs / 2600 steps (deepseek-v3's steps cost ~3x): about
8 min on 2 idle cores with --jobs 2, 1 thread per process (estimated from the lab's ~0.25 s per
step; on a machine shared with other work a step took 3-4 s). Runs start in order of interest:
the faults, the diverging and x 1 learning rates, the rest of the sweep, the healthy recipes
(deepseek-v3 last); ``--analyze-only`` reports on whatever is cached.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

DEMO_NEGATIVE = "e4m3-unscaled-grads"
LR_MULTS = (4, 16, 64, 256)
OUTLIER = {"outlier_channels": 4, "outlier_scale": 1000.0}
SPIKE_SCALE = 1e12


def jobs_for(steps: int, seeds: list[int]) -> list[dict[str, Any]]:
    """Every run of the study: name, scenario, recipe, seed, lr multiplier, inject, fault step."""
    from fp8lab.lab.compare import DEFAULT_RECIPES

    fault = steps // 2
    out = []
    for seed in seeds:
        for r in DEFAULT_RECIPES:
            out.append({"scenario": "healthy", "recipe": r, "lr_mult": 1, "inject": {}})
        out.append(
            {
                "scenario": "spike",
                "recipe": "te-delayed",
                "lr_mult": 1,
                "fault": fault,
                "inject": {"grad_spike_step": fault, "grad_spike_scale": SPIKE_SCALE},
            }
        )
        out.append(
            {
                "scenario": "outliers",
                "recipe": "te-delayed",
                "lr_mult": 1,
                "fault": fault,
                "inject": {**OUTLIER, "outlier_from_step": fault},
            }
        )
        for m in LR_MULTS:
            out.append({"scenario": "lr", "recipe": "te-delayed", "lr_mult": m, "inject": {}})
        for j in out[-(len(DEFAULT_RECIPES) + 2 + len(LR_MULTS)) :]:
            j["seed"] = seed
            j["steps"] = steps
            j["name"] = f"{j['scenario']}-{j['recipe']}-x{j['lr_mult']}-seed{seed}"
    # most informative first (a study cut short still has the faults and the diverging rates);
    # deepseek-v3 (3x the step cost) last
    prio = {"spike": 0, "outliers": 0, "lr": 1, "healthy": 3}

    def key(j: dict[str, Any]) -> tuple:
        p = prio[j["scenario"]]
        if j["scenario"] == "lr":
            p += LR_MULTS[::-1].index(j["lr_mult"]) // 2  # x256, x64, then x16, x4
        if j["scenario"] == "healthy" and j["recipe"] == "te-delayed":
            p = 1.5  # the lr sweep's x 1, after the rates that diverge
        return (p, j["recipe"] == "deepseek-v3", j["seed"])

    out.sort(key=key)
    return out


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train one run with the guard's detectors off-policy and every signal recorded."""
    import torch

    torch.set_num_threads(1)
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab import early_warning as ew
    from fp8lab.lab.compare import resolve_recipe
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.inject import InjectConfig
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run

    tc = TrainConfig()
    train = TrainConfig(
        steps=job["steps"],
        seed=job["seed"],
        lr=tc.lr * job["lr_mult"],
        eval_every=job["steps"],
        stats_every=0,
        checkpoint_every=job["steps"],
    )
    cfg = LabConfig(train=train, inject=InjectConfig(**job["inject"]))
    corpus = load_corpus(cfg.data, block_size=cfg.model.block_size)
    recipe = resolve_recipe(job["recipe"])  # presets and the lab's negative control
    rec = ew.SignalRecorder()
    t0 = time.perf_counter()
    with ew.recording(rec):
        res = train_run(recipe, cfg, corpus, None, rec, guard=AnomalyGuard(policy="off"))
    s = res.summary
    return {
        "job": job,
        "seconds": time.perf_counter() - t0,
        "summary": {k: s.get(k) for k in ("final_train_loss", "final_val_loss", "diverged")},
        "records": rec.records,
    }


def _cached(path: Path, job: dict[str, Any]) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
    except ValueError:
        return None
    return d if d.get("job") == job else None


def _work(args: tuple[dict[str, Any], str]) -> dict[str, Any]:
    job, path = args
    try:
        out = run_job(job)
    except Exception as exc:  # one bad run must not take the others down
        return {"job": job, "error": f"{type(exc).__name__}: {exc}"}
    tmp = Path(path + ".tmp")
    from fp8lab.stats import json_safe

    # JSON has no NaN/inf: null, which the loss rule counts as non-finite
    tmp.write_text(json.dumps(json_safe(out), allow_nan=False, default=str))
    os.replace(tmp, path)
    return out


def run_all(
    jobs: list[dict[str, Any]], out: Path, n_jobs: int, log, train: bool = True
) -> list[dict[str, Any]]:
    """Cached results of ``jobs``, training the missing ones (``train``) or leaving them out."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    done, todo = [], []
    for j in jobs:
        p = out / "runs" / f"{j['name']}.json"
        c = _cached(p, j)
        (done if c else todo).append(c if c else (j, str(p)))
    log(f"{len(done)} runs cached, {len(todo)} to train ({n_jobs} processes)")
    if todo and not train:
        log("--analyze-only: left out " + ", ".join(j["name"] for j, _ in todo))
    elif todo:
        with mp.get_context("spawn").Pool(n_jobs, maxtasksperchild=1) as pool:
            for r in pool.imap_unordered(_work, todo):
                if "error" in r:
                    log(f"  {r['job']['name']}: FAILED, left out ({r['error']})")
                    continue
                log(f"  {r['job']['name']}: {len(r['records'])} steps, {r['seconds']:.0f} s")
                done.append(r)
    return done


# ----------------------------------------------------------------------------- analysis
def analyze(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: divergence step and each signal's firing steps; per signal: the table cells."""
    from fp8lab.lab import early_warning as ew

    runs = []
    for r in results:
        recs = r["records"]
        div = ew.divergence_step([x.get("loss") for x in recs])
        fires = {s: ew.firing_steps(recs, s) for s in ew.SIGNALS}
        runs.append(
            {
                **r["job"],
                "steps_done": len(recs),
                "divergence_step": div,
                "fires": fires,
                "summary": r["summary"],
            }
        )
    table = {}
    for s in ew.SIGNALS:
        row: dict[str, Any] = {}
        for scen in ("spike", "outliers"):
            rs = [x for x in runs if x["scenario"] == scen]
            row[scen] = {
                "delay": [ew.detection_delay(x["fires"][s], x["fault"], ew.LOOKBACK) for x in rs],
                "lead": [ew.lead_time(x["fires"][s], x["divergence_step"]) for x in rs],
            }
        for m in LR_MULTS:
            rs = [x for x in runs if x["scenario"] == "lr" and x["lr_mult"] == m]
            row[f"lr x{m}"] = {
                "lead": [ew.lead_time(x["fires"][s], x["divergence_step"]) for x in rs]
            }
        for key, sel in (
            ("healthy", lambda x: x["recipe"] != DEMO_NEGATIVE),
            ("negative_control", lambda x: x["recipe"] == DEMO_NEGATIVE),
        ):
            rs = [x for x in runs if x["scenario"] == "healthy" and sel(x)]
            n = sum(x["steps_done"] for x in rs)
            k = sum(len(x["fires"][s]) for x in rs)
            row[key] = {
                "firings": k,
                "steps": n,
                "per_1000": ew.false_alarm_rate(k, n) if n else None,
                "by_recipe": {x["recipe"]: len(x["fires"][s]) for x in rs},
            }
        table[s] = row
    loss_row = {}
    for scen in ("spike", "outliers"):
        rs = [x for x in runs if x["scenario"] == scen]
        loss_row[scen] = [
            None if x["divergence_step"] is None else x["divergence_step"] - x["fault"] for x in rs
        ]
    for m in LR_MULTS:
        rs = [x for x in runs if x["scenario"] == "lr" and x["lr_mult"] == m]
        loss_row[f"lr x{m}"] = [x["divergence_step"] for x in rs]
    hr = [x for x in runs if x["scenario"] == "healthy"]
    loss_row["healthy_divergences"] = sum(x["divergence_step"] is not None for x in hr)
    return {"runs": runs, "table": table, "divergence": loss_row}


def _cell(vals: list[int | None], none: str = "—") -> str:
    return ", ".join(none if v is None else str(v) for v in vals) if vals else "n/a"


def format_table(an: dict[str, Any]) -> str:
    """The README table (markdown)."""
    from fp8lab.lab import early_warning as ew

    some = next(iter(an["table"].values()))["healthy"]
    n_rec, n_steps = len(some["by_recipe"]), some["steps"]
    cols = [
        "spike: delay",
        "outliers: delay",
        *(f"lr x{m}: lead" for m in LR_MULTS),
        f"false alarms /1000 steps ({n_rec} demo recipes, {n_steps} steps)",
        "negative control /1000",
    ]
    lines = ["| signal | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    d = an["divergence"]

    lines.append(
        "| *loss crosses the divergence rule (steps after the fault; lr: at step)* | "
        + " | ".join(
            [
                _cell(d["spike"], "never"),
                _cell(d["outliers"], "never"),
                *(_cell(d[f"lr x{m}"], "never") for m in LR_MULTS),
                f"{d['healthy_divergences']} runs diverged",
                "",
            ]
        )
        + " |"
    )
    for s in ew.SIGNALS:
        row = an["table"][s]
        cells = [_cell(row["spike"]["delay"]), _cell(row["outliers"]["delay"])]
        for m in LR_MULTS:
            leads = row[f"lr x{m}"]["lead"]
            divs = d[f"lr x{m}"]
            no_div = divs and all(v is None for v in divs)
            cells.append("(no divergence)" if no_div else _cell(leads))
        for key in ("healthy", "negative_control"):
            v = row[key]["per_1000"]
            cells.append("n/a" if v is None else f"{v:.1f}")
        name = s if s in ew.GUARD_SIGNALS else f"{s} (optional)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_lr_table(results: list[dict[str, Any]]) -> str:
    """The lr sweep's losses and its largest attention logits (first seed), markdown."""
    from fp8lab.lab import early_warning as ew

    by = {}
    for r in results:
        j = r["job"]
        if j["recipe"] == "te-delayed" and j["scenario"] in ("healthy", "lr"):
            by.setdefault(j["lr_mult"], r)
    lines = [
        "| lr | min loss | final loss | divergence step | max attention logit at step 20 "
        "| at the last step | staleness firings |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sorted(by):
        recs = by[m]["records"]
        losses = [x.get("loss") for x in recs]
        fin = [v for v in losses if v is not None]
        div = ew.divergence_step(losses)

        def logit(t: int, recs: list[dict[str, Any]] = recs) -> str:
            v = recs[t].get("attn_logit_max") if t < len(recs) else None
            return "—" if v is None else f"{v:.3g}"

        n_stale = len(ew.firing_steps(recs, "staleness"))
        lines.append(
            f"| x{m} ({by[m]['job']['lr_mult'] * 1e-3:g}) | {min(fin):.3f} | {fin[-1]:.3f} "
            f"| {'never' if div is None else div} | {logit(20)} | {logit(len(recs) - 1)} "
            f"| {n_stale} of {len(recs)} |"
        )
    return "\n".join(lines)


def _raster(ax, run: dict[str, Any], mark: int | None, mark_label: str, title: str) -> None:
    """Firing steps of every signal of one analyzed run (one row per signal)."""
    from fp8lab.lab import early_warning as ew

    for i, sig in enumerate(ew.SIGNALS):
        steps = run["fires"][sig]
        ax.plot(steps, [i] * len(steps), "|", color="tab:blue", ms=7)
    if mark is not None:
        ax.axvline(mark, color="r", ls="--", lw=1, label=mark_label)
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(range(len(ew.SIGNALS)), list(ew.SIGNALS), fontsize=8)
    ax.set_ylim(len(ew.SIGNALS) - 0.5, -0.5)
    ax.set_xlim(0, run["steps"])
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)


def figure(results: list[dict[str, Any]], an: dict[str, Any], path: Path) -> None:
    """2 x 3 panels: loss and key signals of the spike and outlier runs, the lr sweep's losses;
    firing rasters of the spike run and of the first diverging lr run; false-alarm rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp8lab.lab import early_warning as ew

    first, arun = {}, {}
    for r in results:
        first.setdefault(r["job"]["name"].rsplit("-seed", 1)[0], r)
    for x in an["runs"]:
        arun.setdefault(x["name"].rsplit("-seed", 1)[0], x)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=72)

    def series(r, key):
        return [x["step"] for x in r["records"]], [
            math.nan if x.get(key) is None else x[key] for x in r["records"]
        ]

    panels = (
        (axes[0, 0], "spike-te-delayed-x1", ("headroom", "staleness")),
        (axes[0, 1], "outliers-te-delayed-x1", ("kurtosis_linear_in", "kurtosis_block")),
    )
    for ax, scen, keys in panels:
        r = first.get(scen)
        if r is None:
            continue
        ax.plot(*series(r, "loss"), color="k", lw=1, label="loss")
        ax.axvline(r["job"]["fault"], color="r", ls="--", lw=1, label="fault")
        ax.set_ylabel("train loss")
        ax2 = ax.twinx()
        for k, c in zip(keys, ("tab:blue", "tab:orange"), strict=True):
            ax2.plot(*series(r, k), color=c, lw=1, label=k)
        ax2.set_yscale("symlog")
        ax2.legend(loc="upper center", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"{r['job']['scenario']} (te-delayed, seed {r['job']['seed']})", fontsize=10)
        ax.set_xlabel("step")
    ax = axes[0, 2]
    colors = ("k", "tab:blue", "tab:green", "tab:orange", "tab:red")
    for m, c in zip((1, *LR_MULTS), colors, strict=True):
        r = first.get("healthy-te-delayed-x1" if m == 1 else f"lr-te-delayed-x{m}")
        if r is None:
            continue
        t, loss = series(r, "loss")
        ax.plot(t, [min(v, 20.0) for v in loss], color=c, lw=1, label=f"lr x{m}")
        div = ew.divergence_step([x.get("loss") for x in r["records"]])
        if div is not None:
            ax.axvline(div, color=c, ls=":", lw=1)
    ax.set_title("lr sweep, te-delayed (dotted: divergence step)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (clipped at 20)")
    ax.legend(fontsize=8)
    x = arun.get("spike-te-delayed-x1")
    if x is not None:
        _raster(axes[1, 0], x, x["fault"], "spike", "firings, spike run")
    div_runs = [
        arun[k]
        for k in (f"lr-te-delayed-x{m}" for m in LR_MULTS)
        if k in arun and arun[k]["divergence_step"] is not None
    ]
    if div_runs:
        x = div_runs[0]
        _raster(
            axes[1, 1], x, x["divergence_step"], "divergence", f"firings, lr x{x['lr_mult']} run"
        )
    else:
        axes[1, 1].set_axis_off()
    ax = axes[1, 2]
    rates = [an["table"][s]["healthy"]["per_1000"] or 0.0 for s in ew.SIGNALS]
    neg = [an["table"][s]["negative_control"]["per_1000"] or 0.0 for s in ew.SIGNALS]
    y = range(len(ew.SIGNALS))
    n_rec = len(an["table"][ew.SIGNALS[0]]["healthy"]["by_recipe"])
    ax.barh([i - 0.2 for i in y], rates, height=0.4, label=f"{n_rec} demo recipes")
    ax.barh([i + 0.2 for i in y], neg, height=0.4, label=DEMO_NEGATIVE)
    ax.set_yticks(list(y), list(ew.SIGNALS), fontsize=8)
    ax.set_ylim(len(ew.SIGNALS) - 0.5, -0.5)
    ax.set_xlabel("firings per 1000 steps")
    ax.set_title("false alarms (healthy runs, no fault)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=1, help="seeds 1337, 1338, ...")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="runs/early-warning")
    p.add_argument("--figure", default=None, help="PNG path (default OUT/early_warning.png)")
    p.add_argument("--analyze-only", action="store_true", help="use the cached runs only")
    a = p.parse_args(argv)
    if a.steps < 60 or a.seeds < 1 or a.jobs < 1:
        p.error("--steps must be >= 60, --seeds and --jobs >= 1")
    out = Path(a.out)
    seeds = [1337 + i for i in range(a.seeds)]
    t0 = time.time()
    log = lambda m: print(m, flush=True)  # noqa: E731
    results = run_all(jobs_for(a.steps, seeds), out, a.jobs, log, train=not a.analyze_only)
    an = analyze(results)
    table = format_table(an)
    lr_table = format_lr_table(results)
    print(table)
    print()
    print(lr_table)
    fig_path = Path(a.figure) if a.figure else out / "early_warning.png"
    figure(results, an, fig_path)
    from fp8lab.lab import early_warning as ew

    doc = {
        "settings": {
            "steps": a.steps,
            "seeds": seeds,
            "lr_mults": [1, *LR_MULTS],
            "spike_scale": SPIKE_SCALE,
            "outliers": OUTLIER,
            "divergence_factor": ew.DIVERGENCE_FACTOR,
            "lookback": ew.LOOKBACK,
            "z_threshold": ew.Z_THRESHOLD,
            "z_window": ew.Z_WINDOW,
        },
        "table": an["table"],
        "divergence": an["divergence"],
        "runs": [{k: v for k, v in r.items()} for r in an["runs"]],
        "markdown": table,
        "markdown_lr": lr_table,
        "wall_seconds": time.time() - t0,
    }
    from fp8lab.stats import json_safe

    (out / "early_warning.json").write_text(json.dumps(json_safe(doc), indent=1, default=str))
    print(f"wrote {out / 'early_warning.json'} and {fig_path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
