"""`fp8lab observe-report`: heatmap cells are the worst operand per layer and step, levels at the
documented thresholds, PNG/HTML/--json outputs, exit code 2 on bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app

runner = CliRunner()


def _row(step, layer, gemm, role, uf, sat):
    return {"step": step, "layer": layer, "gemm": gemm, "role": role, "call": 0,
            "underflow_pct": uf, "saturation_pct": sat}  # fmt: skip


ROWS = [
    _row(0, "a", "fprop", "input", 0.1, 0.0),
    _row(0, "a", "dgrad", "grad_output", 0.5, None),  # worst underflow of (a, 0): warning
    _row(0, "b", "fprop", "input", 4.0, 0.49),  # 4.0 itself is still a warning
    _row(5, "a", "wgrad", "grad_output", 4.5, 0.0),  # critical
    _row(5, "b", "fprop", "weight", 0.0, 12.0),  # critical saturation
]


@pytest.fixture
def records(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def test_json_cells_and_flags(records, tmp_path):
    res = runner.invoke(app, ["observe-report", str(records), "--out", str(tmp_path / "h.png"),
                              "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["layers"] == ["a", "b"] and out["steps"] == [0, 5]
    assert out["underflow_pct"] == [[0.5, 4.5], [4.0, 0.0]]
    assert out["saturation_pct"] == [[0.0, 0.0], [0.49, 12.0]]
    flags = {(f["layer"], f["step"], f["metric"]): (f["level"], f["worst"]) for f in out["flags"]}
    assert flags == {
        ("a", 0, "underflow_pct"): ("warning", "dgrad/grad_output"),
        ("b", 0, "underflow_pct"): ("warning", "fprop/input"),
        ("a", 5, "underflow_pct"): ("critical", "wgrad/grad_output"),
        ("b", 5, "saturation_pct"): ("critical", "fprop/weight"),
    }
    assert out["thresholds"] == {"fine_below_pct": 0.5, "critical_above_pct": 4.0}
    png = (tmp_path / "h.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_png_and_html_and_text(records, tmp_path):
    res = runner.invoke(app, ["observe-report", str(records)])
    assert res.exit_code == 0, res.output
    assert records.with_suffix(".png").exists()
    assert "2 critical, 2 warning" in res.stdout
    html = tmp_path / "r.html"
    res = runner.invoke(app, ["observe-report", str(records), "--out", str(html)])
    assert res.exit_code == 0, res.output
    text = html.read_text()
    assert "data:image/png;base64," in text and text.count("<tr class='critical'>") == 2


def test_csv_records(tmp_path):
    p = tmp_path / "w.csv"
    p.write_text("step,layer,gemm,role,underflow_pct,saturation_pct\n3,x,fprop,input,5,\n")
    res = runner.invoke(app, ["observe-report", str(p), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["flags"][0]["level"] == "critical"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "no records (empty file)"),
        ("{not json\n", "w.jsonl:1: not valid JSON"),
        ('{"step": 1}\n', "not an fp8lab.watch record"),
        (
            '{"step": "x", "layer": "a", "gemm": "fprop", "role": "input", "underflow_pct": 1, '
            '"saturation_pct": 1}\n',
            "'step' is not an integer",
        ),
        (b"\xff\xfe\x00", "not a text file"),
    ],
)
def test_bad_files_exit_2(tmp_path, content, message):
    p = tmp_path / "w.jsonl"
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    res = runner.invoke(app, ["observe-report", str(p)])
    assert res.exit_code == 2
    assert message in res.output
    assert not p.with_suffix(".png").exists()


def test_bad_out_suffix_exit_2(records, tmp_path):
    res = runner.invoke(app, ["observe-report", str(records), "--out", str(tmp_path / "x.txt")])
    assert res.exit_code == 2 and "--out must end in .png or .html" in res.output
