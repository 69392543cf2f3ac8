"""``fp8lab comm-sim``: JSON rows, the table, and clear errors (exit code 2)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.distributed.comm import bytes_per_rank, ring_allreduce, synthetic_grads

runner = CliRunner()


def test_json_rows_match_the_library() -> None:
    res = runner.invoke(
        app, ["comm-sim", "--ranks", "2,3", "--numel", "257", "--seed", "3", "--json"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [(r["ranks"], r["grad_comm"]) for r in rows] == [
        (n, p) for n in (2, 3) for p in ("fp32", "bf16", "fp8", "fp8-msamp")
    ]
    for r in rows:
        g = synthetic_grads(r["ranks"], 257, seed=3)
        base = ring_allreduce(g, "fp32").out.double()
        out = ring_allreduce(g, r["grad_comm"]).out.double()
        assert r["rel_error"] == float((out - base).norm() / base.norm())
        assert r["bytes_per_rank"] == bytes_per_rank(257, r["ranks"], r["grad_comm"])
    fp8 = {r["ranks"]: r for r in rows if r["grad_comm"] == "fp8"}
    assert 0 < fp8[2]["rel_error"] < 0.2
    assert torch.isclose(torch.tensor(fp8[2]["bytes_vs_fp32"]), torch.tensor(0.25), atol=0.01)


def test_table_and_errors() -> None:
    res = runner.invoke(app, ["comm-sim", "--ranks", "2", "--numel", "64"])
    assert res.exit_code == 0, res.output
    assert "fp8-msamp" in res.stdout and "bytes/rank" in res.stdout
    res = runner.invoke(app, ["comm-sim", "--grad-comm", "fp4"])
    assert res.exit_code == 2 and "fp4" in res.output
    res = runner.invoke(app, ["comm-sim", "--ranks", "0"])
    assert res.exit_code == 2 and "--ranks" in res.output
    res = runner.invoke(app, ["comm-sim", "--shared", "2"])
    assert res.exit_code == 2 and "--shared" in res.output


def test_table_readable_at_80_columns() -> None:
    from table_width_check import NARROW, assert_readable

    res = runner.invoke(app, ["comm-sim", "--numel", "256"], env=NARROW)
    assert res.exit_code == 0, res.output
    headers = ["ranks", "grad-comm", "rel L2 err", "max err", "zeroed", "underflow",
               "overflow", "bytes/rank", "vs fp32"]  # fmt: skip
    assert_readable(res.stdout, headers, ["fp8-msamp", "fp32", "bf16"])
