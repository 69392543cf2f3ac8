import importlib.util
import math
import shutil
from pathlib import Path

import pytest

from fp8lab.report.training import ROLES, ema, last_stats, markdown_table, write_report

ROOT = Path(__file__).resolve().parents[2]


def _check_report_module():
    spec = importlib.util.spec_from_file_location("check_report", ROOT / "scripts/check_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(offset: float, steps: int = 20, diverge_at: int | None = None):
    recs = []
    for s in range(1, steps + 1):
        bad = diverge_at is not None and s >= diverge_at
        loss = None if bad else 5.0 / math.sqrt(s) + offset
        r = {"step": s, "train_loss": loss, "grad_norm": None if bad else 1.0 / s,
             "skipped_steps": 0, "spike": False, "tokens": 64, "step_time_s": 0.01}  # fmt: skip
        if s % 5 == 0:
            r["val_loss"] = None if bad else loss + 0.05
        recs.append(r)
    return recs


def _summary(metrics):
    recipes, details = {}, {}
    for n, recs in metrics.items():
        val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
        recipes[n] = {"final_train_loss": recs[-1]["train_loss"], "final_val_loss": val,
                      "rel_gap_pct": None if val is None else 0.1, "max_rel_gap_pct": None,
                      "skipped_steps": 0, "tokens_per_s": 6400.0, "diverged": val is None}  # fmt: skip
        details[n] = {"spikes": 0, "steps_done": 20, "step_time_ms": 10.0,
                      "memory_bytes": {"weights": 2**20, "optimizer": 2**21,
                                       "activations": 2**22, "total": 7 * 2**20},
                      "settings": {"name": n, "grad_output": {"format": "e5m2"}},
                      "negative_control": n == "bad"}  # fmt: skip
    return {"schema_version": 1, "baseline": "bf16", "recipes": recipes, "details": details}


@pytest.fixture
def report(tmp_path):
    metrics = {
        "bf16": _records(0.0),
        "te-delayed": _records(0.01),
        "bad": _records(0.5, diverge_at=12),
    }
    stats = {
        "te-delayed": [
            {"step": 10, "layer": "blocks.0.mlp.up", "role": r, "amax": 1.0, "underflow_pct": 2.0,
             "saturation_pct": 0.0, "sqnr_db": 30.0} for r in ("input", "weight", "grad_output")
        ]
    }  # fmt: skip
    paths = write_report(tmp_path, _summary(metrics), metrics, stats,
                         {"model": {"n_layer": 2, "d_model": 256, "d_ff": 768, "n_head": 4,
                                    "block_size": 128},
                          "train": {"steps": 20, "batch_size": 8, "lr": 3e-3, "seed": 1},
                          "data": {"paths": []}, "inject": {}},
                         command="fp8lab compare --steps 20")  # fmt: skip
    return tmp_path, paths


def test_report_files(report):
    out, paths = report
    assert set(paths) >= {"report.md", "report.html", "loss.png"}
    for name in ("loss.png", "gap.png", "grad_norm.png", "underflow.png"):
        data = (out / "figures" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (out / "report.md").read_text()
    assert "fp8lab compare --steps 20" in md
    assert "| bad (negative control) |" in md and "| bf16 (baseline) |" in md
    assert "![Loss curves](figures/loss.png)" in md
    assert '"format": "e5m2"' in md  # full settings
    assert "te-delayed | grad_output | 10 |" in md
    html = (out / "report.html").read_text()
    assert html.count("<img ") == 4 and "data-loaded" in html
    assert "<td>bad (negative control)</td>" in html
    assert "nan" not in markdown_table(_summary({"bad": _records(0.5, diverge_at=3)}))


def test_ema_and_last_stats():
    assert ema([1.0, 1.0, None, 1.0]) == [1.0, 1.0, None, 1.0]
    e = ema([0.0, 10.0], beta=0.5)
    assert e[0] == 0.0 and e[1] == pytest.approx(10.0 * 0.5 / 0.75)
    rows = [{"step": s, "role": "input", "amax": float(s), "underflow_pct": 0.0,
             "saturation_pct": 0.0, "sqnr_db": None} for s in (1, 2, 2)]  # fmt: skip
    agg = last_stats(rows)["input"]
    assert agg["step"] == 2 and agg["amax"] == 2.0 and agg["sqnr_db"] is None


def test_check_report_parses_dom():
    mod = _check_report_module()
    dom = '<html><img src="a.png" data-loaded="1"><img src="b.png" data-loaded="0"><img src="c.png"></html>'
    assert mod.check(dom) == (["a.png"], ["b.png", "c.png"])


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_report_renders_in_chromium(report):
    mod = _check_report_module()
    out, _ = report
    assert mod.main([str(out / "report.html")]) == 0
    (out / "figures" / "gap.png").unlink()  # a missing figure must be caught
    assert mod.main([str(out / "report.html")]) == 1


def test_check_report_skips_without_browser(report, monkeypatch, capsys):
    mod = _check_report_module()
    monkeypatch.setattr(mod, "find_browser", lambda: None)
    out, _ = report
    assert mod.main([str(out / "report.html")]) == 0
    assert "SKIPPED" in capsys.readouterr().out
    assert mod.main([str(out / "missing.html")]) == 2


def test_report_says_when_the_baseline_diverged(tmp_path):
    metrics = {"bf16": _records(0.0, diverge_at=12), "te-delayed": _records(0.01)}
    summary = _summary(metrics)
    summary["baseline_diverged"] = True
    for r in summary["recipes"].values():
        r["rel_gap_pct"] = r["max_rel_gap_pct"] = None
    write_report(tmp_path, summary, metrics, {},
                 {"model": {"n_layer": 2, "d_model": 256, "d_ff": 768, "n_head": 4,
                            "block_size": 128},
                  "train": {"steps": 20, "batch_size": 8, "lr": 50.0, "seed": 1},
                  "data": {"paths": []}, "inject": {}})  # fmt: skip
    md = (tmp_path / "report.md").read_text()
    assert "The baseline bf16 diverged" in md and "meaningless" in md
    assert "The baseline bf16 diverged" in (tmp_path / "report.html").read_text()
    healthy = _summary({"bf16": _records(0.0)})
    write_report(tmp_path / "ok", healthy, {"bf16": _records(0.0)}, {},
                 {"model": {"n_layer": 2, "d_model": 256, "d_ff": 768, "n_head": 4,
                            "block_size": 128},
                  "train": {"steps": 20, "batch_size": 8, "lr": 1e-3, "seed": 1},
                  "data": {"paths": []}, "inject": {}})  # fmt: skip
    assert "diverged (its loss" not in (tmp_path / "ok" / "report.md").read_text()


def test_report_names_a_users_model(tmp_path):
    """A run of `--model FACTORY` is described by its factory, not as the built-in GPT."""
    metrics = {"bf16": _records(0.0)}
    cfg = {
        "model": {"factory": "hf:examples/models/llama-tiny.json", "block_size": 128},
        "train": {"steps": 20, "batch_size": 8, "lr": 1e-3, "seed": 1},
        "data": {"paths": []},
        "inject": {},
    }
    write_report(tmp_path, _summary(metrics), metrics, {}, cfg)
    md = (tmp_path / "report.md").read_text()
    assert "Model: `hf:examples/models/llama-tiny.json`" in md and "GPT," not in md


def test_report_predicted_step_column():
    """Issue 17: a "predicted step ms on DEVICE" column, n/a with the reason when unpriced."""
    from fp8lab.report.training import render_html, render_markdown

    metrics = {"bf16": _records(0.0), "fp32": _records(0.0)}
    summary = _summary(metrics)
    summary["device"] = "b200"
    summary["recipes"]["bf16"]["predicted_step_ms"] = 0.0123456
    summary["recipes"]["fp32"]["predicted_step_ms"] = None
    summary["details"]["bf16"]["predicted_step"] = {"device": "b200", "ms": 0.0123456,
                                                    "reason": None}  # fmt: skip
    summary["details"]["fp32"]["predicted_step"] = {
        "device": "b200", "ms": None, "reason": "fp32 GEMMs are not priced"}  # fmt: skip
    cfg = {"model": {"n_layer": 2, "d_model": 256, "d_ff": 768, "n_head": 4, "block_size": 128},
           "train": {"steps": 20, "batch_size": 8, "lr": 1e-3, "seed": 1},
           "data": {"paths": []}, "inject": {}}  # fmt: skip
    md = render_markdown(summary, {}, {}, cfg, None)
    head = next(line for line in md.splitlines() if line.startswith("| recipe"))
    assert "predicted step ms on b200" in head
    row = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "0.01235" in row["bf16 (baseline)"] and "n/a" in row["fp32"]
    assert "n/a: fp32: fp32 GEMMs are not priced" in md
    page = render_html(summary, {}, {}, cfg, None)
    assert "<th>predicted step ms on b200</th>" in page and "<td>n/a</td>" in page
    assert "fp32 GEMMs are not priced" in page
    # a summary written before the column existed renders without it
    assert "predicted step" not in render_markdown(_summary(metrics), {}, {}, cfg, None)


def _render(summary, stats=None):
    from fp8lab.report.training import render_html, render_markdown

    cfg = {"model": {"n_layer": 2, "d_model": 256, "d_ff": 768, "n_head": 4, "block_size": 128},
           "train": {"steps": 20, "batch_size": 8, "lr": 1e-3, "seed": 1},
           "data": {"paths": []}, "inject": {}}  # fmt: skip
    return (render_markdown(summary, {}, stats or {}, cfg, None),
            render_html(summary, {}, stats or {}, cfg, None))  # fmt: skip


def test_report_does_not_rank_recipes_within_the_noise():
    # issue 22: mxfp8 at +0.505 % on one CPU and -0.033 % on another: inside the noise band
    names = ["fp32", "bf16", "mxfp8", "te-delayed", "bad"]
    summary = _summary({n: _records(0.0) for n in names})
    gaps = {"fp32": -0.2, "bf16": 0.0, "mxfp8": 0.505, "te-delayed": -0.189, "bad": 12.44}
    for n, g in gaps.items():
        summary["recipes"][n]["rel_gap_pct"] = g
        summary["details"][n]["within_noise"] = None if n == "bf16" else abs(g) <= 0.6
    summary["noise"] = {"rel_gap_pct": 0.3, "factor": 2.0, "source": "fp32 vs bf16: largest"}
    for text in _render(summary):
        flat = " ".join(text.split())
        assert "Noise: 0.300 %" in flat and "2 x 0.300 = 0.600 %" in flat
        assert "Within noise of bf16: fp32, mxfp8, te-delayed." in flat
        assert "Outside it, by gap: bad (+12.440 %)." in flat
    summary["noise"]["rel_gap_pct"] = None  # no fp32/bf16 pair: nothing is ranked
    assert "does not rank the recipes" in _render(summary)[0]
    del summary["noise"]  # a summary written before the noise existed renders as before
    assert "Noise" not in _render(summary)[0]


def test_report_names_the_machine_and_runs_from_another():
    from fp8lab.lab.machine import machine_info

    here = machine_info()
    summary = _summary({"bf16": _records(0.0), "mxfp8": _records(0.0)})
    summary["machine"] = here
    summary["details"]["bf16"]["machine"] = here
    summary["details"]["mxfp8"]["machine"] = {**here, "cpu": "Xeon", "cpu_capability": "AVX512"}
    md, page = _render(summary)
    assert f"Machine: {here['cpu']}, torch {here['torch']}" in md and "MKL" in md
    assert "Runs finished on another machine: mxfp8: Xeon" in md and "Machine:" in page
    assert "Machine:" not in _render(_summary({"bf16": _records(0.0)}))[0]


def test_underflow_figure_uses_a_log_axis(tmp_path, monkeypatch):
    # the negative control's grad_output underflow hid every other bar on a linear axis
    from matplotlib.axes import Axes

    from fp8lab.report.training import plot_underflow

    scales = []
    monkeypatch.setattr(Axes, "set_yscale", lambda self, v, **k: scales.append(v))
    row = {"step": 10, "layer": "l", "amax": 1.0, "saturation_pct": 0.0, "sqnr_db": 30.0}
    stats = {
        "te-delayed": [{**row, "role": r, "underflow_pct": 0.02} for r in ROLES],
        "bad": [{**row, "role": r, "underflow_pct": 40.0 if r == "grad_output" else 0.0}
                for r in ROLES],
    }  # fmt: skip
    assert plot_underflow(stats, tmp_path / "u.png") is not None
    assert scales == ["log"] and (tmp_path / "u.png").stat().st_size > 0
