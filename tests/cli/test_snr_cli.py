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
    assert set(data) == {"runs", "torch_device"} and data["torch_device"] == "cpu"
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
        # defaults resolved (the CLI sums in FP32 by default since issue 11 item 17)
        assert c["accumulator"] == "fp32" and c["scale_target"] == 240.0
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
        (["--accumulator", "h999"], "accumulator model of fp8lab.gemm"),
        (["--scale-rule", "biggest"], "unknown scale_rule"),
        (["--accumulator", "limited", "--acc-rounding", "toward_zero"], "its own rounding"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], match: str) -> None:
    res = _run(*args, "--samples", "2")
    assert res.exit_code == 2
    assert match in res.stderr
    assert "Traceback" not in res.output


def test_accumulator_overflow_warns() -> None:
    # auto scaling maps amax to 448: products reach 448^2 and clamp in an e4m3 accumulator
    res = _run("--length", "64", "--samples", "5", "--accumulator", "e4m3")
    assert res.exit_code == 0
    assert "overflowed the e4m3 accumulator" in res.stderr


def test_overflow_of_a_tensor_core_model_warns() -> None:
    # bf16 elements scaled to bf16's max: the products overflow FP32, the H100 model's range
    res = _run("--length", "64", "--samples", "3", "--format", "bf16", "--accumulator", "h100")
    assert res.exit_code == 0, res.output
    assert "overflowed the h100 accumulator (max 3.40282e+38)" in res.stderr
    assert "wider --accumulator" not in res.stderr
    ok = _run("--length", "64", "--samples", "3", "--format", "bf16", "--scaling", "1",
              "--accumulator", "h100")  # fmt: skip
    assert ok.exit_code == 0 and "overflowed" not in ok.stderr


def test_defaults_give_a_meaningful_first_result() -> None:
    # all defaults used to sum in the element format: 100 % overflow and exactly 0 dB
    res = _run("--json")
    assert res.exit_code == 0, res.output
    assert "overflowed" not in res.stderr
    (run,) = json.loads(res.stdout)["runs"]
    c = run["config"]
    assert (c["format"], c["scaling"], c["accumulator"], c["length"]) == (
        "e4m3",
        "auto",
        "fp32",
        1024,
    )
    assert len(run["snr_db"]) == 200
    # E4M3's 3 mantissa bits: ~25-30 dB per dot product, far from 0 dB and from exact
    assert 20.0 < run["median_db"] < 40.0
    assert run["below_0db_fraction"] < 0.05
    table = _run("--samples", "20")
    assert table.exit_code == 0 and "fp32" in table.stdout and "overflowed" not in table.stderr


def test_tensor_core_model_accumulator() -> None:
    res = _run(
        "--length", "512", "--samples", "6", "--accumulator", "limited,fp64",
        "--promote-every", "none,128", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout)["runs"]
    assert {(r["config"]["accumulator"], r["config"]["promote_every"]) for r in runs} == {
        ("limited", None), ("limited", 128), ("fp64", None), ("fp64", 128)
    }  # fmt: skip
    for r in runs:
        if r["config"]["accumulator"] == "limited":
            assert r["config"]["acc_rounding"] is None  # the model fixes its own rounding
        assert r["median_db"] > 15


def test_hardware_accumulator_names() -> None:
    for name in ("h100", "h200", "ada", "l40s", "b200", "b200-tcgen05"):
        res = _run("--length", "256", "--samples", "4", "--accumulator", name, "--json")
        assert res.exit_code == 0, (name, res.output)
        assert json.loads(res.stdout)["runs"][0]["config"]["accumulator"] == name
    res = _run("--samples", "2", "--format", "e4m3-ieee", "--accumulator", "h100")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "no model for e4m3-ieee x e4m3-ieee" in res.stderr


def test_table_and_plot(tmp_path) -> None:
    png = tmp_path / "h.png"
    res = _run("--length", "64,128", "--samples", "10", "--scaling", "1,64", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "median dB" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a whole study preset (every figure of the article): make test-slow
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


def test_scale_rule_sweep() -> None:
    res = _run(
        "--length", "256", "--samples", "6", "--block", "32", "--scale-rule", "exact,mx_floor",
        "--accumulator", "h100", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout)["runs"]
    assert [r["config"]["scale_rule"] for r in runs] == ["exact", "mx_floor"]
    assert all(r["config"]["block"] == 32 and r["median_db"] > 15 for r in runs)
    table = _run("--length", "64", "--samples", "4", "--scale-rule", "pow2_down")
    assert table.exit_code == 0 and "auto (pow2_down)" in table.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--plot", "/proc/x.png"], "/proc"),
        (["--plot", "{tmp}/figure.txt"], "must end in"),
        (["--plot", "{tmp}/dir.png"], "is a directory"),
        (["--preset", "seed000", "--out", "/proc/x"], "cannot create"),
        (["--preset", "seed000", "--out", "{tmp}/file"], "is a file"),
    ],
)
def test_unwritable_outputs_are_refused_before_any_work(tmp_path, args, words):
    """issue 11 item 14: an unwritable --plot / --out is one clear line and exit code 2."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dir.png").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    res = _run("--length", "32", "--samples", "2", *args)
    assert res.exit_code == 2, res.output
    assert "Error:" in res.output and words in res.output
    assert "Traceback" not in res.output
    assert (tmp_path / "file").read_text() == "mine"


def test_table_readable_at_80_columns() -> None:
    # issue 22: every one of the 12 columns ended in '…' at 80 columns (~118 needed)
    from table_width_check import NARROW, assert_readable

    res = runner.invoke(
        app, ["snr", "--length", "128,1024,4096", "--accumulator", "e8m8", "--samples", "20"],
        env=NARROW,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    headers = ["length", "median dB", "p10 dB", "p90 dB", "< 0 dB", "accumulator", "e8m8"]
    assert_readable(res.stdout, headers, ["128", "1024", "4096"])
