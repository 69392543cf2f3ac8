"""The passes of ``make test``, ``make test-slow`` and ``make test-avx2`` (Makefile): the fast
pass runs every test not marked ``slow`` and ``make test-slow`` the slow ones, so every test runs
in one of them; the repeats of the numeric subset (on the torch kernels, under AVX2) leave out the
tests marked ``no_arithmetic`` (imports, layering) and the slow ones."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target (tab-indented lines after ``target:``)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{target}:"))
    out = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("\t"):
            break
        out.append(ln.strip())
    return out


def _variable(name: str) -> str:
    for ln in (ROOT / "Makefile").read_text().splitlines():
        if ln.startswith(f"{name} :="):
            return ln.split(":=", 1)[1].strip()
    raise AssertionError(f"Makefile: no {name} :=")


def test_fast_and_slow_passes_run_every_test_between_them() -> None:
    # no -k or path: the fast pass takes every test not marked slow, test-slow the rest
    pytest = _variable("PYTEST")
    assert pytest.startswith("$(PY) -m pytest -n $(JOBS) "), pytest
    options = pytest.removeprefix("$(PY) -m pytest")
    assert " -m " not in options and " -k " not in options, pytest  # no selection of its own
    assert _recipe("test")[0] == '$(PYTEST) -m "not slow"', _recipe("test")
    assert _recipe("test-slow") == ["$(PYTEST) -m slow"], _recipe("test-slow")


def test_ci_runs_the_fast_slow_and_avx2_passes() -> None:
    ci = (ROOT / ".ci" / "run").read_text().split()
    for target in ("test", "test-slow", "test-avx2"):
        assert target in ci, f".ci/run does not run make {target}"


def test_repeats_leave_out_only_the_no_arithmetic_and_slow_tests() -> None:
    assert _variable("REPEAT") == '-m "not no_arithmetic and not slow"'
    repeats = [_recipe("test")[1], _recipe("test-torch-kernels")[0], _recipe("test-avx2")[-1]]
    for line in repeats:
        assert line.endswith("$(PYTEST) $(REPEAT) $(NUMERIC_TESTS)"), line
    assert repeats[0].startswith("FP8LAB_KERNELS=torch ") and repeats[2].startswith("$(AVX2_ENV) ")


def test_no_arithmetic_marker_is_registered() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("no_arithmetic:") for m in cfg["markers"])
