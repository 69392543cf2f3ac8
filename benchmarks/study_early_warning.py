"""Early-warning study: which signal warns of a training failure, how early, and how often it
cries wolf on healthy runs (issue 15; definitions in docs/early_warning.md).

One command: ``python benchmarks/study_early_warning.py [--seeds 3] [--healthy-seeds 1]
[--jobs 2] [--out runs/early-warning] [--figure PATH] [--torch-device auto]`` (where the
spawned workers train; recorded as ``torch_device`` per run and in the settings, not part of a
cached run's identity). Every run trains the lab's default GPT
(2 layers, d_model 256, 8 x 128 bytes per step, the built-in corpus) with
``AnomalyGuard(policy="off")``: the guard's detectors run and report every step (warnings and
acting findings alike), nothing acts on them, so each run is bit-identical to an unguarded one.
`fp8lab.lab.early_warning.recording` adds the optional published indicators (activation
kurtosis, maximum attention logit, output log Z) with forward hooks. Scenarios, per seed:

- **spike**: te-delayed, a one-step gradient spike x 2^40 (``grad_spike_scale`` 1e12) at step
  100 of 160;
- **outliers**: te-delayed, 4 input channels of each ``mlp.down`` x 1000 from step 100 of 160;
- **range test** (the natural divergence): te-delayed at the default learning rate (1e-3 after
  25 warmup steps, then constant) for 100 steps, then Smith's learning-rate range test: the
  rate grows exponentially to 1024 x over ``ramp`` steps (100, or 200 for a slower drift) and
  stays there, 20 steps past the ramp's end. The model first learns, then, as the rate
  crosses the stability limit, the attention logits grow and the loss drifts up for tens of
  steps before it blows up (Wortsman et al. 2023, arXiv 2309.14322, describe both
  instabilities at high learning rate without qk-layernorm or z-loss, as here);
- **healthy**: te-delayed (every seed) and, for the first ``--healthy-seeds`` seeds, every
  other ``make demo`` recipe, default training config (200 steps), no fault: the false-alarm
  rate. The negative control ``e4m3-unscaled-grads`` is reported apart: its gradients really do
  underflow.

Evaluation runs only at the end (it never changes the trajectory) and ``stats.jsonl`` is off;
the guard's own per-operand rows are measured every 10 steps as in any guarded run. Each run's
per-step records are cached in OUT/runs/NAME.json (a rerun with the same settings reuses
them). Prints the tables, writes OUT/early_warning.json (everything), OUT/summary.json (the
tables' numbers only) and the figure OUT/early_warning.png (``--figure`` to put it elsewhere).
``--analyze-only`` reports on whatever is cached.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DEMO_NEGATIVE = "e4m3-unscaled-grads"
OUTLIER = {"outlier_channels": 4, "outlier_scale": 1000.0}
SPIKE_SCALE = 1e12
FAULT_STEP = 100
PLANTED_STEPS = 160
HEALTHY_STEPS = 200
#: the range tests: exponential growth of the learning rate from step `start`, `mult` x over
#: `steps` steps (then held); the run ends 20 steps after the ramp
RAMPS = ({"start": 100, "steps": 100, "mult": 1024.0}, {"start": 100, "steps": 200, "mult": 1024.0})
RAMP_TAIL = 20
#: an absolute rule for the maximum attention logit, reported beside its z-score rule: a logit
#: gap of 20 already leaves the runner-up a softmax weight of 2e-9 (one-hot attention); 100 is
#: far past that. Healthy runs here stay below 10 (measured: the JSON's `attn_abs_healthy_max`)
ATTN_ABS = 100.0
ATTN_ABS_SIGNAL = "attn_logit_max >= 100 (absolute)"


def ramp_name(r: dict[str, Any]) -> str:
    return f"range test, ramp {r['steps']}"


def jobs_for(seeds: list[int], healthy_seeds: int) -> list[dict[str, Any]]:
    """Every run of the study (see the module doc), most informative first."""
    from fp8lab.lab.compare import DEFAULT_RECIPES

    out = []
    for i, seed in enumerate(seeds):
        base = {"recipe": "te-delayed", "lr_mult": 1, "seed": seed}
        out.append(
            {
                **base,
                "scenario": "spike",
                "steps": PLANTED_STEPS,
                "fault": FAULT_STEP,
                "inject": {"grad_spike_step": FAULT_STEP, "grad_spike_scale": SPIKE_SCALE},
            }
        )
        out.append(
            {
                **base,
                "scenario": "outliers",
                "steps": PLANTED_STEPS,
                "fault": FAULT_STEP,
                "inject": {**OUTLIER, "outlier_from_step": FAULT_STEP},
            }
        )
        for r in RAMPS:
            out.append(
                {
                    **base,
                    "scenario": "range",
                    "inject": {},
                    "ramp": dict(r),
                    "steps": r["start"] + r["steps"] + RAMP_TAIL,
                }
            )
        for rec in DEFAULT_RECIPES:
            if rec == "te-delayed" or i < healthy_seeds:
                out.append(
                    {
                        "scenario": "healthy",
                        "recipe": rec,
                        "lr_mult": 1,
                        "seed": seed,
                        "steps": HEALTHY_STEPS,
                        "inject": {},
                    }
                )
    for j in out:
        tag = f"-ramp{j['ramp']['steps']}" if "ramp" in j else ""
        j["name"] = f"{j['scenario']}{tag}-{j['recipe']}-seed{j['seed']}"
    # the faults and the divergences of every seed first, then the healthy runs (te-delayed
    # first, deepseek-v3, 3x the step cost, last): a study cut short keeps its lead times
    prio = {"range": 0, "spike": 1, "outliers": 1, "healthy": 2}
    out.sort(
        key=lambda j: (
            prio[j["scenario"]],
            j["recipe"] != "te-delayed",
            j["recipe"] == "deepseek-v3",
            j["seed"],
        )
    )
    return out


def range_test_config(base: Any, ramp: dict[str, Any]) -> Any:
    """``base`` (a TrainConfig, its lr constant after warmup) whose learning rate, from step
    ``ramp["start"]`` on, grows exponentially to ``ramp["mult"]`` x ``base.lr`` over
    ``ramp["steps"]`` steps and then stays there: Smith's learning-rate range test (arXiv
    1506.01186) started from a healthy model, so the loss first goes down, then diverges as
    the learning rate crosses the stability limit."""
    from dataclasses import dataclass

    from fp8lab.lab.train import TrainConfig

    @dataclass(frozen=True)
    class RangeTest(TrainConfig):
        ramp_start: int = 0
        ramp_steps: int = 1
        ramp_mult: float = 1.0

        def lr_at(self, step: int) -> float:
            lr = super().lr_at(step)
            if step < self.ramp_start:
                return lr
            return lr * self.ramp_mult ** min(1.0, (step - self.ramp_start) / self.ramp_steps)

    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    return RangeTest(**{**fields, "min_lr_ratio": 1.0}, ramp_start=ramp["start"],
                     ramp_steps=ramp["steps"], ramp_mult=ramp["mult"])  # fmt: skip


def run_job(job: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Train one run on torch device ``device`` with the guard's detectors off-policy and every
    signal recorded."""
    import torch

    torch.set_num_threads(1)
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab import early_warning as ew
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.inject import InjectConfig
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run

    tc = TrainConfig()
    train = TrainConfig(
        steps=job["steps"],
        seed=job["seed"],
        lr=tc.lr * job["lr_mult"],
        warmup_steps=job.get("warmup", tc.warmup_steps),
        eval_every=job["steps"],
        stats_every=0,
        checkpoint_every=job["steps"],
    )
    if job.get("ramp"):
        train = range_test_config(train, job["ramp"])
    cfg = LabConfig(train=train, inject=InjectConfig(**job["inject"]))
    corpus = load_corpus(cfg.data, block_size=cfg.model.block_size)
    recipe = resolve_recipe(job["recipe"])  # presets and the lab's negative control
    rec = ew.SignalRecorder()
    t0 = time.perf_counter()
    with ew.recording(rec):
        res = train_run(recipe, cfg, corpus, None, rec, guard=AnomalyGuard(policy="off"),
                        torch_device=device)  # fmt: skip
    s = res.summary
    return {
        "job": job,
        "torch_device": device,
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


def _work(args: tuple[dict[str, Any], str, str]) -> dict[str, Any]:
    job, path, device = args
    try:
        out = run_job(job, device)
    except Exception as exc:  # one bad run must not take the others down
        return {"job": job, "error": f"{type(exc).__name__}: {exc}"}
    tmp = Path(path + ".tmp")
    from fp8lab.stats import json_safe

    # JSON has no NaN/inf: null, which the loss rule counts as non-finite
    tmp.write_text(json.dumps(json_safe(out), allow_nan=False, default=str))
    os.replace(tmp, path)
    return out


def run_all(
    jobs: list[dict[str, Any]], out: Path, n_jobs: int, log, train: bool = True,
    device: str = "cpu",
) -> list[dict[str, Any]]:  # fmt: skip
    """Cached results of ``jobs``, training the missing ones (``train``) on torch device
    ``device`` or leaving them out."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    done, todo = [], []
    for j in jobs:
        p = out / "runs" / f"{j['name']}.json"
        c = _cached(p, j)
        (done if c else todo).append(c if c else (j, str(p), device))
    log(f"{len(done)} runs cached, {len(todo)} to train ({n_jobs} processes)")
    if todo and not train:
        log("--analyze-only: left out " + ", ".join(j["name"] for j, _, _ in todo))
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
def _fires(recs: list[dict[str, Any]]) -> dict[str, list[int]]:
    from fp8lab.lab import early_warning as ew

    fires = {s: ew.firing_steps(recs, s) for s in ew.SIGNALS}
    fires[ATTN_ABS_SIGNAL] = [
        int(r["step"]) for r in recs
        if isinstance(r.get("attn_logit_max"), int | float) and r["attn_logit_max"] >= ATTN_ABS
    ]  # fmt: skip
    return fires


def signals_order() -> list[str]:
    from fp8lab.lab import early_warning as ew

    return [*ew.SIGNALS, ATTN_ABS_SIGNAL]


def analyze(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: divergence step and each signal's firing steps; per signal: the table cells."""
    from fp8lab.lab import early_warning as ew

    runs = []
    for r in results:
        recs = r["records"]
        div = ew.divergence_step([x.get("loss") for x in recs])
        runs.append({**r["job"], "steps_done": len(recs), "divergence_step": div,
                     "fires": _fires(recs), "summary": r["summary"]})  # fmt: skip
    runs.sort(key=lambda x: (x["scenario"], x["name"]))
    table = {}
    for s in signals_order():
        row: dict[str, Any] = {}
        for scen in ("spike", "outliers"):
            rs = [x for x in runs if x["scenario"] == scen]
            row[scen] = {"delay": [ew.detection_delay(x["fires"][s], x["fault"], ew.LOOKBACK)
                                   for x in rs]}  # fmt: skip
        for ramp in RAMPS:
            rs = [x for x in runs if x["scenario"] == "range" and x["ramp"] == ramp]
            row[ramp_name(ramp)] = {"lead": [ew.lead_time(x["fires"][s], x["divergence_step"])
                                             for x in rs]}  # fmt: skip
        for key, sel in (("healthy", lambda x: x["recipe"] != DEMO_NEGATIVE),
                         ("negative_control", lambda x: x["recipe"] == DEMO_NEGATIVE)):  # fmt: skip
            rs = [x for x in runs if x["scenario"] == "healthy" and sel(x)]
            n = sum(x["steps_done"] for x in rs)
            k = sum(len(x["fires"][s]) for x in rs)
            row[key] = {"firings": k, "steps": n,
                        "per_1000": ew.false_alarm_rate(k, n) if n else None,
                        "by_run": {x["name"]: len(x["fires"][s]) for x in rs}}  # fmt: skip
        table[s] = row
    div: dict[str, Any] = {}
    for scen in ("spike", "outliers"):
        rs = [x for x in runs if x["scenario"] == scen]
        div[scen] = [None if x["divergence_step"] is None else x["divergence_step"] - x["fault"]
                     for x in rs]  # fmt: skip
    for ramp in RAMPS:
        rs = [x for x in runs if x["scenario"] == "range" and x["ramp"] == ramp]
        div[ramp_name(ramp)] = [x["divergence_step"] for x in rs]
    hr = [x for x in runs if x["scenario"] == "healthy"]
    div["healthy_runs"] = len(hr)
    div["healthy_divergences"] = sum(x["divergence_step"] is not None for x in hr)
    return {"runs": runs, "table": table, "divergence": div}


def _cell(vals: list[int | None], none: str = "—") -> str:
    return ", ".join(none if v is None else str(v) for v in vals) if vals else "n/a"


def format_table(an: dict[str, Any]) -> str:
    """The README table (markdown): one row per signal, values per seed."""
    some = an["table"][signals_order()[0]]["healthy"]
    n_runs, n_steps = len(some["by_run"]), some["steps"]
    cols = [
        "spike: delay",
        "outliers: delay",
        *(f"{ramp_name(r)}: lead" for r in RAMPS),
        f"false alarms /1000 steps ({n_runs} healthy runs, {n_steps} steps)",
        "negative control /1000",
    ]
    lines = ["| signal | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    d = an["divergence"]
    lines.append(
        "| *loss crosses the divergence rule (planted: steps after the fault; range test: at "
        "step)* | "
        + " | ".join([_cell(d["spike"], "never"), _cell(d["outliers"], "never"),
                      *(_cell(d[ramp_name(r)], "never") for r in RAMPS),
                      f"{d['healthy_divergences']} of {d['healthy_runs']} runs diverged", ""])
        + " |"
    )  # fmt: skip
    from fp8lab.lab import early_warning as ew

    for s in signals_order():
        row = an["table"][s]
        cells = [_cell(row["spike"]["delay"]), _cell(row["outliers"]["delay"])]
        cells += [_cell(row[ramp_name(r)]["lead"]) for r in RAMPS]
        for key in ("healthy", "negative_control"):
            v = row[key]["per_1000"]
            cells.append("n/a" if v is None else f"{v:.1f}")
        name = s if s in ew.GUARD_SIGNALS or s == ATTN_ABS_SIGNAL else f"{s} (optional)"
        if s == "staleness":
            name = "staleness (warning)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _lr_at(job: dict[str, Any], step: int) -> float:
    from fp8lab.lab.train import TrainConfig

    tc = TrainConfig(steps=job["steps"], lr=TrainConfig().lr * job["lr_mult"])
    return range_test_config(tc, job["ramp"]).lr_at(step)


def format_range_table(results: list[dict[str, Any]]) -> str:
    """Per range-test run: where it diverged and what the optional indicators read before."""
    from fp8lab.lab import early_warning as ew

    lines = [
        "| ramp | seed | min loss (step) | divergence step (lr) | loss 20 steps before "
        "| max attention logit: ramp start / 50 before / at divergence | log Z: same steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted((r for r in results if r["job"]["scenario"] == "range"),
                  key=lambda r: (r["job"]["ramp"]["steps"], r["job"]["seed"]))  # fmt: skip
    for r in rows:
        j, recs = r["job"], r["records"]
        losses = [x.get("loss") for x in recs]
        fin = [(v, t) for t, v in enumerate(losses) if v is not None]
        lo, lo_t = min(fin)
        div = ew.divergence_step(losses)

        def at(key: str, t: int | None, recs: list[dict[str, Any]] = recs) -> str:
            v = recs[t].get(key) if t is not None and 0 <= t < len(recs) else None
            return "—" if v is None else f"{v:.3g}"

        start = j["ramp"]["start"]
        pts = (start, None if div is None else div - 50, div)
        lines.append(
            f"| {j['ramp']['steps']} | {j['seed']} | {lo:.3f} ({lo_t}) "
            f"| {'never' if div is None else f'{div} ({_lr_at(j, div):.3g})'} "
            f"| {at('loss', None if div is None else div - 20)} "
            f"| {' / '.join(at('attn_logit_max', t) for t in pts)} "
            f"| {' / '.join(at('log_z', t) for t in pts)} |"
        )
    return "\n".join(lines)


def _median(vals: list[int | None]) -> float | None:
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else None


def summary_doc(an: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers the README and docs quote (small: no per-step records)."""
    out: dict[str, Any] = {"divergence": an["divergence"], "signals": {}}
    for s, row in an["table"].items():
        out["signals"][s] = {
            "spike_delay": row["spike"]["delay"],
            "outliers_delay": row["outliers"]["delay"],
            **{f"{ramp_name(r)}_lead": row[ramp_name(r)]["lead"] for r in RAMPS},
            "healthy_per_1000": row["healthy"]["per_1000"],
            "healthy_firings": row["healthy"]["firings"],
            "negative_control_per_1000": row["negative_control"]["per_1000"],
        }
    healthy_attn = [x.get("attn_logit_max") for r in results if r["job"]["scenario"] == "healthy"
                    for x in r["records"]]  # fmt: skip
    healthy_attn = [v for v in healthy_attn if isinstance(v, int | float)]
    out["attn_abs_healthy_max"] = max(healthy_attn) if healthy_attn else None
    out["runs"] = [{k: x[k] for k in ("name", "scenario", "recipe", "seed", "steps_done",
                                      "divergence_step")} for x in an["runs"]]  # fmt: skip
    return out


def _raster(ax, run: dict[str, Any], mark: int | None, mark_label: str, title: str) -> None:
    """Firing steps of every signal of one analyzed run (one row per signal)."""
    sigs = signals_order()
    for i, sig in enumerate(sigs):
        steps = run["fires"][sig]
        ax.plot(steps, [i] * len(steps), "|", color="tab:blue", ms=7)
    if mark is not None:
        ax.axvline(mark, color="r", ls="--", lw=1, label=mark_label)
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(range(len(sigs)), list(sigs), fontsize=8)
    ax.set_ylim(len(sigs) - 0.5, -0.5)
    ax.set_xlim(0, run["steps"])
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)


def figure(results: list[dict[str, Any]], an: dict[str, Any], path: Path) -> None:
    """2 x 3 panels: the spike and outlier runs with key signals; every range test's loss; one
    range test's loss with its attention logit and log Z; its firing raster; false alarms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, arun = {}, {}
    for r in sorted(results, key=lambda r: r["job"]["seed"]):
        first.setdefault(r["job"]["name"].rsplit("-seed", 1)[0], r)
    for x in sorted(an["runs"], key=lambda x: x["seed"]):
        arun.setdefault(x["name"].rsplit("-seed", 1)[0], x)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=72)

    def series(r, key):
        return [x["step"] for x in r["records"]], [
            math.nan if x.get(key) is None else x[key] for x in r["records"]
        ]

    panels = ((axes[0, 0], "spike-te-delayed", ("headroom", "staleness")),
              (axes[0, 1], "outliers-te-delayed", ("kurtosis_linear_in", "kurtosis_block")))  # fmt: skip
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
    from fp8lab.lab import early_warning as ew

    for r in results:
        j = r["job"]
        if j["scenario"] != "range":
            continue
        c = "tab:red" if j["ramp"]["steps"] == RAMPS[0]["steps"] else "tab:blue"
        t, loss = series(r, "loss")
        ax.plot(t, [min(v, 8.0) for v in loss], color=c, lw=0.8, alpha=0.8)
        div = ew.divergence_step([x.get("loss") for x in r["records"]])
        if div is not None:
            ax.axvline(div, color=c, ls=":", lw=0.8)
    for r, c in zip(RAMPS, ("tab:red", "tab:blue"), strict=True):
        ax.plot([], [], color=c, label=ramp_name(r))
    ax.axvline(RAMPS[0]["start"], color="k", ls="--", lw=0.8, label="ramp starts")
    ax.set_ylim(2.0, 8.0)
    ax.set_title("range tests, every seed (dotted: divergence step)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (clipped at 8)")
    ax.legend(fontsize=8)
    key = f"range-ramp{RAMPS[1]['steps']}-te-delayed"
    r, x = first.get(key), arun.get(key)
    if r is not None and x is not None:
        ax = axes[1, 0]
        ax.plot(*series(r, "loss"), color="k", lw=1, label="loss")
        ax.set_ylim(2.0, 8.0)
        ax.set_ylabel("train loss")
        ax2 = ax.twinx()
        ax2.plot(*series(r, "attn_logit_max"), color="tab:blue", lw=1, label="max attention logit")
        ax2.plot(*series(r, "log_z"), color="tab:orange", lw=1, label="log Z")
        ax2.set_yscale("log")
        ax2.axhline(ATTN_ABS, color="tab:blue", ls=":", lw=0.8)
        ax2.legend(loc="upper left", fontsize=8)
        if x["divergence_step"] is not None:
            ax.axvline(x["divergence_step"], color="r", ls="--", lw=1, label="divergence")
        ax.legend(loc="center left", fontsize=8)
        ax.set_xlabel("step")
        ax.set_title(f"{ramp_name(RAMPS[1])}, seed {x['seed']}", fontsize=10)
        _raster(axes[1, 1], x, x["divergence_step"], "divergence", "firings, same run")
    ax = axes[1, 2]
    sigs = signals_order()
    rates = [an["table"][s]["healthy"]["per_1000"] or 0.0 for s in sigs]
    neg = [an["table"][s]["negative_control"]["per_1000"] or 0.0 for s in sigs]
    y = range(len(sigs))
    ax.barh([i - 0.2 for i in y], rates, height=0.4, label="healthy runs")
    ax.barh([i + 0.2 for i in y], neg, height=0.4, label=DEMO_NEGATIVE)
    ax.set_yticks(list(y), [s.replace(" (absolute)", "") for s in sigs], fontsize=8)
    ax.set_ylim(len(sigs) - 0.5, -0.5)
    ax.set_xlabel("firings per 1000 steps")
    ax.set_title("false alarms (no fault)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from _device import add_torch_device, torch_device

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 1337, 1338, ...")
    p.add_argument(
        "--healthy-seeds",
        type=int,
        default=1,
        help="seeds on which every demo recipe runs healthy (te-delayed: all)",
    )
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="runs/early-warning")
    p.add_argument("--figure", default=None, help="PNG path (default OUT/early_warning.png)")
    p.add_argument("--summary", default=None, help="summary JSON path (default OUT/summary.json)")
    p.add_argument("--analyze-only", action="store_true", help="use the cached runs only")
    add_torch_device(p)
    a = p.parse_args(argv)
    device = str(torch_device(a))  # checked here, used by the spawned workers
    if a.seeds < 1 or a.jobs < 1 or a.healthy_seeds < 0:
        p.error("--seeds and --jobs must be >= 1, --healthy-seeds >= 0")
    out = Path(a.out)
    seeds = [1337 + i for i in range(a.seeds)]
    t0 = time.time()
    log = lambda m: print(m, flush=True)  # noqa: E731
    results = run_all(jobs_for(seeds, a.healthy_seeds), out, a.jobs, log,
                      train=not a.analyze_only, device=device)  # fmt: skip
    an = analyze(results)
    table = format_table(an)
    range_table = format_range_table(results)
    print(table)
    print()
    print(range_table)
    fig_path = Path(a.figure) if a.figure else out / "early_warning.png"
    figure(results, an, fig_path)
    from fp8lab.lab import early_warning as ew
    from fp8lab.stats import json_safe

    settings = {
        "seeds": seeds, "healthy_seeds": a.healthy_seeds, "planted_steps": PLANTED_STEPS,
        "fault_step": FAULT_STEP, "healthy_steps": HEALTHY_STEPS, "ramps": list(RAMPS),
        "ramp_tail": RAMP_TAIL, "spike_scale": SPIKE_SCALE, "outliers": OUTLIER,
        "divergence_factor": ew.DIVERGENCE_FACTOR, "lookback": ew.LOOKBACK,
        "z_threshold": ew.Z_THRESHOLD, "z_window": ew.Z_WINDOW, "attn_abs": ATTN_ABS,
        "torch_device": device,
    }  # fmt: skip
    doc = {"settings": settings, "table": an["table"], "divergence": an["divergence"],
           "runs": an["runs"], "markdown": table, "markdown_range": range_table,
           "run_seconds": sum(r.get("seconds", 0.0) for r in results),
           "wall_seconds": time.time() - t0}  # fmt: skip
    (out / "early_warning.json").write_text(json.dumps(json_safe(doc), indent=1, default=str))
    summ = {"settings": settings, **summary_doc(an, results), "markdown": table,
            "markdown_range": range_table,
            "run_seconds": round(sum(r.get("seconds", 0.0) for r in results))}  # fmt: skip
    summ_path = Path(a.summary) if a.summary else out / "summary.json"
    summ_path.parent.mkdir(parents=True, exist_ok=True)
    summ_path.write_text(json.dumps(json_safe(summ), indent=1, default=str) + "\n")
    print(f"wrote {out / 'early_warning.json'}, {summ_path} and {fig_path} "
          f"({time.time() - t0:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
