"""`fp8lab.lab.snr` imports only downward: never the report or CLI layers (also inside
functions), and its modules form no cycle (each imports only the ones listed before it)."""

from __future__ import annotations

import ast
from pathlib import Path

import fp8lab.lab.snr as pkg

# the package's modules in dependency order
ORDER = ("config", "result", "casts", "sequential", "tensorcore", "engine", "presets", "__init__")
ABOVE = ("fp8lab.report", "fp8lab.cli")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_upward_import_and_no_cycle() -> None:
    root = Path(pkg.__file__).parent
    files = sorted(root.glob("*.py"))
    assert {f.stem for f in files} == set(ORDER)
    for f in files:
        imports = _imports(f)
        up = sorted(i for i in imports if i.startswith(ABOVE))
        assert not up, f"{f.name} imports {up}"
        later = ORDER[ORDER.index(f.stem) + 1 :]
        back = sorted(
            i for i in imports for m in later if i == f"fp8lab.lab.snr.{m}" and m != "__init__"
        )
        assert not back, f"{f.name} imports a module that depends on it: {back}"
