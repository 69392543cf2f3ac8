"""`fp8lab formats`: table, --json, --plot, bad names."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.formats import format_names

runner = CliRunner()


def test_table_lists_every_format():
    res = runner.invoke(app, ["formats"])
    assert res.exit_code == 0, res.output
    for name in format_names():
        assert name in res.output
    assert "448" in res.output and "57344" in res.output and "S.1111.111" in res.output


def test_json_named_and_custom():
    res = runner.invoke(app, ["formats", "e4m3", "hif8", "e6m9", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [r["name"] for r in rows] == ["e4m3", "hif8", "e6m9"]
    e4m3, hif8, e6m9 = rows
    assert (e4m3["max"], e4m3["min_normal"], e4m3["min_subnormal"]) == (448.0, 2**-6, 2**-9)
    assert e4m3["inf"] is None and e4m3["nan"] == "S.1111.111" and e4m3["binades"] == 18
    assert (hif8["max"], hif8["min_subnormal"], hif8["binades"]) == (32768.0, 2**-22, 38)
    assert hif8["inf"] == "0x6F / 0xEF" and hif8["nan"] == "0x80" and not hif8["negative_zero"]
    assert e6m9["bias"] == 31 and e6m9["epsilon"] == 2**-9


def test_plot_writes_png(tmp_path):
    out = tmp_path / "precision.png"
    res = runner.invoke(app, ["formats", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out2 = tmp_path / "sub" / "two.png"
    res = runner.invoke(app, ["formats", "e4m3", "hif8", "--json", "--plot", str(out2)])
    assert res.exit_code == 0 and out2.exists()
    json.loads(res.output)  # --json output stays pure JSON


def test_unknown_name_lists_valid_names():
    res = runner.invoke(app, ["formats", "e9m9"])
    assert res.exit_code == 2
    assert "valid names" in res.output and "hif8" in res.output


def test_relative_precision_taper():
    from fp8lab.cli.formats import relative_precision
    from fp8lab.formats import get_format

    hif8 = relative_precision(get_format("hif8"), [0.5, 5.5, 10.5, -10.5, -20.5, 15.5])
    assert list(hif8[:5]) == [2**-3, 2**-2, 2**-1, 2**-1, 1.0]
    assert hif8[5] != hif8[5]  # beyond max: NaN
    e4m3 = relative_precision(get_format("e4m3"), [0.5, 8.5, -6.5])
    assert list(e4m3) == [2**-3, 2**-3, 2**-2]


def test_tables_fit_80_columns():
    res = runner.invoke(app, ["formats"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    flat = "".join(res.stdout.split())
    for name in format_names():
        assert name in flat, name
    assert "S.1111.111" in flat and "57344" in res.stdout


def test_plot_paths_that_cannot_be_written(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for bad, words in (
        (tmp_path / "p.txt", "must end in"),
        (tmp_path, "must end in"),
        (Path("/proc/fp8lab-x.png"), "/proc/fp8lab-x.png"),
        (f / "p.png", "cannot create"),
    ):
        res = runner.invoke(app, ["formats", "--plot", str(bad)])
        assert res.exit_code == 2, (bad, res.output)
        assert words in res.stderr and "Traceback" not in res.output, (bad, res.stderr)


def test_names_and_aliases_never_split_mid_word_at_80_columns():
    # issue 22: "(bfloat16" on one line, ")" on the next -- a name folded mid-word
    res = runner.invoke(app, ["formats", "--json"])
    words = {w for r in json.loads(res.stdout) for w in [r["name"], *r["aliases"]]}
    res = runner.invoke(app, ["formats"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    # the first column's words: every one a whole name or alias, with its brackets
    firsts = [ln.split()[0] for ln in lines if ln[:1] == " " and ln[1:2] not in ("", " ")]
    for tok in firsts:
        if tok[0] == "(" or tok[-1] in "),":
            assert tok.strip("(),") in words, tok
