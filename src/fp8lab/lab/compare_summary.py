"""A comparison's runs, summarised against the baseline: the ``--json`` summary and its files.

:func:`summarize_comparison` reads every run's ``run.json`` and metrics and returns the summary
(schema :data:`SCHEMA_VERSION`): per recipe the final losses, the relative gap to the baseline
(null for a diverged run, and for every run when the baseline diverged), the predicted step time
on a GPU (:func:`predicted_steps`, `fp8lab.cost`), the simulated memory
(`fp8lab.cost.memory`), and whether the gap is within the run-to-run noise
(:func:`noise_estimate`, :func:`within_noise`; the factor is `fp8lab.lab.noise.WITHIN`).
:func:`json_summary` is its ``--json`` part, :func:`write_metrics_csv` writes ``metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fp8lab.cost.memory import model_memory, simulated_memory
from fp8lab.distributed.ddp import comm_summary
from fp8lab.lab import models
from fp8lab.lab import noise as noise_rule
from fp8lab.lab.compare_runs import machine_of_runs, run_dir
from fp8lab.lab.recipes import NEGATIVE_CONTROL, resolve_recipe
from fp8lab.lab.train import LabConfig, diverged_loss, read_metrics, recipe_settings

SCHEMA_VERSION = 1
#: the GPU of the "predicted step time" column (fp8lab.cost): the most widely rented FP8 GPU,
#: priced with the Hopper calibration (H200 NVL, held-out residuals within 1.5 %)
DEFAULT_COST_DEVICE = "h100"


def noise_estimate(
    metrics: dict[str, list[dict[str, Any]]],
    names: Sequence[str],
    baseline: str,
    replica_finals: dict[str, float | None] | None = None,
    base_final: float | None = None,
) -> dict[str, Any]:
    """The run-to-run noise of the final validation loss, in % of the baseline's: the largest of
    (1) the |gap| between the baseline and its seed replicas (``replica_finals``: the same
    recipe under other seeds, `run_comparison`'s ``noise_seeds``) at the end and (2) the largest
    |gap| of ``fp32`` vs ``bf16`` (two runs that differ only in rounding) over the evaluations
    of the second half of the run, each where available. ``{"rel_gap_pct", "seeds_pct",
    "fp32_bf16_pct", "source", "factor": noise.WITHIN}``; ``rel_gap_pct`` None when neither is
    available or a loss is not finite. Gaps up to ``factor`` times it are not ranked. (2) alone
    is a lower bound: FP8 recipes perturb a run more than bf16 rounding does."""
    a, b = noise_rule.PAIR
    pair = None
    if a in names and b in names:  # the lab's one noise rule
        pair = noise_rule.late_gap_pct(*(val_curve(metrics[n]) for n in (a, b, baseline)))
    seeds = None
    finals = list((replica_finals or {}).values())
    if finals and base_final and None not in finals:
        seeds = max(abs(100.0 * (v - base_final) / base_final) for v in finals)
    parts = []
    if seeds is not None:
        parts.append(f"{baseline} under {len(finals)} other seed(s): largest |gap| at the end")
    if pair is not None:
        parts.append(f"{a} vs {b}: largest |gap| over the second half of the run")
    known = [v for v in (seeds, pair) if v is not None]
    if len(parts) > 1:
        source = "the larger of " + " and ".join(parts)
    elif parts:
        source = parts[0]
    else:
        source = f"none: the comparison needs {a} and {b}, or noise seeds, to estimate it"
    return {
        "rel_gap_pct": max(known) if known else None,
        "seeds_pct": seeds,
        "fp32_bf16_pct": pair,
        "factor": noise_rule.WITHIN,
        "source": source,
    }


def within_noise(gap: float | None, noise: dict[str, Any]) -> bool | None:
    """Whether a relative gap (%) is inside the noise band (None when either is unknown)."""
    if gap is None or noise.get("rel_gap_pct") is None:
        return None
    return abs(gap) <= noise["factor"] * noise["rel_gap_pct"]


def predicted_steps(
    cfg: LabConfig, names: Sequence[str], device: str, model: Any = None,
    recipes: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per recipe, the predicted GEMM + quantization time of one training step on ``device``
    (`fp8lab.cost.predict_step_ms`) of the model's quantized Linears (the layers ``convert``
    swaps, per-layer rules applied per name) on ``batch_size x block_size`` tokens:
    ``{"ms": float | None, "reason": str | None}`` (None and the reason when the cost model cannot
    price the recipe there). ``model``: the built, unconverted model (default: built here);
    ``recipes``: name -> Recipe for names that are not presets or files (``fp8lab debug``'s
    planted scenarios)."""
    from fp8lab.cost import expert_routing, linear_shapes, predict_or_reason

    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = models.build(cfg.model, cfg.train.seed)
    try:
        linears = linear_shapes(model)
    except ValueError as exc:  # nothing quantizable: every recipe n/a, the run is still reported
        return {n: {"ms": None, "reason": str(exc)} for n in names}
    tokens = cfg.train.batch_size * cfg.model.block_size
    experts = expert_routing(model)  # MoE experts: priced on their share of the tokens
    out = {}
    for n in names:
        rec = (recipes or {}).get(n) or resolve_recipe(n)
        ms, why = predict_or_reason(rec, device, linears=linears, tokens=tokens, experts=experts)
        out[n] = {"ms": ms, "reason": why}
    return out


def summarize_comparison(
    cfg: LabConfig,
    names: Sequence[str],
    baseline: str,
    out: Path,
    device: str = DEFAULT_COST_DEVICE,
    *,
    metrics: dict[str, list[dict[str, Any]]] | None = None,
    user_model: Any = None,
    machine: dict[str, Any] | None = None,
    replicas: Sequence[str] = (),
) -> dict[str, Any]:
    """The summary: the ``--json`` schema (schema_version, baseline, baseline_diverged, device,
    machine, noise, recipes{...}) + ``details`` (spikes, step time, memory, settings, predicted
    step, the machine of each run, whether its gap is within noise) for the report. ``device``:
    the GPU of ``predicted_step_ms`` (:func:`predicted_steps`; null with the reason in
    ``details[name]["predicted_step"]`` when the recipe cannot be priced there). ``metrics``
    (read from ``out`` when None), ``user_model`` (a user's model, built here when None) and
    ``machine`` (`fp8lab.lab.compare_runs.machine_of_runs` when None): what the caller already has.
    ``replicas``: the baseline's seed replicas (`fp8lab.lab.recipes.seed_replica`) for the noise
    estimate.

    Gaps are null for a diverged recipe, and for every recipe when the baseline diverged.
    ``noise`` (:func:`noise_estimate`) is how far fp32 and bf16 end apart; each recipe's
    ``details[name]["within_noise"]`` says whether its gap is inside ``noise.factor`` times it."""
    runs = {n: json.loads((run_dir(out, n) / "run.json").read_text()) for n in names}
    if metrics is None:
        metrics = {n: read_metrics(run_dir(out, n)) for n in names}
    base_final = runs[baseline]["summary"]["final_val_loss"]
    vocab = cfg.model.vocab_size
    if user_model is None and not models.is_builtin(cfg.model):  # unconverted: memory model
        with torch.random.fork_rng(devices=[]):
            user_model = models.build(cfg.model, cfg.train.seed)
    predicted = predicted_steps(cfg, names, device, user_model)
    diverged = {n: _diverged(runs[n]["summary"], runs[n].get("vocab_size", vocab)) for n in names}
    noise = _noise(out, metrics, baseline, replicas, base_final, vocab, diverged)
    table: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for n in names:
        s = runs[n]["summary"]
        no_gap = diverged[n] or diverged[baseline]  # a diverged baseline: no gap at all
        table[n] = _recipe_row(s, metrics[n], metrics[baseline], base_final, no_gap)
        table[n].update(diverged=diverged[n], predicted_step_ms=predicted[n]["ms"])
        table[n]["guard_events"] = s.get("guard_events", [])  # the anomaly guard's actions
        # under torchrun: ranks, amax group, gradient communication (null on one process)
        table[n]["distributed"] = comm_summary(metrics[n])
        recipe = resolve_recipe(n)
        details[n] = {
            "spikes": s["spikes"],
            "steps_done": s["steps_done"],
            "step_time_ms": s["step_time_ms"],
            "memory_bytes": _memory(cfg, user_model, recipe),
            "settings": recipe_settings(recipe),
            "negative_control": n == NEGATIVE_CONTROL,
            "predicted_step": {"device": device, **predicted[n]},
            # the machine that finished this run (null: written before fp8lab recorded it)
            "machine": runs[n].get("machine"),
            "within_noise": None if n == baseline else within_noise(table[n]["rel_gap_pct"], noise),
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "baseline": baseline,
        "baseline_diverged": diverged[baseline],
        "device": device,
        "machine": machine if machine is not None else machine_of_runs(),
        "noise": noise,
        "recipes": table,
        "details": details,
    }


def _recipe_row(
    s: dict[str, Any],
    records: list[dict[str, Any]],
    base_records: list[dict[str, Any]],
    base_final: float | None,
    no_gap: bool,
) -> dict[str, Any]:
    """A recipe's ``--json`` row up to ``tokens_per_s`` (gaps null when ``no_gap``)."""
    base_val = {r["step"]: r["val_loss"] for r in base_records if "val_loss" in r}
    gaps = [_rel_gap(r["val_loss"], base_val.get(r["step"])) for r in records
            if "val_loss" in r and r["step"] in base_val]  # fmt: skip
    finite_gaps = [g for g in gaps if g is not None]
    return {
        "final_train_loss": s["final_train_loss"],
        "final_val_loss": s["final_val_loss"],
        "rel_gap_pct": None if no_gap else _rel_gap(s["final_val_loss"], base_final),
        "max_rel_gap_pct": max(finite_gaps) if finite_gaps and not no_gap else None,
        "skipped_steps": s["skipped_steps"],
        "tokens_per_s": s["tokens_per_s"],
    }


def _memory(cfg: LabConfig, user_model: Any, recipe: Any) -> dict[str, float]:
    """Simulated memory of a recipe's training (the built-in GPT or the user's model)."""
    bs, T = cfg.train.batch_size, cfg.model.block_size
    if user_model is None:
        return simulated_memory(cfg.model, bs, recipe)
    v = models.vocab_size_of(user_model, cfg.model)
    return model_memory(user_model, v, bs, T, recipe)


def _noise(
    out: Path,
    metrics: dict[str, list[dict[str, Any]]],
    baseline: str,
    replicas: Sequence[str],
    base_final: float | None,
    vocab: int,
    diverged: dict[str, bool],
) -> dict[str, Any]:
    """`noise_estimate` of the healthy runs and the seed replicas (a diverged run says nothing
    about the noise; a diverged baseline: no estimate)."""
    rep_finals = {}
    for r in replicas:
        rs = json.loads((run_dir(out, r) / "run.json").read_text())["summary"]
        rep_finals[r] = None if _diverged(rs, vocab) else rs["final_val_loss"]
    healthy = [n for n, d in diverged.items() if not d]
    noise = noise_estimate(metrics, healthy, baseline, rep_finals, base_final)
    if diverged[baseline]:
        noise["rel_gap_pct"] = None
    return noise


JSON_KEYS = ("schema_version", "baseline", "baseline_diverged", "device", "machine", "noise",
             "recipes")  # fmt: skip


def json_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` schema (schema_version 1; ``baseline_diverged``, ``device``, ``machine``,
    ``noise`` and the recipes' ``predicted_step_ms`` added since, fields are only ever added),
    without the report's extras."""
    return {k: summary[k] for k in JSON_KEYS if k in summary}


def write_metrics_csv(
    names: Sequence[str], out: Path, metrics: dict[str, list[dict[str, Any]]] | None = None
) -> Path:
    cols = ["recipe", "step", "lr", "train_loss", "val_loss", "grad_norm", "skipped",
            "skipped_steps", "loss_scale", "spike", "tokens", "step_time_s"]  # fmt: skip
    path = out / "metrics.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for n in names:
            for r in metrics[n] if metrics is not None else read_metrics(run_dir(out, n)):
                w.writerow({"recipe": n, **{k: ("" if v is None else v) for k, v in r.items()}})
    return path


def _rel_gap(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    g = 100.0 * (value - base) / base
    return g if math.isfinite(g) else None


def _diverged(s: dict[str, Any], vocab_size: int) -> bool:
    # the loss rule again: run.json files written before it existed (or before its margin)
    # say otherwise; a run that stopped early trusts its own flag (non-finite steps in a row)
    if s["diverged"] and not s.get("complete", False):
        return True
    return diverged_loss(s["final_train_loss"], s["final_val_loss"], vocab_size)


def val_curve(records: list[dict[str, Any]]) -> dict[int, float | None]:
    """A run's validation curve ``{step: val_loss}`` from its metrics records."""
    return {r["step"]: r.get("val_loss") for r in records if "val_loss" in r}
