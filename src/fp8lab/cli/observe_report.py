"""``fp8lab observe-report``: heatmaps of underflow and saturation per layer over steps, drawn
from an `fp8lab.watch` record file (JSONL or CSV)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fp8lab.cli._common import clear_errors, fail, json_flag

HELP = """Heatmaps of underflow % and saturation % per layer over steps from an fp8lab.watch
record file (JSONL, or CSV by its .csv suffix). Each cell is the layer's worst operand (GEMM x
role) at that step. Levels: fine below 0.5 %, warning from 0.5 % to 4 %, critical above 4 %
(docs/observe.md). A flag on a layer's first step under delayed scaling is marked "warm-up" (no
amax history yet: expected). The figure aggregates steps into at most 40 columns (worst value of
each range). Writes a PNG or a self-contained HTML page (--out; default PATH with .png),
prints the flagged cells (--json: the whole heatmap data as JSON). Exit code 2 on a missing,
empty or corrupt file.
"""


PathArg = Annotated[Path, typer.Argument(help="fp8lab.watch records (.jsonl or .csv).")]
Out = Annotated[Path | None, typer.Option(
    "--out", help="Figure to write: FILE.png or FILE.html (default: PATH.png)."
)]  # fmt: skip
AsJson = json_flag("the heatmap data")


def observe_report(
    path: PathArg,
    out: Out = None,
    as_json: AsJson = False,
) -> None:
    from fp8lab.observe import read_records
    from fp8lab.report.observe import draw_png, heatmap_data, write_html

    target = out if out is not None else path.with_suffix(".png")
    if target.suffix.lower() not in (".png", ".html"):
        raise fail(f"--out must end in .png or .html, got {str(target)!r}")
    with clear_errors():
        data = heatmap_data(read_records(path))
        if target.suffix.lower() == ".html":
            write_html(data, target, source=str(path))
        else:
            draw_png(data, target)
    if as_json:
        typer.echo(json.dumps({**data, "figure": str(target)}))
        return
    n_crit = sum(f["level"] == "critical" for f in data["flags"])
    typer.echo(
        f"{len(data['layers'])} layers x {len(data['steps'])} steps; "
        f"{n_crit} critical, {len(data['flags']) - n_crit} warning cells -> {target}"
    )
    for f in data["flags"]:
        typer.echo(
            f"  {f['level']:<8} step {f['step']:>6}  {f['layer']:<24} "
            f"{f['metric'].removesuffix('_pct')} {f['value']:.3g} % ({f['worst']})"
            + ("  warm-up: delayed scaling has no amax history yet (expected)"
               if f.get("warmup") else "")
        )  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("observe-report", help=HELP)(observe_report)
