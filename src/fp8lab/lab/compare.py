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

The lab defines its own negative control, :data:`NEGATIVE_CONTROL` (E4M3 gradients with a fixed
scale of 1, i.e. no scaling): small gradients flush to zero, so the quantized layers barely learn
and the lab must report it as clearly worse than the baseline.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8lab.distributed.ddp import comm_summary
from fp8lab.lab import machine as machines
from fp8lab.lab import models
from fp8lab.lab import noise as noise_rule
from fp8lab.lab.data import Corpus, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.pool import Callback, Job, WorkerPool, check_count, set_threads
from fp8lab.lab.train import (
    CHECKPOINT,
    ConfigMismatchError,
    LabConfig,
    checkpoint_config,
    corpus_config,
    diverged_loss,
    mismatch_message,
    read_metrics,
    read_stats,
    recipe_settings,
    train_run,
)

SCHEMA_VERSION = 1
NEGATIVE_CONTROL = "e4m3-unscaled-grads"
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
#: the GPU of the "predicted step time" column (fp8lab.cost): the most widely rented FP8 GPU,
#: priced with the Hopper calibration (H200 NVL, held-out residuals within 1.5 %)
DEFAULT_COST_DEVICE = "h100"


# ----------------------------------------------------------------------------- recipes
def run_dir(out: Path, name: str) -> Path:
    """Where the run of recipe ``name`` lives under a comparison's ``out``: ``out/runs/NAME``;
    a recipe file (``path/to/fix.toml``) runs in ``out/runs/fix.toml`` (its file name, so an
    absolute or nested path never escapes ``out/runs``)."""
    p = Path(name)
    return out / "runs" / (p.name if p.suffix in (".toml", ".json") else name)


def lab_recipes() -> dict[str, Any]:
    """Recipes defined by the lab itself (not presets of ``fp8lab.recipes()``)."""
    from fp8lab.qtensor import QuantSpec
    from fp8lab.recipe import Recipe

    return {
        NEGATIVE_CONTROL: Recipe(
            name=NEGATIVE_CONTROL,
            input=QuantSpec(format="e4m3"),
            weight=QuantSpec(format="e4m3"),
            grad_output=QuantSpec(format="e4m3", scaling=1.0),
            # stated, as every preset does: the fingerprint (run directories resume by it)
            # predates the dataclass default's change to "high_precision"
            save_for_backward="quantized",
            description="NEGATIVE CONTROL, must fail: te-current's E4M3 forward, but gradients "
            "cast to E4M3 with a fixed scale of 1 (no scaling, no loss scaling). Gradients of a "
            "mean loss are ~1e-4..1e-6, below E4M3's smallest subnormal 2^-9, so they flush to "
            "zero and the quantized layers barely learn.",
            source="fp8lab training lab; gradient underflow without scaling: Micikevicius et "
            "al., 'Mixed Precision Training', arXiv 1710.03740; E5M2 for gradients: 'FP8 "
            "Formats for Deep Learning', arXiv 2209.05433",
        )
    }


#: a seed replica of a recipe: the same recipe under another ``train.seed`` (``bf16@seed1338``),
#: trained for the noise estimate (``noise_seeds``), never a row of the table
SEED_SEP = "@seed"


def seed_replica(name: str, seed: int) -> str:
    return f"{name}{SEED_SEP}{seed}"


def split_replica(name: str) -> tuple[str, int | None]:
    """``("bf16", 1338)`` for ``"bf16@seed1338"``; ``(name, None)`` for a recipe."""
    base, sep, seed = name.rpartition(SEED_SEP)
    if sep and base and seed.isdigit():
        return base, int(seed)
    return name, None


def config_for(cfg: LabConfig, name: str) -> LabConfig:
    """The configuration run ``name`` trains under: ``cfg``, with a replica's own seed."""
    seed = split_replica(name)[1]
    return cfg if seed is None else cfg.replace_train(seed=seed)


def resolve_recipe(name: str) -> Any:
    """A preset name, a lab recipe name, or a path to a recipe ``.toml`` / ``.json`` file (a seed
    replica ``NAME@seedS`` resolves to NAME's recipe)."""
    from fp8lab.recipe import Recipe, get_recipe, recipes

    name = split_replica(name)[0]
    own = lab_recipes()
    if name in own:
        return own[name]
    p = Path(name)
    if p.suffix in (".toml", ".json"):
        if not p.is_file():
            raise ValueError(f"no such recipe file: {name}")
        return Recipe.load(p)
    if name in recipes():
        return get_recipe(name)
    raise ValueError(
        f"unknown recipe {name!r}; valid: {', '.join([*recipes(), *own])} "
        "(or a path to a recipe .toml/.json file)"
    )


def available_recipes() -> list[str]:
    from fp8lab.recipe import recipes

    return [*recipes(), *lab_recipes()]


# ----------------------------------------------------------------------------- memory model
def _spec_bytes(spec: Any, n_rows: int, n_cols: int) -> float:
    """Bytes of one quantized [n_rows, n_cols] tensor: elements + per-block scales."""
    from fp8lab.formats import get_format

    elem = get_format(spec.format).bits / 8
    bm, bk = spec.block
    bm = n_rows if bm == -1 else bm
    bk = n_cols if bk == -1 else bk
    blocks = math.ceil(n_rows / bm) * math.ceil(n_cols / bk)
    scaling = spec.scaling if isinstance(spec.scaling, str) else ""
    scale_bytes = 1 if scaling.startswith(("mx", "nvfp4")) else 4  # E8M0 / E4M3 vs fp32 scales
    return n_rows * n_cols * elem + blocks * scale_bytes


_HP_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "e4m3": 1, "e5m2": 1}


def simulated_memory(model_cfg: GPTConfig, batch_size: int, recipe: Any) -> dict[str, float]:
    """Bytes the recipe would need on real hardware for one training step (a model, not a
    measurement: the simulation itself computes in fp32).

    weights: master weights (``recipe.master_weights``) + the low-precision working copy of each
    quantized Linear weight (elements + block scales). optimizer: AdamW's two moments
    (``recipe.optimizer_state``; fp8 adds one fp32 scale per 128 values). activations: what
    autograd keeps for backward per layer -- the input of every quantized Linear in the format it
    is saved in (``save_for_backward``), everything else (norm inputs, q/k/v, attention
    probabilities, SwiGLU branches, head input and logits) at 4 bytes for fp32 and 2 otherwise.
    """
    c = model_cfg
    d, f, L, V, T = c.d_model, c.d_ff, c.n_layer, c.vocab_size, c.block_size
    N = batch_size * T  # tokens per step
    linears = {"qkv": (3 * d, d), "proj": (d, d), "gate": (f, d), "up": (f, d), "down": (d, f)}
    n_params = V * d + T * d + L * (2 * d + sum(o * i for o, i in linears.values())) + d + V * d
    if recipe is None:
        recipe_hp, master, state, inp, wspec, save = "fp32", "fp32", "fp32", None, None, "hp"
    else:
        hp = {getattr(recipe, g).high_precision for g in ("fprop", "dgrad", "wgrad")}
        recipe_hp = "fp32" if hp == {"fp32"} else "bf16"
        master, state = recipe.master_weights, recipe.optimizer_state
        inp, wspec, save = recipe.input, recipe.weight, recipe.save_for_backward
    act = _HP_BYTES[recipe_hp]
    weights = n_params * _HP_BYTES[master]
    for out_f, in_f in linears.values():
        if wspec is not None:
            weights += L * _spec_bytes(wspec, out_f, in_f)
        elif recipe_hp != "fp32":
            weights += L * out_f * in_f * act
    optimizer = 2 * n_params * _STATE_BYTES[state]
    if _STATE_BYTES[state] == 1:
        optimizer += 2 * math.ceil(n_params / 128) * 4
    linear_inputs = {"qkv": d, "proj": d, "gate/up": d, "down": f}
    saved = 0.0
    for width in linear_inputs.values():
        if inp is not None and save == "quantized":
            saved += _spec_bytes(inp, N, width)
        else:
            saved += N * width * act
    other = N * (2 * d + 4 * d + 3 * f) + batch_size * c.n_head * T * T  # per layer
    activations = L * (saved + other * act) + N * (2 * d * act + V * 4)
    total = weights + optimizer + activations
    return {"weights": weights, "optimizer": optimizer, "activations": activations, "total": total}


def model_memory(
    model: Any, vocab_size: int, batch_size: int, block_size: int, recipe: Any
) -> dict[str, float]:
    """:func:`simulated_memory` for a user's model (any architecture), from the built model:
    weights and optimizer as there (every parameter, plus the low-precision copy of each Linear
    ``convert`` would quantize); activations only as far as they are known without the
    architecture, so a lower bound: the input of every such Linear (``save_for_backward``) and
    the fp32 logits."""
    from fp8lab.nn import select_linears

    N = batch_size * block_size
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if recipe is None:
        act, master, state, inp, wspec, save = 4, "fp32", "fp32", None, None, "hp"
    else:
        hp = {getattr(recipe, g).high_precision for g in ("fprop", "dgrad", "wgrad")}
        act = _HP_BYTES["fp32" if hp == {"fp32"} else "bf16"]
        master, state = recipe.master_weights, recipe.optimizer_state
        inp, wspec, save = recipe.input, recipe.weight, recipe.save_for_backward
    weights = n_params * _HP_BYTES[master]
    saved = 0.0
    for name in select_linears(model):
        layer = model.get_submodule(name)
        out_f, in_f = layer.weight.shape
        if type(layer).__name__ == "Conv1D":  # transformers' Conv1D stores the weight [in, out]
            in_f, out_f = out_f, in_f
        if wspec is not None:
            weights += _spec_bytes(wspec, out_f, in_f)
        elif act != 4:
            weights += out_f * in_f * act
        quantized = inp is not None and save == "quantized"
        saved += _spec_bytes(inp, N, in_f) if quantized else N * in_f * act
    optimizer = 2 * n_params * _STATE_BYTES[state]
    if _STATE_BYTES[state] == 1:
        optimizer += 2 * math.ceil(n_params / 128) * 4
    activations = saved + N * vocab_size * 4
    total = weights + optimizer + activations
    return {"weights": weights, "optimizer": optimizer, "activations": activations, "total": total}


# ----------------------------------------------------------------------------- running
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


def _val_curve(records: list[dict[str, Any]]) -> dict[int, float | None]:
    """A run's validation curve ``{step: val_loss}`` from its metrics records."""
    return {r["step"]: r.get("val_loss") for r in records if "val_loss" in r}


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
        pair = noise_rule.late_gap_pct(*(_val_curve(metrics[n]) for n in (a, b, baseline)))
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
    cfg: LabConfig, names: Sequence[str], device: str, model: Any = None
) -> dict[str, dict[str, Any]]:
    """Per recipe, the predicted GEMM + quantization time of one training step on ``device``
    (`fp8lab.cost.predict_step_ms`) of the model's quantized Linears (the layers ``convert``
    swaps, per-layer rules applied per name) on ``batch_size x block_size`` tokens:
    ``{"ms": float | None, "reason": str | None}`` (None and the reason when the cost model cannot
    price the recipe there). ``model``: the built, unconverted model (default: built here)."""
    from fp8lab.cost import linear_shapes, predict_or_reason

    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = models.build(cfg.model, cfg.train.seed)
    try:
        linears = linear_shapes(model)
    except ValueError as exc:  # nothing quantizable: every recipe n/a, the run is still reported
        return {n: {"ms": None, "reason": str(exc)} for n in names}
    tokens = cfg.train.batch_size * cfg.model.block_size
    out = {}
    for n in names:
        ms, why = predict_or_reason(resolve_recipe(n), device, linears=linears, tokens=tokens)
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
    ``machine`` (:func:`machine_of_runs` when None): what the caller already has.
    ``replicas``: the baseline's seed replicas (:func:`seed_replica`) for the noise estimate.

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
    directories ``runs/BASELINE@seedS``) for the noise estimate (:func:`noise_estimate`).

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
    if baseline not in names:
        names.insert(0, baseline)
    check_count("jobs", jobs, 1)
    check_count("threads", threads, 0, " (0 = the defaults)")
    check_count("noise_seeds", noise_seeds, 0)
    if any(split_replica(n)[1] is not None for n in names):
        raise ValueError(f"a recipe name may not end in {SEED_SEP}N (a seed replica's name)")
    replicas = [seed_replica(baseline, cfg.train.seed + i) for i in range(1, noise_seeds + 1)]
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
