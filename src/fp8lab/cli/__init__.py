"""The ``fp8lab`` command line: one typer app, one module per command.

Each command module defines ``register(app)``; a command whose module fails to import is reported
as such instead of breaking the other commands.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="fp8lab",
    help="Simulate, analyse and debug FP8-family low-precision training on a CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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


_COMMANDS = ("formats", "snr", "inspect", "compare")

for _name in _COMMANDS:
    try:
        _module = importlib.import_module(f"fp8lab.cli.{_name}")
    except ModuleNotFoundError as exc:  # a command not built yet
        if exc.name != f"fp8lab.cli.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    app()
