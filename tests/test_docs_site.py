"""The project's habits stay in place: README size and shape, one version, lint hooks = make lint,
every docs page in the site's navigation, a changelog."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import fp8lab

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_starts_with_the_three_quick_starts():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300
    head = "\n".join(lines[:60])
    for job in ("Compare recipes", "drifts", "Study numerics"):
        assert job in head, job
    first_table = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    assert first_table > max(i for i, ln in enumerate(lines[:60]) if "fp8lab snr" in ln)


def test_version_has_one_source():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and '\nversion = "' not in pyproject
    assert 'attr = "fp8lab.__version__"' in pyproject
    assert importlib.metadata.version("fp8lab") == fp8lab.__version__


def test_pre_commit_hooks_are_the_make_lint_checks():
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    lint = make.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    hooks = (ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    entries = sorted(e.split("/")[-1] for e in re.findall(r"entry:\s*(.+)", hooks))
    assert entries == ["ruff check --force-exclude", "ruff format --check --force-exclude"]
    assert "ruff check ." in lint and "ruff format --check ." in lint


def test_every_docs_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if f": {p}" not in nav)
    assert not missing, f"mkdocs.yml nav lacks {missing}"


def test_ci_runs_lint_docs_and_tests():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "make lint docs test" in ci


def test_changelog_keeps_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in text and f"## [{fp8lab.__version__}]" in text
