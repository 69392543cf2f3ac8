import math

import pytest

from fp8lab.report.page import cell, gap_cell, html_table, md_table, page_start

pytestmark = pytest.mark.no_arithmetic


def test_cells_say_missing_yes_no_and_format_floats():
    assert cell(None) == "—"
    assert cell(True) == "yes" and cell(False) == "no"
    assert cell(0.123456) == "0.1235" and cell(2.5, "+.1f") == "+2.5"
    assert cell(math.inf) == "inf" and cell(math.inf, blank_nonfinite=True) == "—"
    assert cell(math.nan, blank_nonfinite=True) == "—" and cell(7) == "7"


def test_tables_escape_their_cells():
    assert md_table(["a", "b"], [["x|y", "1"]]) == ["| a | b |", "|---|---|", "| x/y | 1 |"]
    t = html_table(["<h>"], [["a&b"]])
    assert "<th>&lt;h&gt;</th>" in t and "<td>a&amp;b</td>" in t and t.endswith("</table>")


def test_page_start_escapes_and_carries_the_image_marks():
    head = "\n".join(page_start("t<1>", "h & h"))
    assert head.startswith("<!DOCTYPE html>") and "<title>t&lt;1&gt;</title>" in head
    assert "<h1>h &amp; h</h1>" in head and "data-loaded" in head


def test_gap_cells_are_signed_and_blank_when_not_finite():
    assert gap_cell(0.1234) == "+0.123" and gap_cell(-2.0, ".2f") == "-2.00"
    assert gap_cell(math.inf) == "—" and gap_cell(None) == "—"
