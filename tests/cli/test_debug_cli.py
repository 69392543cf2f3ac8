"""``fp8lab debug`` through the command line: bad input is exit code 2 with a clear message,
--list-scenarios, --help, and the exact --json schema."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import TINY_USER_MODEL as USER_MODEL
from tiny_lab import tiny_lab_toml

runner = CliRunner()


@pytest.fixture
def config(tmp_path) -> Path:
    text = tmp_path / "text.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 40)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tiny_lab_toml(text, steps=8, batch_size=4, warmup_steps=2, eval_every=4,
                                 checkpoint_every=100))  # fmt: skip
    return cfg


def _bad(args: list[str], *words: str) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output


def test_bad_input_exits_2_before_training(tmp_path, config):
    out = tmp_path / "out"
    base = ["debug", "--config", str(config), "--out", str(out)]
    _bad([*base, "--recipe", "no-such-recipe"], "unknown recipe 'no-such-recipe'")
    _bad([*base, "--recipe", "bf16"], "same numerics")  # the baseline is bf16
    _bad([*base, "--recipe", "te-current", "--baseline", "te-current"], "same numerics")
    _bad([*base, "--recipe", "te-current", "--baseline", "nope"], "unknown recipe 'nope'")
    _bad([*base, "--recipe", "te-current", "--layers", "blocks.*.nothing"],
         "--layers 'blocks.*.nothing' matches no converted layer")  # fmt: skip
    _bad([*base, "--recipe", "te-current", "--layers", " , "], "--layers")
    _bad([*base, "--scenario", "no-such"], "unknown scenario 'no-such'", "outlier-channels")
    _bad([*base], "exactly one of --recipe and --scenario")
    _bad([*base, "--recipe", "te-current", "--scenario", "gradient-spike"], "exactly one")
    _bad([*base, "--recipe", str(tmp_path / "missing.toml")], "no such recipe file")
    _bad([*base, "--recipe", "te-current", "--set", "train.lr=abc"], "train")
    _bad([*base, "--recipe", "te-current", "--device", "a100"], "unknown device 'a100'", "b200")
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_out_dir_not_ours_is_refused(tmp_path, config):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    _bad(["debug", "--config", str(config), "--out", str(out), "--recipe", "te-current"],
         "not made by fp8lab debug")  # fmt: skip
    assert (out / "precious.txt").read_text() == "keep"


def test_list_scenarios_and_help():
    r = runner.invoke(app, ["debug", "--list-scenarios"])
    assert r.exit_code == 0
    for name in ("outlier-channels", "unscaled-gradient", "gradient-spike"):
        assert name in r.output
    r = runner.invoke(app, ["debug", "--help"])
    assert r.exit_code == 0 and "--scenario" in r.output and "--json" in r.output


def test_json_schema_is_exact_and_a_rerun_resumes(tmp_path, config):
    """fp32 against bf16 differs by rounding only: the gap is the noise itself, "no FP8
    problem found" (the full pipeline's output is checked by the scenario tests)."""
    out = tmp_path / "out"
    args = ["debug", "--config", str(config), "--out", str(out), "--recipe", "fp32", "--json",
            "--quiet", "--threads", "1"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(d) == ["schema_version", "recipe", "baseline", "gap_pct", "noise_pct",
                       "recovers", "culprit", "attribution", "remedies", "fix", "probes",
                       "torch_device", "device", "predicted_step_ms"]  # fmt: skip
    # fp32 GEMMs are not priced (no tensor core runs them); no fix: null
    assert d["device"] == "h100" and d["predicted_step_ms"] == {"run": None, "fix": None}
    assert d["schema_version"] == 1 and d["recipe"] == "fp32" and d["torch_device"] == "cpu"
    assert d["culprit"] is None and d["fix"] is None and d["recovers"] is True
    assert abs(d["gap_pct"]) <= 2 * d["noise_pct"]
    assert d["baseline"] == "bf16" and isinstance(d["recovers"], bool)
    assert {p["name"] for p in d["probes"]} >= {"baseline", "recipe", "noise-fp32"}
    for a in d["attribution"]:
        assert list(a) == ["layer", "gemm", "role", "score"]
    for rem in d["remedies"]:
        assert list(rem) == ["name", "gap_pct", "relative_cost"]
    if d["culprit"] is not None:
        assert list(d["culprit"]) == ["role", "gemm", "layers"]
        assert d["culprit"]["role"] in ("input", "weight", "grad_output")
        assert d["culprit"]["gemm"] in ("fprop", "dgrad", "wgrad")
    if d["fix"] is not None:
        tomllib.loads(Path(d["fix"]).read_text())
    assert (out / "report.html").exists() and (out / "report.md").exists()
    assert "no FP8 problem found" in (out / "report.md").read_text()
    # rerunning the same command resumes: every probe is read back
    r2 = runner.invoke(app, args)
    assert r2.exit_code == 0
    assert json.loads(r2.stdout.strip().splitlines()[-1]) == d


@pytest.mark.no_arithmetic
def test_predicted_step_of_the_run_and_its_fix(tmp_path, config):
    """--device: the run's recipe (a preset, or a planted scenario's Recipe object) and its
    fix file priced as fp8lab cost prices them on the run's model and tokens per step."""
    from fp8lab.cli._common import lab_config
    from fp8lab.cli.debug import _predicted
    from fp8lab.cost import linear_shapes, predict_step_ms
    from fp8lab.lab import models
    from fp8lab.recipe import Recipe, get_recipe
    from fp8lab.report.debug import _summary_rows

    cfg, _ = lab_config(config)
    fix = tmp_path / "fix.toml"
    fix.write_text('base = "te-current"\n[[layer]]\nmatch = "*fc"\nbase = "bf16"\n')
    linears = linear_shapes(models.build(cfg.model, cfg.train.seed))
    tokens = cfg.train.batch_size * cfg.model.block_size
    want = {
        "run": predict_step_ms(get_recipe("mxfp8"), "b200", linears=linears, tokens=tokens),
        "fix": predict_step_ms(Recipe.load(fix), "b200", linears=linears, tokens=tokens),
    }
    got = _predicted(cfg, "mxfp8", str(fix), "b200")
    assert got["device"] == "b200"
    assert {k: v["ms"] for k, v in got["recipes"].items()} == want
    assert want["run"] != want["fix"]  # the fix's bf16 layer is priced as bf16
    planted = get_recipe("te-delayed").replace(name="planted")  # a Recipe, not a name
    got2 = _predicted(cfg, planted, None, "b200")
    assert list(got2["recipes"]) == ["run"]
    assert got2["recipes"]["run"]["ms"] == predict_step_ms(planted, "b200", linears=linears,
                                                           tokens=tokens)  # fmt: skip
    # an fp32 run cannot be priced: n/a with the reason, in the report's summary table
    got3 = _predicted(cfg, "fp32", None, "h100")
    assert got3["recipes"]["run"]["ms"] is None and got3["recipes"]["run"]["reason"]

    # the summary table reads these fields of the debugger's result
    res = SimpleNamespace(recipe="mxfp8", baseline="bf16", gap_pct=1.0, noise_pct=0.1,
                          recovers=True, culprit=None, fix=None,
                          details={"predicted_step": got})  # fmt: skip
    row = next(r for r in _summary_rows(res, None) if r[0] == "predicted step ms on b200")
    assert f"run {want['run']:.4g}" in row[1] and f"fix {want['fix']:.4g}" in row[1]


# te-delayed, but the hidden layer's input cast to E4M3 with a fixed scale of 2^-14: the
# embeddings (about N(0, 1)) all fall below E4M3's smallest subnormal, the layer sees zeros
FAULT = """base = "te-delayed"
name = "te-delayed-flushed-fc-input"
[[layer]]
match = "*fc"
[layer.input]
scaling = 6.103515625e-05
"""


@pytest.mark.slow  # an end-to-end debugger run: make test-slow
def test_user_model_file_end_to_end(tmp_path, config):
    """``--model FILE.py:fn`` through the whole debugger: a fault planted on the user's hidden
    layer is named (role input, that layer), the JSON has the issue's fields, and the fix file
    names the user's module."""
    src = tmp_path / "mymodel.py"
    src.write_text(USER_MODEL)
    fault = tmp_path / "fault.toml"
    fault.write_text(FAULT)
    out = tmp_path / "out"
    r = runner.invoke(app, ["debug", "--config", str(config), "--model", f"{src}:tiny",
                            "--recipe", str(fault), "--steps", "30", "--set", "train.lr=1e-2",
                            "--set", "train.eval_every=5", "--checkpoints", "1", "--out",
                            str(out), "--json", "--quiet", "--threads", "1"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(d) == ["schema_version", "recipe", "baseline", "gap_pct", "noise_pct",
                       "recovers", "culprit", "attribution", "remedies", "fix", "probes",
                       "torch_device", "device", "predicted_step_ms"]  # fmt: skip
    # the user's model priced on the H100: the planted recipe, and its fix (a cell in higher
    # precision), which is no faster
    pred = d["predicted_step_ms"]
    assert d["device"] == "h100" and 0 < pred["run"] <= pred["fix"], pred
    full = json.loads((out / "debug_result.json").read_text())
    layers = full["details"]["layers"]
    fc = [n for n in layers if n.endswith("fc")]
    assert fc == layers, layers  # the output head stays unconverted
    assert d["gap_pct"] > 2 * d["noise_pct"], full["verdict"]
    assert d["culprit"] is not None, full["verdict"]
    assert d["culprit"]["role"] == "input" and d["culprit"]["layers"] == fc
    assert d["culprit"]["gemm"] in ("fprop", "wgrad")
    top = d["attribution"][0]
    assert (top["layer"], top["role"]) == (fc[0], "input"), d["attribution"]
    assert d["fix"] is not None and fc[0] in Path(d["fix"]).read_text()


def test_recipe_equal_to_the_baseline_suggests_another_baseline(tmp_path, config):
    base = ["debug", "--config", str(config), "--out", str(tmp_path / "out")]
    r = runner.invoke(app, [*base, "--recipe", "bf16"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    # the issue: it suggested --baseline bf16, the baseline it had just refused
    assert "--baseline bf16" not in text and "--baseline fp32" in text, text
    r = runner.invoke(app, [*base, "--recipe", "te-current", "--baseline", "te-current"])
    assert r.exit_code == 2 and "--baseline bf16" in " ".join(r.output.split()), r.output
