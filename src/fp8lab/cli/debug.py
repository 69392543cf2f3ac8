"""``fp8lab debug``: find which GEMM of which layer breaks an FP8 run, and test a fix.

The lab (``fp8lab.lab.debug``) runs the method and returns the result; this command writes the
report (``fp8lab.report.debug``), prints progress per probe and turns bad input into exit 2.
"""

from __future__ import annotations

import json
import time
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
    echo_machine_mismatch,
    fail,
    json_flag,
    lab_config,
    stop_on_sigterm,
    use_executor,
    use_torch_device,
    with_run_options,
)

HELP = """Find which operand of which GEMM of which layer makes a low-precision run drift from
its baseline, and test remedies, on a CPU. Seven stages: (1) gap of R to the baseline, and the
noise (fp32 vs bf16, two runs differing only in rounding; a gap within max(0.01 %, 3x the
noise) is "no FP8 problem found"); (2) recovery: R's checkpoint continued under the baseline; (3) fake
quantization: R's grids with current scaling; (4) screening: one training step replayed bit for
bit from R's checkpoints with one (layer, GEMM, role) cell at a time in high precision, scored by
the share of the error of the AdamW update it removes; (5) confirmation probes per role and GEMM, then group
testing over layers (ordered by each operand's pair of GEMMs and the culprit GEMM); (6) remedies for the culprit (current scaling, finer blocks, E5M2 for
gradients, high precision for the culprit cells), each trained, with its gap and relative_cost;
(7) verdict: OUT/report.html, report.md and OUT/fix.toml (a per-layer recipe file that
`fp8lab compare --recipes OUT/fix.toml` accepts), with the same fix for Megatron-LM
(OUT/fix.megatron.yaml, --te-precision-config-file) and Transformer Engine's debug tool
(OUT/fix.te.yaml). --scenario plants a known fault in the default
model (--list-scenarios). --json prints exactly {"schema_version": 1, "recipe", "baseline",
"gap_pct", "noise_pct", "recovers", "culprit": {"role", "gemm", "layers"} (plus "kind" for a culprit other than an operand:
norm_weight, attention, loss_scale) or null,
"attribution": [{"layer", "gemm", "role", "score"}], "remedies": [{"name", "gap_pct",
"relative_cost"}], "fix", "probes": [{"name", "gap_pct"}]} (non-finite numbers null). Rerunning
with the same --out resumes finished probes. --device GPU: the report and --json (fields
"device", "predicted_step_ms": {"run", "fix"}) give the predicted step time of the run's
recipe and of its fix on that GPU, as fp8lab compare --device does (null when the cost model
cannot price a recipe there). --from-checkpoint PATH debugs a run fp8lab did
not train: every probe starts from a checkpoint of your own loop (fp8lab.save_debug_checkpoint:
weights, optimizer moments, FP8 state) and trains --steps from there on --data, with --model
your model (its weights must fit) and --recipe the recipe you trained with (its [[layer]] rules
may name your model's layers); OUT/fix.toml names your layers, so
fp8lab.nn.convert(model, "OUT/fix.toml") applies it. Exit code 2 on bad input.
"""


def _progress(quiet: bool):
    """One line on stderr per stage and per finished probe (and screening progress)."""
    t0 = time.perf_counter()
    seen: dict[str, int] = {}

    def on_event(ev: dict[str, Any]) -> None:
        if quiet:
            return
        t = f"[{time.perf_counter() - t0:6.0f} s]"
        kind = ev.get("event")
        if echo_machine_mismatch(ev):
            return
        if kind == "stage":
            typer.echo(f"{t} == {ev['text']}", err=True)
        elif kind == "probe":
            g = ev.get("gap_pct")
            typer.echo(f"{t} probe {ev['probe']}: gap "
                       + ("n/a" if g is None else f"{g:+.3f} %")
                       + f"  ({ev.get('label', '')})", err=True)  # fmt: skip
        elif kind == "start":
            name = ev.get("probe", ev.get("recipe"))
            if name not in seen:
                seen[name] = 1
                typer.echo(f"{t}   training {name} from step {ev['step']}/{ev['steps']}", err=True)
        elif kind == "replay":
            every = max(1, ev["total"] // 4)
            if ev["done"] % every == 0 or ev["done"] == ev["total"]:
                typer.echo(f"{t}   {ev['probe']}: {ev['done']}/{ev['total']} cells replayed",
                           err=True)  # fmt: skip

    return on_event


def _list_scenarios() -> None:
    from fp8lab.lab.debug.scenarios import SCENARIOS

    for s in SCENARIOS.values():
        typer.echo(f"{s.name:<20} {s.description}")


Recipe = Annotated[str | None, typer.Option(
    "--recipe",
    help="The recipe that drifts: a preset, 'e4m3-unscaled-grads', or "
    "a recipe .toml/.json file (per-layer [[layer]] rules allowed).",
    show_default=False,
)]  # fmt: skip
Baseline = Annotated[str, typer.Option("--baseline", help="The reference recipe.")]
Scenario = Annotated[str | None, typer.Option(
    "--scenario",
    help="Plant a built-in fault (see --list-scenarios) instead of --recipe.",
    show_default=False,
)]  # fmt: skip
ListScenarios = Annotated[bool, typer.Option(
    "--list-scenarios", help="List the built-in scenarios and exit.")]  # fmt: skip
Model = Annotated[str | None, typer.Option(
    "--model",
    help="The model, as for fp8lab compare: 'gpt', MODULE:FACTORY, "
    "path/to/file.py:FACTORY, hf:CONFIG.json or hf:DIR (a save_pretrained directory: "
    "its weights).",
    show_default=False,
)]  # fmt: skip
Data = Annotated[list[Path] | None, typer.Option(
    "--data", help="Text file or folder to train on (repeatable), or one .bin/.npy token "
    "file, as for fp8lab compare.")]  # fmt: skip
Config = Annotated[Path | None, typer.Option(
    "--config", help="TOML file with [model] [data] [train] [inject] tables.")]  # fmt: skip
Overrides = Annotated[list[str] | None, typer.Option(
    "--set",
    help="Override one config value, SECTION.KEY=VALUE (repeatable), as for fp8lab compare.",
)]  # fmt: skip
Steps = Annotated[int | None, typer.Option("--steps", min=4, help="Training steps per probe.")]
Layers = Annotated[str | None, typer.Option(
    "--layers",
    help="Comma list of globs: search only these converted layers (default all).",
    show_default=False,
)]  # fmt: skip
Checkpoints = Annotated[int, typer.Option(
    "--checkpoints", min=1, max=20, help="Checkpoints of R screened by replay.")]  # fmt: skip
Jobs = Annotated[int, typer.Option(
    "--jobs",
    min=1,
    help="Probes trained at once (processes); 1 under torchrun, where every rank "
    "trains each probe in turn (torchrun --nproc-per-node N -m fp8lab debug ...).",
)]  # fmt: skip
Threads = Annotated[int, typer.Option(
    "--threads", min=0, help="torch and numba threads per process (0 = defaults).")]  # fmt: skip
FromCheckpoint = Annotated[Path | None, typer.Option(
    "--from-checkpoint", show_default=False, help="Start from this checkpoint of your own "
    "training loop (fp8lab.save_debug_checkpoint); needs --recipe and --model.")]  # fmt: skip
JsonOut = json_flag("the result")
CostDevice = Annotated[str | None, typer.Option(
    "--device",
    help="GPU of the predicted step time of the run and of its fix (fp8lab cost): h100 "
    "(default), h200, h200-nvl, b200, b300.",
    show_default=False,
)]  # fmt: skip


def debug_cmd(
    recipe: Recipe = None, baseline: Baseline = "bf16", scenario: Scenario = None,
    list_scenarios: ListScenarios = False, model: Model = None, data: Data = None,
    config: Config = None, overrides: Overrides = None, steps: Steps = None,
    layers: Layers = None, checkpoints: Checkpoints = 3, out: OutDir = Path("runs/debug"),
    jobs: Jobs = 1, threads: Threads = 0, json_out: JsonOut = False, quiet: Quiet = False,
    from_checkpoint: FromCheckpoint = None, device: CostDevice = None,
    executor: Executor = "local", ray_address: RayAddress = None,
    torch_device: TorchDevice = "auto",
    tokenizer: Tokenizer = None, token_dtype: TokenDtype = None, init_from: InitFrom = None,
) -> None:  # fmt: skip
    """``fp8lab debug`` (help: `HELP`): validate the options, run the method, render."""
    from fp8lab.lab.debug import run_debug
    from fp8lab.report.debug import write_report

    if list_scenarios:
        _list_scenarios()
        return
    with clear_errors():
        if from_checkpoint is not None and scenario is not None:
            raise fail("--from-checkpoint debugs your own run: give --recipe (the recipe it "
                       "trained with), not --scenario")  # fmt: skip
        use_torch_device(torch_device)  # before torchrun's group: NCCL on the rank's GPU
        use_executor(executor, ray_address)
        inputs = {"tokenizer": tokenizer, "token_dtype": token_dtype, "init_from": init_from}
        rec, cfg, expect, globs, rank_ctx = _setup(recipe, scenario, config, overrides, model,
                                                   steps, data, layers, jobs, inputs,
                                                   from_checkpoint)  # fmt: skip
        device = _cost_device(device)  # an unknown --device fails before any training
    main = rank_ctx is None or rank_ctx.is_main  # torchrun: rank 0 alone writes and prints
    stop_on_sigterm()
    t0 = time.perf_counter()
    with clear_errors(INTERRUPTED_RESUME):
        result = run_debug(rec, cfg, out, baseline=baseline, jobs=jobs, threads=threads,
                           layers=globs, checkpoints=checkpoints,
                           callback=_progress(quiet or not main), scenario=scenario,
                           start=from_checkpoint)  # fmt: skip
        if rank_ctx is not None:
            from fp8lab.distributed.runtime import leave_group

            leave_group()  # the ranks' shared work is done
        if not main:
            return
        if expect is not None:  # layers computed from R's run (emergent failures)
            from fp8lab.lab.debug.scenarios import resolve_expect

            expect = resolve_expect(expect, Path(out) / "probes" / "recipe")
        result.details["predicted_step"] = _predicted(cfg, rec, result.fix, device)
        write_report(out, result, command=command_line(), expect=expect)
    _render(result, out, json_out, t0)


def _cost_device(device: str | None) -> str:
    """``--device``, checked (ValueError naming the valid devices), default compare's."""
    from fp8lab.cost import get_device
    from fp8lab.lab.compare_summary import DEFAULT_COST_DEVICE

    return get_device(device or DEFAULT_COST_DEVICE).name


def _predicted(cfg: Any, rec: Any, fix: str | None, device: str) -> dict[str, Any]:
    """The predicted step time on ``device`` of the run's recipe and of its fix file (when
    there is one): ``{"device", "recipes": {"run" | "fix": {"ms", "reason"}}}``
    (`fp8lab.lab.compare_summary.predicted_steps`)."""
    from fp8lab.lab.compare_summary import predicted_steps
    from fp8lab.recipe import Recipe

    names = {"run": rec if isinstance(rec, Recipe) else str(rec)}
    if fix:
        names["fix"] = str(fix)
    objs = {k: v for k, v in names.items() if isinstance(v, Recipe)}
    keys = [k if k in objs else v for k, v in names.items()]
    got = predicted_steps(cfg, keys, device, recipes=objs)
    return {"device": device, "recipes": dict(zip(names, got.values(), strict=True))}


def _setup(
    recipe: str | None, scenario: str | None, config: Path | None, overrides: list[str] | None,
    model: str | None, steps: int | None, data: Any, layers: str | None, jobs: int,
    inputs: dict[str, Any] | None = None, start: Path | None = None,
) -> tuple[Any, Any, Any, list[str] | None, Any]:  # fmt: skip
    """Check the options before any training: (recipe, LabConfig, the planted fault's
    expectation, layer globs, the torchrun rank context). ``inputs``: --tokenizer,
    --token-dtype, --init-from (`with_run_options`); ``start``: --from-checkpoint, which
    needs the user's model named (--model, or [model] factory in --config)."""
    from fp8lab.distributed.runtime import check_global_batch, check_jobs, init_from_env
    from fp8lab.lab.debug.scenarios import get_scenario, plant
    from fp8lab.lab.machine import torch_device
    from fp8lab.lab.models import is_builtin

    if (recipe is None) == (scenario is None):
        raise fail("give exactly one of --recipe and --scenario (--list-scenarios "
                   "lists the scenarios)")  # fmt: skip
    cfg, _ = lab_config(config)
    if scenario is not None:
        cfg = cfg.replace_train(**get_scenario(scenario).train)
    cfg = with_run_options(cfg, overrides, model, steps, data, **(inputs or {}))
    if start is not None and model is None and is_builtin(cfg.model):
        raise ValueError(
            f"--from-checkpoint {start}: give --model, the model your loop trained "
            "(MODULE:FACTORY, path/to/file.py:FACTORY, hf:CONFIG.json or hf:DIR; --model gpt "
            "for fp8lab's built-in GPT): the checkpoint's weights are loaded into it"
        )
    cfg = check_model_data(cfg)  # weight files; tokens that fit the model's vocabulary
    expect = None
    if scenario is not None:
        rec, cfg, expect = plant(scenario, cfg)
    else:
        rec = recipe
    globs = [g.strip() for g in layers.split(",") if g.strip()] if layers else None
    if layers is not None and not globs:
        raise ValueError("--layers: no glob given")
    check_jobs(jobs, "probes")  # under torchrun every rank runs each probe in turn
    check_global_batch(cfg.train.batch_size)
    return rec, cfg, expect, globs, init_from_env(device=torch_device())


def _render(result: Any, out: Path, json_out: bool, t0: float) -> None:
    """The result on stdout: JSON, or the verdict, the fix and the report's path."""
    if json_out:
        from fp8lab.lab.machine import torch_device

        pred = result.details.get("predicted_step") or {"device": None, "recipes": {}}
        doc = {**result.to_json(), "torch_device": str(torch_device()),  # resolved
               "device": pred["device"],
               "predicted_step_ms": {k: (pred["recipes"].get(k) or {}).get("ms")
                                     for k in ("run", "fix")}}  # fmt: skip
        typer.echo(json.dumps(doc, allow_nan=False))
        return
    typer.echo(result.verdict)
    if result.fix:
        typer.echo(f"\nfix: {result.fix}  (fp8lab compare --recipes {result.fix}; in your "
                   f"code: fp8lab.nn.convert(model, {result.fix!r}))")  # fmt: skip
    typer.echo(f"report: {out / 'report.html'}  ({time.perf_counter() - t0:.0f} s)")


def register(app: typer.Typer) -> None:
    """Register ``fp8lab debug`` on ``app``."""
    app.command("debug", help=HELP)(debug_cmd)
