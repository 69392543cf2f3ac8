"""What every fp8lab HTML and Markdown report shares: the page head (style, and the script that
marks each image once loaded, which ``scripts/check_report.py`` reads), table cells and tables."""

from __future__ import annotations

import html
import math
from typing import Any

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.negative td { color: #a00; }
p.warning { color: #a00; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 0.85em; }
"""

# marks every image once the page has loaded; scripts/check_report.py reads the marks
SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img"), ok = 0;
  imgs.forEach(function (im) {
    var good = im.complete && im.naturalWidth > 0;
    im.setAttribute("data-loaded", good ? "1" : "0");
    if (good) ok++;
  });
  document.body.setAttribute("data-figures", ok + "/" + imgs.length);
});
"""


def page_start(title: str, heading: str) -> list[str]:
    """The opening lines of a report page, through its ``<h1>``."""
    return ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{CSS}</style><script>{SCRIPT}</script></head><body>",
            f"<h1>{html.escape(heading)}</h1>"]  # fmt: skip


def cell(v: Any, spec: str = ".4f", blank_nonfinite: bool = False) -> str:
    """A table cell: "—" for None (and for Inf/NaN with ``blank_nonfinite``), yes/no, floats
    formatted with ``spec``."""
    if v is None or (blank_nonfinite and isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def gap_cell(v: Any, spec: str = "+.3f") -> str:
    """A signed result cell (gaps, scores): `cell` with Inf/NaN shown as "—"."""
    return cell(v, spec, blank_nonfinite=True)


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines (``|`` in a cell becomes ``/``)."""
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return out


def html_table(head: list[str], rows: list[list[str]]) -> str:
    """An HTML table, every cell escaped."""
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    return "\n".join(out) + "</table>"
