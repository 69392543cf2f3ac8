"""The ``fp8lab`` command line: one typer app, one module per command.

Each command module defines ``register(app)``. Help texts are plain text (no rich markup), so
words such as ``[model]`` and long defaults are shown as written. Bad input exits with code 2.
"""

from __future__ import annotations

import typer

from fp8lab.cli import (
    advise,
    comm_sim,
    compare,
    cost,
    debug,
    formats,
    inspect,
    observe_report,
    snr,
)
from fp8lab.cli import replay as replay_cmd
from fp8lab.cli._common import check_kernels, clear_errors

app = typer.Typer(
    name="fp8lab",
    help="Simulate, analyse and debug FP8-family low-precision training on a CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the fp8lab version and exit."),
) -> None:
    """fp8lab: bit-faithful FP8-family training simulation on a CPU."""
    if version:
        from fp8lab import __version__

        typer.echo(__version__)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()
    with clear_errors():  # an unknown FP8LAB_KERNELS: exit 2 from every command
        check_kernels()


for _module in (formats, snr, inspect, compare, debug, advise, cost, observe_report, comm_sim,
                replay_cmd):  # fmt: skip
    _module.register(app)


def main() -> None:
    app()
