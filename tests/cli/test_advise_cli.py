"""``fp8lab advise`` on the command line: every bad input is one ``Error:`` line and exit code 2
before any training (budget, candidates, device, executor, output directory); (slow) a run's
--json, files and report, and --config."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.lab.pool import set_executor
from tiny_lab import tiny_lab_toml

runner = CliRunner()


@pytest.fixture(autouse=True)
def _local_executor():
    yield
    set_executor("local")


def _one_error(r) -> str:
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


def _text(tmp_path: Path) -> Path:
    p = tmp_path / "t.txt"
    p.write_text("hello world " * 300)
    return p


@pytest.mark.no_arithmetic
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--budget", "0"], "must be a percentage > 0"),
        (["--budget", "-1%"], "must be a percentage > 0"),
        (["--budget", "half"], "not a number"),
        (["--budget", "1", "--candidates", "mxfp8,fp9"], "unknown candidate 'fp9'"),
        (["--budget", "1", "--candidates", "nvfp4-te", "--device", "h100"],
         "candidate 'nvfp4-te': h100 cannot run it"),
        (["--budget", "1", "--device", "a100"], "a100"),
        (["--budget", "1", "--candidates", ","], "--candidates: empty value"),
    ],
)  # fmt: skip
def test_bad_input_is_one_error_line_before_any_training(tmp_path, args, words):
    out = tmp_path / "out"
    r = runner.invoke(app, ["advise", *args, "--data", str(_text(tmp_path)), "--out", str(out)])
    assert words in _one_error(r)
    assert not (out / "probes").exists()


@pytest.mark.no_arithmetic
def test_ray_without_the_extra_or_unreachable_is_one_error(tmp_path, monkeypatch):
    data = ["--data", str(_text(tmp_path)), "--out", str(tmp_path / "o"), "--budget", "1"]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # import ray -> ImportError
        assert "fp8lab[ray]" in _one_error(
            runner.invoke(app, ["advise", *data, "--executor", "ray"])
        )
    pytest.importorskip("ray", reason="the ray extra is not installed")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = runner.invoke(app, ["advise", *data, "--executor", "ray", "--ray-address",
                            f"127.0.0.1:{port}"])  # fmt: skip
    assert "cannot reach" in _one_error(r)


@pytest.mark.no_arithmetic
def test_an_out_directory_someone_else_made_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("keep me")
    r = runner.invoke(app, ["advise", "--budget", "1", "--candidates", "mxfp8", "--data",
                            str(_text(tmp_path)), "--out", str(out)])  # fmt: skip
    assert "not made by fp8lab advise" in _one_error(r)
    assert [p.name for p in out.iterdir()] == ["notes.md"] and (
        out / "notes.md"
    ).read_text() == "keep me"


@pytest.mark.slow  # a whole (tiny) search through the command line
def test_json_is_one_line_with_the_schema_and_the_files_are_written(tmp_path):
    cfg = tmp_path / "lab.toml"
    cfg.write_text(tiny_lab_toml(_text(tmp_path), steps=12, eval_every=6, batch_size=4))
    out = tmp_path / "out"
    r = runner.invoke(app, ["advise", "--config", str(cfg), "--budget", "5%", "--candidates",
                            "mxfp8", "--seeds", "1", "--threads", "1", "--out", str(out),
                            "--json", "--price-set", "model.d_model=2048", "--price-set",
                            "model.block_size=1024"])  # fmt: skip
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert doc["schema_version"] == 1 and doc["budget_pct"] == 5.0 and doc["device"] == "b200"
    assert doc["chosen"]["name"] in {"mxfp8", "bf16"} and doc["price_overrides"]
    for f in ("advise.toml", "advise.megatron.yaml", "advise.te.yaml", "advise_result.json",
              "report.md", "report.html", "figures/pareto.png"):  # fmt: skip
        assert (out / f).is_file(), f
    assert "== baseline" in r.stderr  # progress on stderr though not a terminal
