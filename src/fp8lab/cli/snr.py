"""``fp8lab snr``: the dot-product SNR study from the command line.

The study is the one of the blog article "从DeepSeek V3看FP8训练的挑战" and its simfloat notebook.
Every axis takes a comma list and the runs are the cartesian product; ``--preset seed000``
reproduces all of the article's figures (PNGs + a Markdown table + JSON in ``--out``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8lab.cli._common import (
    TorchDevice,
    check_out_dir,
    check_plot_path,
    comma_ints,
    comma_items,
    fail,
    json_flag,
    use_torch_device,
)

HELP = """Dot-product SNR of low-precision (FP8) dot products against a float64 reference.

a, b ~ N(0, sigma); per sample SNR = 10*log10(ref^2 / (ref - result)^2) dB. Axes given as comma
lists are swept (cartesian product). The defaults (E4M3 elements scaled per vector, amax -> 448,
an FP32 running sum) show the element quantisation alone; --accumulator e4m3 / e8m8 / limited /
h100 adds the accumulation error. With --block every block of a and b gets its own scale
(amax -> --scale-target) and each block's partial sum is de-scaled and promoted into float64
(--promote-every defaults to the block; a larger multiple keeps adding de-scaled block partials in
the accumulator format). Exact results (infinite SNR) are null in --json.
"""


#: FP32 sums by default: an element-format (E4M3) accumulator overflows at once under the
#: default scaling (products reach 448^2), which made the first result 0 dB
DEFAULT_ACCUMULATOR = "fp32"


def _floats(value: str, name: str) -> list[float]:
    try:
        return [float(v) for v in comma_items(value, name)]
    except ValueError:
        raise ValueError(f"--{name}: expected numbers, got {value!r}") from None


def _scalings(value: str) -> list[float | str]:
    out: list[float | str] = []
    for item in comma_items(value, "scaling"):
        if item.lower() == "auto":
            out.append("auto")
            continue
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--scaling: {item!r} is neither 'auto' nor a number") from None
    return out


def build_configs(**opts: Any) -> list[Any]:
    """The `SnrConfig` list of a command line (cartesian product of the comma lists)."""
    from fp8lab.formats import ROUNDING_MODES
    from fp8lab.lab.snr import SnrConfig, sweep

    for name in ("rounding", "acc_rounding"):
        for mode in comma_items(opts[name], name) if opts[name] else []:
            if mode not in ROUNDING_MODES:
                raise ValueError(
                    f"--{name.replace('_', '-')}: unknown rounding {mode!r}; "
                    f"valid: {', '.join(ROUNDING_MODES)}"
                )
    base = SnrConfig(
        samples=opts["samples"],
        seed=opts["seed"],
        sigma=opts["sigma"],
        correlation_model=opts["correlation_model"],
        saturate=opts["saturate"],
    )
    axes: dict[str, list[Any]] = {
        "length": comma_ints(opts["length"], "length"),
        "rho": _floats(opts["rho"], "rho"),
        "format": comma_items(opts["format"], "format"),
        "rounding": comma_items(opts["rounding"], "rounding"),
        "scaling": _scalings(opts["scaling"]),
        "block": comma_ints(opts["block"], "block", allow_none=True),
        "promote_every": comma_ints(opts["promote_every"], "promote-every", allow_none=True),
        "scale_rule": comma_items(opts.get("scale_rule") or "exact", "scale-rule"),
    }
    if opts["accumulator"]:
        axes["accumulator"] = comma_items(opts["accumulator"], "accumulator")
    if opts["acc_rounding"]:
        axes["acc_rounding"] = comma_items(opts["acc_rounding"], "acc-rounding")
    if opts["scale_target"] is not None:
        axes["scale_target"] = [opts["scale_target"]]
    return sweep(base, **axes)


def _label(cfg: Any, varying: list[str]) -> str:
    parts = []
    for k in varying:
        v = getattr(cfg, k)
        parts.append(f"{k}={'none' if v is None else v}")
    return ", ".join(parts) if parts else "run"


def _varying(configs: list[Any], exclude: tuple[str, ...] = ()) -> list[str]:
    from dataclasses import fields

    return [
        f.name
        for f in fields(configs[0])
        if f.name not in exclude and len({getattr(c, f.name) for c in configs}) > 1
    ]


def _scaling_label(c: Any) -> str:
    """``64``, ``auto`` (the float64 rule) or ``auto (mx_floor)`` (a rule of fp8lab.scaling)."""
    if c.scaling != "auto":
        return f"{c.scaling:g}"
    return "auto" if c.scale_rule == "exact" else f"auto ({c.scale_rule})"


def _print_table(results: list[Any], pooled: bool, title: str) -> None:
    from fp8lab.cli._common import console, fitted_tables
    from fp8lab.report.snr import fmt_db

    left = ("length", "rho", "format", "scaling", "block", "accumulator", "promote")
    right = ("median dB", "p10 dB", "p90 dB", "< 0 dB", "exact") + (
        ("pooled dB",) if pooled else ()
    )
    cols = [(c, "left") for c in left] + [(c, "right") for c in right]
    cells = []
    for r in results:
        c = r.config
        row = [
            str(c.length),
            f"{c.rho:g}",
            c.format,
            _scaling_label(c),
            str(c.block or "none"),
            c.accumulator_name,
            str(c.promote_every or "none"),
            fmt_db(r.median_db),
            fmt_db(r.p10_db),
            fmt_db(r.p90_db),
            f"{100 * r.below_0db_fraction:.1f}%",
            f"{100 * r.exact_fraction:.1f}%",
        ]
        if pooled:
            row.append(fmt_db(r.pooled_db))
        cells.append(row)
    # whole cells at any width: constant columns go to a caption, the rest fold into tables
    con = console()
    for t in fitted_tables(title, cols, cells, con.width):
        con.print(t)


def _run_with_progress(configs: list[Any], quiet: bool) -> list[Any]:
    from fp8lab.lab.snr import run_many

    if quiet or not sys.stderr.isatty():
        return run_many(configs)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("SNR runs", total=len(set(configs)))
        return run_many(configs, progress=lambda n: progress.advance(task, n))


# the options as Annotated aliases (typer reads them), so that the signature reads as a list
Length = Annotated[str, typer.Option("--length", help="Vector length(s), e.g. 128,1024,4096.")]
Samples = Annotated[int, typer.Option("--samples", help="Vector pairs per run.")]
Seed = Annotated[int, typer.Option("--seed", help="RNG seed (runs of one length share vectors).")]
Sigma = Annotated[float, typer.Option("--sigma", help="Std of the vector elements.")]
Rho = Annotated[str, typer.Option("--rho", help="Correlation(s) in [0, 1).")]
CorrelationModel = Annotated[str, typer.Option(
    "--correlation-model",
    help="exact: b = rho*z1 + sqrt(1-rho^2)*z2 (corr = rho); "
    "simple: the simfloat notebook's b = rho*z1 + (1-rho)*z2.",
)]  # fmt: skip
Format = Annotated[str, typer.Option("--format", help="Element format(s).")]
Rounding = Annotated[str, typer.Option("--rounding", help="Element rounding.")]
Scaling = Annotated[str, typer.Option(
    "--scaling", help="Fixed factor(s) (1, 64, 128) or auto (amax -> target)."
)]  # fmt: skip
Block = Annotated[str, typer.Option(
    "--block", help="Per-block dynamic scaling: none, 512, 128, 64."
)]  # fmt: skip
ScaleTarget = Annotated[float | None, typer.Option(
    "--scale-target", help="Value amax maps to (default: the format's max)."
)]  # fmt: skip
ScaleRule = Annotated[str, typer.Option(
    "--scale-rule",
    help="How auto scaling turns amax into a scale: exact (target/amax in float64, "
    "the notebook's) or a rule of fp8lab.scaling: max, pow2_down, pow2_up, mx_floor, "
    "mx_ceil, mx_even, mx_rceil (with --block 32: MX).",
)]  # fmt: skip
Accumulator = Annotated[str, typer.Option(
    "--accumulator",
    help="Format of products and running sum, rounded after every addition (e.g. "
    "e4m3, e8m8, bf16, fp32; fp64 = exact), or a tensor-core model of fp8lab.gemm "
    "summing MMA groups (limited; GPU names such as h100, h200, ada, l40s, b200, "
    "b200-tcgen05).",
)]  # fmt: skip
AccRounding = Annotated[str | None, typer.Option(
    "--acc-rounding", help="Rounding of a format accumulator (default: --rounding)."
)]  # fmt: skip
PromoteEvery = Annotated[str, typer.Option(
    "--promote-every", help="Promote the partial sum to float64 every N: none, 512, 128."
)]  # fmt: skip
Saturate = Annotated[bool, typer.Option(
    "--saturate/--no-saturate", help="Clamp overflow to +-max."
)]  # fmt: skip
Pooled = Annotated[bool, typer.Option(
    "--pooled", help="Also report the notebook's pooled SNR (sum ref^2 / sum err^2)."
)]  # fmt: skip
Json = json_flag("the runs")
Plot = Annotated[Path | None, typer.Option("--plot", help="Write histograms to this PNG.")]
Preset = Annotated[str | None, typer.Option(
    "--preset",
    help="A named study (writes figures + table + JSON to --out): seed000 (every figure "
    "of the blog article '从DeepSeek V3看FP8训练的挑战'), or seed000-asrun (as its "
    "simfloat notebook ran them, bugs included).",
)]  # fmt: skip
Out = Annotated[Path, typer.Option("--out", help="Output directory of --preset.")]


def snr_command(
    length: Length = "1024",
    samples: Samples = 200,
    seed: Seed = 0,
    sigma: Sigma = 0.01,
    rho: Rho = "0",
    correlation_model: CorrelationModel = "exact",
    fmt: Format = "e4m3",
    rounding: Rounding = "nearest_even",
    scaling: Scaling = "auto",
    block: Block = "none",
    scale_target: ScaleTarget = None,
    scale_rule: ScaleRule = "exact",
    accumulator: Accumulator = DEFAULT_ACCUMULATOR,
    acc_rounding: AccRounding = None,
    promote_every: PromoteEvery = "none",
    saturate: Saturate = True,
    pooled: Pooled = False,
    json_out: Json = False,
    plot: Plot = None,
    preset: Preset = None,
    out: Out = Path("out/snr"),
    torch_device: TorchDevice = "auto",
) -> None:
    try:
        use_torch_device(torch_device)  # the casts and GEMM models run there
        # unwritable outputs are refused before minutes of work
        if plot is not None:
            check_plot_path(plot)
        if preset is not None:
            check_out_dir(out)
            _run_preset(preset, samples, seed, out, json_out, pooled)
            return
        configs = build_configs(
            length=length, samples=samples, seed=seed, sigma=sigma, rho=rho,
            correlation_model=correlation_model, format=fmt, rounding=rounding,
            scaling=scaling, block=block, scale_target=scale_target, scale_rule=scale_rule,
            accumulator=accumulator, acc_rounding=acc_rounding,
            promote_every=promote_every, saturate=saturate,
        )  # fmt: skip
        results = _run_with_progress(configs, json_out)
    except (ValueError, TypeError) as exc:
        raise fail(str(exc)) from None
    _report(results, pooled, json_out, plot)


def register(app: typer.Typer) -> None:
    app.command("snr", help=HELP)(snr_command)


def _report(results: list[Any], pooled: bool, json_out: bool, plot: Path | None) -> None:
    """Warnings, the optional plot, then the JSON or the table."""
    _warn_overflow(results)
    if plot is not None:
        _plot_sweep(results, plot)
    if json_out:
        runs = {"runs": [r.to_json(pooled) for r in results], **_device()}
        typer.echo(json.dumps(runs))
    else:
        _print_table(results, pooled, "fp8lab snr")
        if plot is not None:
            typer.echo(f"wrote {plot}")


def _device() -> dict[str, str]:
    """``{"torch_device": "cpu"}``: where the runs computed (--torch-device, resolved)."""
    from fp8lab.lab.machine import torch_device

    return {"torch_device": str(torch_device())}


def _warn_overflow(results: list[Any]) -> None:
    from fp8lab.formats import get_format

    for r in results:
        if r.acc_overflow_fraction > 0:
            c = r.config
            fix = "lower --scale-target / --scaling"
            if c.accumulator_max < get_format("fp32").max:
                fix += " or use a wider --accumulator (e.g. e8m8, fp32)"
            typer.echo(
                f"warning: in {100 * r.acc_overflow_fraction:.0f}% of the samples of the run "
                f"(length={c.length}, scaling={c.scaling}, block={c.block}) products overflowed "
                f"the {c.accumulator_name} accumulator (max {c.accumulator_max:g}): {fix}",
                err=True,
            )


def _plot_sweep(results: list[Any], path: Path) -> None:
    """Histograms of a sweep: one panel per length, one series per other varying axis."""
    from fp8lab.report.snr import plot_panels

    configs = [r.config for r in results]
    varying = _varying(configs, exclude=("length",))
    panels: dict[int, list[tuple[str, Any]]] = {}
    for r in results:
        panels.setdefault(r.config.length, []).append((_label(r.config, varying), r))
    plot_panels([(f"size={n}", s) for n, s in panels.items()], path, "fp8lab snr")


def _run_preset(
    name: str, samples: int, seed: int, out: Path, json_out: bool, pooled: bool
) -> None:
    from fp8lab.lab import snr as lab
    from fp8lab.report.snr import markdown_table, table_rows, write_preset_report

    p = lab.preset(name, samples=samples, seed=seed)
    configs = p.configs()
    results = dict(zip(configs, _run_with_progress(configs, json_out), strict=True))
    written = write_preset_report(p, results, out)
    runs = {"runs": [results[c].to_json(pooled) for c in configs], **_device()}
    (out / f"{p.name}.json").write_text(json.dumps(runs))
    if json_out:
        typer.echo(json.dumps(runs))
        return
    typer.echo(markdown_table(table_rows(p, results)))
    for path in [*written, out / f"{p.name}.json"]:
        typer.echo(f"wrote {path}")
