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


def _png_size(path):
    import struct

    head = path.read_bytes()[:24]
    return struct.unpack(">II", head[16:24])


def test_png_of_many_steps_stays_readable(tmp_path):
    # issue 22: 50 steps gave a 3,600-pixel-wide PNG; steps are aggregated into columns
    rows = [_row(s, f"blocks.{k}.mlp", "fprop", "input", 0.1 * k, 0.0)
            for s in range(200) for k in range(4)]  # fmt: skip
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["observe-report", str(p), "--out", str(tmp_path / "h.png")])
    assert res.exit_code == 0, res.output
    width, height = _png_size(tmp_path / "h.png")
    assert width <= 1700 and height <= 1000, (width, height)
    # many layers: the height is bounded too (labels shrink)
    rows = [_row(s, f"blocks.{k}.mlp", "fprop", "input", 0.1, 0.0)
            for s in range(3) for k in range(300)]  # fmt: skip
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["observe-report", str(p), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    width, height = _png_size(tmp_path / "t.png")
    assert width <= 1700 and height <= 1300, (width, height)


def test_heatmap_colours_are_the_legends_levels(tmp_path):
    # issue 22: the legend named orange/red levels the purple-to-yellow map could not show
    from fp8lab.report.observe import _figure, heatmap_data

    fig = _figure(heatmap_data(ROWS))
    img = fig.axes[0].images[0]
    rgba = img.to_rgba(img.get_array())  # underflow: a 0.5/4.5 (warning/critical), b 4.0/0.0
    r, g, b = (float(x) for x in rgba[0, 1, :3])  # 4.5 %: critical -> red
    assert r > 0.5 and g < 0.3 and b < 0.3, (r, g, b)
    r, g, b = (float(x) for x in rgba[1, 0, :3])  # 4.0 %: warning -> orange
    assert r > 0.9 and 0.3 < g < 0.8 and b < 0.5, (r, g, b)
    r, g, b = (float(x) for x in rgba[1, 1, :3])  # 0 %: fine -> grey
    assert abs(r - g) < 0.05 and abs(g - b) < 0.05
    legend = " ".join(t.get_text() for t in fig.legends[0].get_texts())
    assert "warning" in legend and "critical" in legend and "orange" not in legend


def test_first_step_of_delayed_scaling_is_marked_warm_up(tmp_path):
    rows = [
        {**_row(0, "a", "fprop", "input", 0.0, 9.0), "spec": "e4m3:tensor:delayed(h=1024, max)"},
        {**_row(1, "a", "fprop", "input", 0.0, 9.0), "spec": "e4m3:tensor:delayed(h=1024, max)"},
        {**_row(0, "b", "fprop", "input", 0.0, 9.0), "spec": "e4m3:tensor:max"},
    ]
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["observe-report", str(p), "--json"])
    assert res.exit_code == 0, res.output
    warm = {(f["layer"], f["step"]): f["warmup"] for f in json.loads(res.stdout)["flags"]}
    assert warm == {("a", 0): True, ("a", 1): False, ("b", 0): False}
    res = runner.invoke(app, ["observe-report", str(p)])
    lines = [ln for ln in res.stdout.splitlines() if "critical " in ln]
    assert len(lines) == 3 and sum("warm-up" in ln for ln in lines) == 1
    assert "warm-up" in next(ln for ln in lines if "step      0" in ln and " a " in ln)
