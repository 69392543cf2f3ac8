"""``fp8lab snr``: flags, sweeps, exact JSON schema, plots, the preset and clear errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, ["snr", *args])


def test_json_schema_and_sweep() -> None:
    res = _run(
        "--length", "64,128", "--samples", "20", "--scaling", "64", "--format", "e4m3-ieee",
        "--rounding", "nearest_away", "--promote-every", "none,32", "--seed", "5", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"runs"}
    assert len(data["runs"]) == 4  # 2 lengths x 2 promotion settings
    for run in data["runs"]:
        assert set(run) == {
            "config",
            "median_db",
            "p10_db",
            "p90_db",
            "below_0db_fraction",
            "snr_db",
        }
        assert len(run["snr_db"]) == 20
        assert run["p10_db"] <= run["median_db"] <= run["p90_db"]
        c = run["config"]
        assert c["accumulator"] == "e4m3-ieee" and c["scale_target"] == 240.0  # defaults resolved
        assert c["seed"] == 5 and c["scaling"] == 64.0
    assert {(r["config"]["length"], r["config"]["promote_every"]) for r in data["runs"]} == {
        (64, None), (64, 32), (128, None), (128, 32)
    }  # fmt: skip


def test_pooled_option_and_correlation_flags() -> None:
    res = _run(
        "--length", "256", "--samples", "10", "--rho", "0.2", "--correlation-model", "simple",
        "--accumulator", "fp32", "--pooled", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout)["runs"][0]
    assert run["config"]["rho"] == 0.2 and run["config"]["correlation_model"] == "simple"
    assert isinstance(run["pooled_db"], float)
    assert run["median_db"] > 20  # fp32 accumulation: only the element rounding is left


def test_block_scaling_flags() -> None:
    res = _run(
        "--length", "256", "--samples", "10", "--block", "64", "--scale-target", "224",
        "--accumulator", "e8m8", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    c = json.loads(res.stdout)["runs"][0]["config"]
    assert c["block"] == 64 and c["promote_every"] == 64 and c["scale_target"] == 224.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--length", "1000", "--block", "128"], "not divisible by block"),
        (["--rho", "1.5"], "rho must be in [0, 1)"),
        (["--scaling", "64", "--block", "128"], "fixed scaling"),
        (["--length", "512", "--block", "128", "--promote-every", "192"], "multiple of block"),
        (["--length", "12x"], "not an integer"),
        (["--scaling", "lots"], "neither 'auto' nor a number"),
        (["--rounding", "sideways"], "unknown rounding"),
        (["--format", "e9m9"], "unknown format"),
        (["--preset", "nope"], "unknown preset"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], match: str) -> None:
    res = _run(*args, "--samples", "2")
    assert res.exit_code == 2
    assert match in res.stderr
    assert "Traceback" not in res.output


def test_accumulator_overflow_warns() -> None:
    # auto scaling maps amax to 448: products reach 448^2 and clamp in an e4m3 accumulator
    res = _run("--length", "64", "--samples", "5")
    assert res.exit_code == 0
    assert "overflowed the e4m3 accumulator" in res.stderr


def test_table_and_plot(tmp_path) -> None:
    png = tmp_path / "h.png"
    res = _run("--length", "64,128", "--samples", "10", "--scaling", "1,64", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "median dB" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preset_writes_figures_table_and_json(tmp_path) -> None:
    out = tmp_path / "seed000"
    res = _run("--preset", "seed000", "--samples", "8", "--out", str(out))
    assert res.exit_code == 0, res.output
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 9 and pngs[0] == "fig1_error_scaling.png"
    table = (out / "seed000.md").read_text()
    assert "| fig4_block_scaling | size=1024 | chunk=128 |" in table
    runs = json.loads((out / "seed000.json").read_text())["runs"]
    assert len(runs) == len({json.dumps(r["config"], sort_keys=True) for r in runs})
