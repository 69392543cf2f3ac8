"""Every ``from fp8lab... import ...`` the README and the docs pages show (in code blocks or
inline) works."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IMPORT = re.compile(r"from (fp8lab[\w.]*) import ([\w, ]+)")


@pytest.mark.no_arithmetic  # imports only: the same on every kernel and CPU
def test_readme_import_statements_import():
    found = [f for p in PAGES for f in IMPORT.findall(p.read_text(encoding="utf-8"))]
    assert any(mod == "fp8lab.qtensor" for mod, _ in found)  # the retile_counts line
    for mod, names in found:
        module = importlib.import_module(mod)  # `fp8lab.quantize` (a function) used to fail here
        for name in (n.strip().split(" as ")[0] for n in names.split(",")):
            # a name is an attribute, or a submodule (`from fp8lab.lab import early_warning`)
            ok = hasattr(module, name) or importlib.util.find_spec(f"{mod}.{name}") is not None
            assert ok, f"README/docs: from {mod} import {name}"
