"""`fp8lab.report.snr`: the study's tables and figures, written from lab results (the report reads
the lab; the lab never imports the report)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8lab.lab.snr import PLOT_CAP_DB, Figure, Panel, Preset, SnrConfig, SnrResult, snr_db
from fp8lab.report import snr as report


def _result(cfg: SnrConfig, ref: list[float], out: list[float]) -> SnrResult:
    r, o = np.array(ref), np.array(out)
    return SnrResult(cfg, snr_db(r, o), r, o)


A = SnrConfig(length=8, samples=3, seed=1)
B = SnrConfig(length=8, samples=3, seed=2)
# errors 0.1, 0.01 and 0 against references of 1: 20, 40 and +inf dB
RES = {
    A: _result(A, [1.0, 1.0, 1.0], [1.1, 1.01, 1.0]),
    B: _result(B, [2.0, -1.0, 4.0], [1.0, -1.0, 2.0]),
}
PRESET = Preset(
    "demo",
    "a demo study",
    (
        Figure("f_err", "abs error", (Panel("p", (("a", A), ("b", B))),), metric="abs_error"),
        Figure("f_snr", "snr", (Panel("p", (("a", A), ("b", B))),)),
    ),
)


def test_fmt_db() -> None:
    assert report.fmt_db(12.345) == "12.35"
    assert report.fmt_db(math.inf) == "inf" and report.fmt_db(-math.inf) == "-inf"
    assert report.fmt_db(math.nan) == "nan"


def test_table_rows_and_markdown() -> None:
    rows = report.table_rows(PRESET, RES)
    assert [(r["figure"], r["series"]) for r in rows] == [("f_snr", "a"), ("f_snr", "b")]
    a = rows[0]
    assert a["median_db"] == pytest.approx(40.0) and a["p90_db"] == math.inf
    assert a["exact_fraction"] == pytest.approx(1 / 3) and a["below_0db_fraction"] == 0.0
    b = rows[1]
    # errors 1, 0, 2 against 2, -1, 4: 6.02 dB, inf, 6.02 dB
    assert b["median_db"] == pytest.approx(20 * math.log10(2.0))
    md = report.markdown_table(rows)
    lines = md.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| figure | panel | series |")
    assert "| f_snr | p | a | 40.00 |" in md and "| 0.0% |" in md


def test_plot_values_cap_infinite_snr() -> None:
    v = report._plot_values(RES[A])
    assert v.max() == PLOT_CAP_DB and np.all(np.isfinite(v))
    np.testing.assert_allclose(report._plot_values(RES[B], "abs_error"), [1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="unknown metric"):
        report._plot_values(RES[A], "snr")


def test_write_preset_report(tmp_path) -> None:
    written = report.write_preset_report(PRESET, RES, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == ["demo.md", "f_err.png", "f_snr.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "demo.md").read_text().startswith("# a demo study\n")
    with pytest.raises(ValueError, match="no panels"):
        report.plot_panels([], tmp_path / "x.png")
