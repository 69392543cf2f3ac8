"""`fp8lab cost`: tables, --json schema, bad input exits 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fp8lab.cli import app

runner = CliRunner()
SMALL = ["--hidden", "512", "--ffn", "1024", "--layers", "2", "--tokens", "1024"]


def test_json_schema_exact():
    res = runner.invoke(
        app, ["cost", "--recipes", "bf16,te-current,te-delayed", "--device", "h200", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"schema_version", "device", "recipes"}
    assert out["schema_version"] == 1 and out["device"] == "h200"
    assert list(out["recipes"]) == ["bf16", "te-current", "te-delayed"]
    for row in out["recipes"].values():
        assert set(row) == {"layer_ms", "speedup_vs_bf16", "gemm_ms", "quantize_ms", "bytes"}
        assert row["layer_ms"] == row["gemm_ms"] + row["quantize_ms"]
    assert out["recipes"]["bf16"]["speedup_vs_bf16"] == 1.0
    cur, dl = out["recipes"]["te-current"], out["recipes"]["te-delayed"]
    assert dl["speedup_vs_bf16"] > cur["speedup_vs_bf16"] > 1  # one amax pass fewer
    assert cur["bytes"] > dl["bytes"]


def test_tables_and_skipped_recipes_on_hopper():
    res = runner.invoke(app, ["cost", "--device", "h200", *SMALL])
    assert res.exit_code == 0, res.output
    for text in ("Per-GEMM", "bytes ledger", "by precision", "read bf16", "written fp8",
                 "Per-layer totals", "qkv.wgrad", "deepseek-v3"):  # fmt: skip
        assert text in res.stdout
    assert "skipped mxfp8" in res.stderr and "skipped nvfp4" in res.stderr


def test_blackwell_prices_every_default_recipe():
    res = runner.invoke(app, ["cost", "--device", "b300", "--json", "--scenario", "te-benchmark"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipes"]
    assert set(rec) == {"bf16", "te-delayed", "te-current", "mxfp8", "deepseek-v3", "nvfp4"}
    assert rec["nvfp4"]["speedup_vs_bf16"] > rec["te-delayed"]["speedup_vs_bf16"]


def test_bad_input_exit_2():
    cases = [
        (["--device", "a100"], "unknown device 'a100'"),
        (["--recipes", "hif8-current", "--device", "b300"], "HiF8"),
        (["--recipes", "nope"], "unknown recipe 'nope'"),
        (["--model", "my_models.py:make"], "not supported yet"),
        (["--model", "gpt", "--hidden", "64"], "drop --hidden"),
        (["--hidden", "0"], "hidden must be a positive integer"),
        (["--scenario", "inference"], "unknown scenario"),
        (["--recipes", "mxfp8", "--device", "h100"], "no recipe of mxfp8 runs on h100"),
    ]
    for args, message in cases:
        res = runner.invoke(app, ["cost", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.stderr, (args, res.stderr)


def test_help():
    res = runner.invoke(app, ["cost", "--help"])
    assert res.exit_code == 0
    assert "--recipes" in res.stdout and "te-benchmark" in res.stdout


def test_model_gpt_prices_the_lab_gpt():
    res = runner.invoke(app, ["cost", "--model", "gpt", "--device", "b300", "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipes"]
    assert isinstance(rec["bf16"]["quantize_ms"], float)
    # d_model 256 on 1024 tokens: memory-bound GEMMs, quantization passes make FP8 slower
    assert rec["te-delayed"]["speedup_vs_bf16"] < 1
    res = runner.invoke(app, ["cost", "--model", "gpt", "--device", "h200"])
    assert res.exit_code == 0, res.output
    assert "gate.fprop" in res.stdout and "hidden 256" in res.stdout
