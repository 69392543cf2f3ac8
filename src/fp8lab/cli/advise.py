"""``fp8lab advise``: the fastest per-layer recipe that keeps a model within a loss budget.

The lab (`fp8lab.lab.advise.run_advise`) runs the search and writes ``advise.toml``, its
Megatron-LM and TE forms and ``advise_result.json``; this command checks the options, prints
progress on stderr, writes the report (`fp8lab.report.advise`) and turns bad input into one
``Error:`` line and exit code 2.
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
    comma_items,
    command_line,
    echo_machine_mismatch,
    json_flag,
    lab_config,
    stop_on_sigterm,
    use_executor,
    use_torch_device,
    with_run_options,
)

HELP = """Find the fastest recipe per layer that keeps the final validation loss within
--budget percent of bf16's, on the GPU --device (the cost model's predicted step time). The
gap is the mean over --seeds of the paired gap (a probe and bf16 trained on the same seed and
batches); a budget below 2x the fp32-vs-bf16 noise is an error. Steps: price every candidate
per layer; train bf16, fp32 (the noise) and every candidate alone; rank the layers of each
candidate faster than the first one within the budget by a one-step replay with each layer on
that one; group-test the fewest promoted layers within the budget; choose the fastest measured
recipe within it. Writes OUT/advise.toml (base = + [[layer]]: fp8lab compare --recipes
OUT/advise.toml, fp8lab.nn.convert(model, "OUT/advise.toml")), OUT/advise.megatron.yaml,
OUT/advise.te.yaml, OUT/advise_result.json, OUT/report.md, OUT/report.html and
OUT/figures/pareto.png (the Pareto front: predicted speedup against measured gap). Every probe
is a run under OUT/probes, resumed on a rerun with the same --out, --jobs at a time (--executor
local or ray). --json prints one line: {"schema_version": 1, "device", "budget_pct",
"noise_pct", "seeds", "candidates", "ladder", "skipped", "price_overrides", "chosen",
"best_single", "pareto", "probes", "ranking", "verdict", "files"} (docs/advise.md). Exit code
2 on bad input.
"""

Budget = Annotated[str, typer.Option(
    "--budget", help="The loss budget: the final validation-loss gap to bf16 in percent "
    "(0.5 or 0.5%).", show_default=False)]  # fmt: skip
Device = Annotated[str, typer.Option(
    "--device", help="GPU the recipe is chosen for (fp8lab cost): h100, h200, h200-nvl, b200, "
    "b300.")]  # fmt: skip
Candidates = Annotated[str | None, typer.Option(
    "--candidates", help="Comma list of presets to choose from (bf16 is always added). "
    "Default: those of nvfp4-te,mxfp8,te-current,te-delayed,deepseek-v3,bf16 the device can "
    "run.", show_default=False)]  # fmt: skip
Steps = Annotated[int | None, typer.Option("--steps", min=4, help="Training steps per probe.")]
Seeds = Annotated[int, typer.Option(
    "--seeds", min=1, help="Seeds per probe (train.seed, +1, ...): the gap is the mean of the "
    "paired gaps.")]  # fmt: skip
Jobs = Annotated[int, typer.Option("--jobs", min=1, help="Probes trained at once.")]
Threads = Annotated[int, typer.Option(
    "--threads", min=0, help="torch and numba threads per process (0 = defaults).")]  # fmt: skip
Model = Annotated[str | None, typer.Option(
    "--model", help="The model, as for fp8lab compare: 'gpt', MODULE:FACTORY, "
    "path/to/file.py:FACTORY, hf:CONFIG.json or hf:DIR.", show_default=False)]  # fmt: skip
Data = Annotated[list[Path] | None, typer.Option(
    "--data", help="Text file or folder to train on (repeatable), or one .bin/.npy token "
    "file, as for fp8lab compare.")]  # fmt: skip
Config = Annotated[Path | None, typer.Option(
    "--config", help="TOML file with [model] [data] [train] tables.")]  # fmt: skip
Overrides = Annotated[list[str] | None, typer.Option(
    "--set", help="Override one config value, SECTION.KEY=VALUE (repeatable), as for fp8lab "
    "compare.")]  # fmt: skip
PriceSet = Annotated[list[str] | None, typer.Option(
    "--price-set", help="Price another width of the trained model, SECTION.KEY=VALUE "
    "(repeatable; e.g. model.d_model=2048 train.batch_size=16): train a narrow proxy, choose "
    "for the full-width model. Its Linear layers must have the same names.")]  # fmt: skip
JsonOut = json_flag("the result")


def _progress(quiet: bool):
    """One line on stderr per stage and per measured probe (also when not a terminal)."""
    t0 = time.perf_counter()
    seen: set[str] = set()

    def on_event(ev: dict[str, Any]) -> None:
        if quiet or echo_machine_mismatch(ev):
            return
        t = f"[{time.perf_counter() - t0:6.0f} s]"
        kind = ev.get("event")
        if kind == "stage":
            typer.echo(f"{t} == {ev['text']}", err=True)
        elif kind == "probe":
            g, s = ev.get("gap_pct"), ev.get("speedup")
            typer.echo(f"{t} {ev['probe']}: gap " + ("n/a" if g is None else f"{g:+.3f} %")
                       + ", predicted " + ("n/a" if s is None else f"{s:.2f}x")
                       + f"  ({ev.get('label', '')})", err=True)  # fmt: skip
        elif kind == "start" and ev.get("recipe") not in seen:
            seen.add(ev.get("recipe"))
            typer.echo(f"{t}   training {ev.get('recipe')} from step {ev['step']}/{ev['steps']}",
                       err=True)  # fmt: skip

    return on_event


def advise_cmd(
    budget: Budget, device: Device = "b200", candidates: Candidates = None,
    model: Model = None, data: Data = None, config: Config = None, overrides: Overrides = None,
    steps: Steps = None, seeds: Seeds = 3, jobs: Jobs = 1, threads: Threads = 0,
    out: OutDir = Path("runs/advise"), json_out: JsonOut = False, quiet: Quiet = False,
    price_set: PriceSet = None, executor: Executor = "local", ray_address: RayAddress = None,
    torch_device: TorchDevice = "auto", tokenizer: Tokenizer = None,
    token_dtype: TokenDtype = None, init_from: InitFrom = None,
) -> None:  # fmt: skip
    """``fp8lab advise`` (help: `HELP`): validate the options, search, write the report."""
    from fp8lab.lab.advise import parse_budget, price_candidates, run_advise
    from fp8lab.report.advise import write_report

    with clear_errors():
        pct = parse_budget(budget)
        use_torch_device(torch_device)
        use_executor(executor, ray_address)
        cfg, _ = lab_config(config)
        cfg = with_run_options(cfg, overrides, model, steps, data, tokenizer=tokenizer,
                               token_dtype=token_dtype, init_from=init_from)  # fmt: skip
        cfg = check_model_data(cfg)
        cands = comma_items(candidates, "candidates") if candidates is not None else None
        # unknown candidates and devices, and a named one the device cannot run: before training
        price_candidates(cfg, cands or [], device, price_overrides=price_set or ())
    stop_on_sigterm()
    t0 = time.perf_counter()
    with clear_errors(INTERRUPTED_RESUME):
        result = run_advise(cfg, device, pct, out, candidates=cands, seeds=seeds, jobs=jobs,
                            threads=threads, callback=_progress(quiet),
                            price_overrides=price_set or ())  # fmt: skip
        write_report(out, result, command=command_line())
    if json_out:
        typer.echo(json.dumps(result.to_json(), allow_nan=False))
        return
    typer.echo(result.verdict)
    typer.echo(f"\nrecipe: {result.files['recipe']}  (fp8lab compare --recipes "
               f"{result.files['recipe']}; Megatron-LM: {result.files['megatron']}; TE: "
               f"{result.files['te']})")  # fmt: skip
    typer.echo(f"report: {Path(out) / 'report.html'}  ({time.perf_counter() - t0:.0f} s)")


def register(app: typer.Typer) -> None:
    """Register ``fp8lab advise`` on ``app``."""
    app.command("advise", help=HELP)(advise_cmd)
