"""``fp8lab replay``: reproduce one training step of a run from its checkpoint and batch index
(the minimal repro to attach to a bug report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fp8lab.cli._common import (
    TorchDevice,
    clear_errors,
    console,
    json_flag,
    table,
    use_torch_device,
)

HELP = """Reproduce step T (0-based, as --grad-spike-step; its metrics record says step T+1) of a
run made by fp8lab compare, bit for bit: rebuild the model, recipe and data from the run folder
OUT/runs/RECIPE, start from the newest checkpoint at or before T (checkpoint.pt or a guarded
run's checkpoints/step-NNNNNN.pt; else the initial weights), train up to T and run step T under
the anomaly guard's detectors (docs/guard.md; nothing is changed). Prints the loss, gradient
norm, whether both equal the run's metrics record of that step, and every detector signal;
--json prints {run, recipe, step, record_step, start_step, checkpoint, batch, loss, grad_norm,
record, matches_record, signals, findings}. Exit code 2 for a folder that is not a run, a step
outside the run or a changed training text; 1 when the step does not reproduce.
"""


RunDirArg = Annotated[Path, typer.Argument(help="A run folder: OUT/runs/RECIPE.")]
Step = Annotated[int, typer.Option("--step", help="0-based step index to reproduce.")]
AsJson = json_flag("the result")


def replay_cmd(
    run_dir: RunDirArg,
    step: Step,
    as_json: AsJson = False,
    torch_device: TorchDevice = "auto",
) -> None:
    from fp8lab.lab.replay import replay_step

    with clear_errors():
        use_torch_device(torch_device)  # the model, batches and checkpoint load there
        res = replay_step(run_dir, step)
    if as_json:
        typer.echo(json.dumps(res, allow_nan=False))
    else:
        _print(res)
    if res["record"] is not None and not res["matches_record"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("replay", help=HELP)(replay_cmd)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "-" if v is None else str(v)


def _print(res: dict) -> None:
    start = res["checkpoint"] or "the initial weights"
    typer.echo(
        f"{res['recipe']}: step {res['step']} (record step {res['record_step']}), batch "
        f"{res['batch']}, replayed from {start} (step {res['start_step']})"
    )
    rec = res["record"]
    typer.echo(f"  loss      {res['loss']!r}  (record: {rec and rec['train_loss']!r})")
    typer.echo(f"  grad norm {res['grad_norm']!r}  (record: {rec and rec['grad_norm']!r})")
    verdict = (
        "no record of this step"
        if rec is None
        else ("bit-identical to the record" if res["matches_record"] else "DIFFERS from the record")
    )
    typer.echo(f"  {verdict}")  # fmt: skip
    t = table("detector signals", [("signal", "left"), ("value", "right")])
    for k, v in res["signals"].items():
        t.add_row(k, _fmt(v))
    console().print(t)
    for f in res["findings"]:
        typer.echo(
            f"  FIRES {f['detector']} {f['tensor'] or ''} value {_fmt(f['value'])} "
            f">= {_fmt(f['threshold'])}"
        )
