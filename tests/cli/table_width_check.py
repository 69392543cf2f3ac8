"""Shared check of issue 22: a table printed at 80 columns is readable (imported by tests)."""

from __future__ import annotations

import re

NARROW = {"COLUMNS": "80"}


def assert_readable(output: str, headers: list[str], names: list[str] = (), width: int = 80):
    """No line wider than ``width``, no cell cut with '…', every header and every name whole
    (on one line, so never split mid-word)."""
    lines = output.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert "…" not in output, output
    for text in [*headers, *names]:
        assert any(re.search(rf"(?<![\w-]){re.escape(text)}(?![\w-])", ln) for ln in lines), (
            text,
            output,
        )
