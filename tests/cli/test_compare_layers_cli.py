"""`fp8lab compare --recipes FILE.toml` with per-layer rules: settings per layer, clear errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import tiny_lab_toml


@pytest.fixture
def text(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40)
    return f


def _tiny_run(tmp_path, text, *args):
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"d_model": 128, "d_ff": 256}, steps=3, batch_size=2,
                                  eval_every=3))  # fmt: skip
    out = tmp_path / "out"
    cmd = ["compare", "--config", str(conf), "--out", str(out), "--quiet", *args]
    return CliRunner().invoke(app, cmd), out


FIX = """base = "te-delayed"
name = "te-delayed-fix"

[[layer]]
match = "blocks.0.mlp.*"
[layer.dgrad.high_precision_roles]
grad_output = "bf16"

[[layer]]
match = "blocks.0.mlp.down"
base = "bf16"
"""


def test_layered_recipe_file_trains_and_reports_each_layers_settings(tmp_path, text):
    fix = tmp_path / "sub" / "fix.toml"
    fix.parent.mkdir()
    fix.write_text(FIX)
    res, out = _tiny_run(tmp_path, text, "--recipes", str(fix), "--baseline", "bf16", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    per_layer = d["layer_settings"][str(fix)]
    assert per_layer["blocks.0.attn.qkv"]["rules"] == []
    assert per_layer["blocks.0.mlp.up"]["rules"] == [1]
    assert per_layer["blocks.0.mlp.up"]["gemms"]["dgrad"].startswith(
        "grad_output=bf16, weight=e4m3"
    )
    assert per_layer["blocks.0.mlp.down"]["rules"] == [1, 2]
    assert per_layer["blocks.0.mlp.down"]["gemms"]["fprop"] == "input=bf16, weight=bf16"
    assert (out / "runs" / "fix.toml" / "metrics.jsonl").is_file()  # never a path outside out/
    assert d["recipes"][str(fix)]["final_val_loss"] is not None


def test_a_layer_glob_matching_nothing_exits_2(tmp_path, text):
    fix = tmp_path / "fix.toml"
    fix.write_text('base = "te-current"\n[[layer]]\nmatch = "blocks.7.*"\nbase = "bf16"\n')
    res, out = _tiny_run(tmp_path, text, "--recipes", str(fix))
    assert res.exit_code == 2, res.output
    assert "blocks.7.*" in res.output and "matches no converted Linear" in res.output
    assert not (out / "runs").exists()


def test_a_bad_layer_table_exits_2_naming_file_and_key(tmp_path, text):
    fix = tmp_path / "fix.toml"
    fix.write_text(
        'base = "te-current"\n[[layer]]\nmatch = "blocks.0.*"\noptimizer_state = "bf16"\n'
    )
    res, _ = _tiny_run(tmp_path, text, "--recipes", str(fix))
    assert res.exit_code == 2, res.output
    assert "fix.toml" in res.output and "optimizer_state" in res.output
