"""The passes of ``make test`` and ``make test-avx2`` (Makefile): the first pass runs every test;
the repeats of the numeric subset (on the torch kernels, under AVX2) leave out only the tests
marked ``no_arithmetic`` (imports, layering), so every assertion still runs in ``make test``."""

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


def test_first_pass_runs_every_test() -> None:
    first = _recipe("test")[0]
    assert first == "$(PY) -m pytest", first  # no -m, -k or path: the whole suite


def test_repeats_leave_out_only_the_no_arithmetic_tests() -> None:
    assert _variable("REPEAT") == '-m "not no_arithmetic"'
    repeats = [_recipe("test")[1], _recipe("test-torch-kernels")[0], _recipe("test-avx2")[-1]]
    for line in repeats:
        assert line.endswith("-m pytest $(REPEAT) $(NUMERIC_TESTS)"), line
    assert repeats[0].startswith("FP8LAB_KERNELS=torch ") and repeats[2].startswith("$(AVX2_ENV) ")


def test_no_arithmetic_marker_is_registered() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("no_arithmetic:") for m in cfg["markers"])
