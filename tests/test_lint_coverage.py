"""ruff lints every Python file of the package and its tests (issue 32).

ruff's default excludes skip directories such as ``dist`` or ``build``: ``src/fp8lab/dist`` was
never linted, and nothing said so. ``ruff check --show-files .``, run from the repository root
as ``make lint`` runs it, must list every ``.py`` file under ``src/`` and ``tests/``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.no_arithmetic


def _ruff() -> str:
    """The ruff installed beside this Python (the venv's, as ``make lint`` uses), else PATH's."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed (pip install -e '.[dev]')"
    return ruff


def _python_files(top: Path) -> set[Path]:
    return {
        p.resolve()
        for p in top.rglob("*.py")
        if not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(top).parts
        )
    }


def test_ruff_sees_every_python_file_under_src_and_tests() -> None:
    res = subprocess.run(
        [_ruff(), "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    seen = {(ROOT / line.strip()).resolve() for line in res.stdout.splitlines() if line.strip()}
    want = _python_files(ROOT / "src") | _python_files(ROOT / "tests")
    assert len(want) > 100  # the walk found the tree
    missing = sorted(str(p.relative_to(ROOT)) for p in want - seen)
    assert not missing, f"ruff check skips {len(missing)} file(s): {missing[:20]}"
