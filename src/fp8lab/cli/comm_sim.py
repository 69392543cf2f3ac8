"""``fp8lab comm-sim``: numerics of low-precision gradient all-reduce for N simulated ranks.

Runs `fp8lab.distributed.comm.study` (pure functions, one process): a ring all-reduce of synthetic
data-parallel gradients at every ``--grad-comm`` precision and every ``--ranks`` count.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

HELP = """Numerics of FP8 gradient communication: a ring all-reduce simulated for N ranks in one process.

Every rank holds a synthetic float32 gradient (log-normal magnitudes, --spread in natural-log units;
--shared = how much the ranks agree). The averaged gradient of the ring all-reduce at each
--grad-comm precision is compared with the fp32 ring all-reduce: fp32 = DDP's default; bf16 =
bfloat16 buffers; fp8 = E5M2 messages, each partial sum re-quantized with its own current scale;
fp8-msamp = E4M3 with one power-of-two scale from the global amax and 1/sqrt(N) pre-division
(MS-AMP). Reported: relative L2 error and max error vs fp32, elements zeroed, underflow and
overflow of the rounded partial sums (fractions of message elements), bytes one rank sends per
step (data + scales), relative to fp32.
"""

Ranks = Annotated[str, typer.Option("--ranks", help="Comma list of simulated ranks, each 1..1024.")]
GradComm = Annotated[str, typer.Option(
    "--grad-comm", help="Comma list of fp32|bf16|fp8|fp8-msamp."
)]  # fmt: skip
Numel = Annotated[int, typer.Option("--numel", help="Gradient elements per rank.")]
Bucket = Annotated[int | None, typer.Option(
    "--bucket-numel", help="Elements per bucket (each bucket reduced and scaled alone)."
)]  # fmt: skip
Spread = Annotated[float, typer.Option(
    "--spread", help="Log-normal sigma of the magnitudes (natural log)."
)]  # fmt: skip
Shared = Annotated[float, typer.Option(
    "--shared", help="Correlation of the ranks' gradients, 0..1."
)]  # fmt: skip
Seed = Annotated[int, typer.Option("--seed", help="Random seed of the synthetic gradients.")]
Json = Annotated[bool, typer.Option("--json", help="Print the rows as JSON instead of a table.")]


def _ranks(value: str) -> list[int]:
    from fp8lab.cli._common import comma_ints, comma_items

    out = []
    for item in comma_items(value, "ranks"):
        (n,) = comma_ints(item, "ranks")  # checked in order, as given
        if not 1 <= n <= 1024:
            raise ValueError(f"--ranks: {n} is outside 1..1024")
        out.append(n)
    return out


def _grad_comms(value: str) -> list[str]:
    from fp8lab.cli._common import comma_items
    from fp8lab.distributed.comm import check_grad_comm

    return [check_grad_comm(v) for v in comma_items(value, "grad-comm")]


def _table(rows: list[dict]) -> None:
    from rich import box

    from fp8lab.cli._common import console, fitted_tables

    names = ("ranks", "grad-comm", "rel L2 err", "max err", "zeroed", "underflow", "overflow",
             "bytes/rank", "vs fp32")  # fmt: skip
    cells = [
        [str(r["ranks"]), r["grad_comm"], f"{r['rel_error']:.2e}", f"{r['max_rel_error']:.2e}",
         f"{r['zeroed']:.2%}", f"{r['underflow']:.3%}", f"{r['overflow']:.3%}",
         f"{r['bytes_per_rank']:,.0f}", f"{r['bytes_vs_fp32']:.3f}"]
        for r in rows
    ]  # fmt: skip
    con = console()
    for t in fitted_tables(
        "fp8lab comm-sim: ring all-reduce vs fp32",
        [(n, "left" if n == "grad-comm" else "right") for n in names],
        cells,
        con.width,
        keys=2,
        box=box.SIMPLE,
    ):
        con.print(t)


def comm_sim_command(
    ranks: Ranks = "2,4,8,16",
    grad_comm: GradComm = "fp32,bf16,fp8,fp8-msamp",
    numel: Numel = 65536,
    bucket_numel: Bucket = None,
    spread: Spread = 2.0,
    shared: Shared = 0.5,
    seed: Seed = 0,
    json_out: Json = False,
) -> None:
    from fp8lab.cli._common import fail

    try:
        if numel < 1:
            raise ValueError(f"--numel must be >= 1, got {numel}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"--bucket-numel must be >= 1, got {bucket_numel}")
        if not 0.0 <= shared <= 1.0:
            raise ValueError(f"--shared must be in [0, 1], got {shared}")
        from fp8lab.distributed.comm import study

        rows = study(
            _ranks(ranks), _grad_comms(grad_comm), numel, bucket_numel=bucket_numel,
            spread=spread, shared=shared, seed=seed,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None
    if json_out:
        typer.echo(json.dumps({"rows": rows}))
    else:
        _table(rows)


def register(app: typer.Typer) -> None:
    app.command("comm-sim", help=HELP)(comm_sim_command)
