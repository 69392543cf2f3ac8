"""Issue 23's acceptance on the hot path: one steady-state Linear step stays in a handful of files
(`scripts/trace_linear_step.py`), and docs/design.md quotes what the script prints."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# issue 23's targets (6, 6, 7) plus fp8lab/kernels.py, the one device rule every kernel asks (issue 24)
LIMITS = {"te-delayed": 7, "te-current": 7, "deepseek-v3": 8}


def _script():
    spec = importlib.util.spec_from_file_location("trace", ROOT / "scripts/trace_linear_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("recipe", sorted(LIMITS))
def test_linear_step_visits_few_files_and_the_design_doc_says_so(recipe: str) -> None:
    mod = _script()
    s = mod.summarize(mod.trace_step(recipe))
    assert s["n_files"] <= LIMITS[recipe], s["files"]
    assert s["files"][0] == "nn/linear.py"
    doc = re.sub(r"\s+", " ", (ROOT / "docs/design.md").read_text())
    quoted = f"{s['n_files']} files, {s['n_functions']} functions, {s['n_calls']} calls ({recipe}"
    assert quoted in doc, f"docs/design.md does not quote {quoted!r}"
