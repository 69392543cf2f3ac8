"""The package's import structure: layers import only downward, and no package has a cycle.

Every ``import`` / ``from ... import`` in ``src/fp8lab`` counts, at module level and inside
functions alike (an import hidden in a function is still an arrow). Layers, lowest first, as
docs/design.md describes them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp8lab"

#: top-level part of fp8lab -> layer (a module may import its own layer and those below)
LAYERS: dict[str, int] = {
    "_bits": 0,
    "_counters": 0,
    "_keys": 0,
    "kernels": 0,  # which kernels run (numba or the device-generic torch ones), numba's thread policy
    "formats": 0,
    "scaling": 1,
    "qtensor": 2,
    "stats": 2,
    "gemm": 3,
    "recipe": 4,
    "nn": 5,
    "optim": 5,
    "observe": 6,
    "cost": 6,
    "distributed": 6,
    "step": 6,  # one training step with hooks: optim below, the guard and lab above
    "guard": 7,  # the anomaly guard: reads nn/observe state, runs inside lab's loop
    "lab": 8,
    "integrations": 8,  # framework callbacks: guard/observe/nn below, never lab (nor lab them)
    "report": 9,
    "cli": 10,
    "__main__": 10,  # `python -m fp8lab`: the command line
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute fp8lab modules imported by ``path`` (relative imports resolved), with lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("fp8lab")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if not name.startswith("fp8lab"):
                continue
            # `from fp8lab.x import y` runs fp8lab.x (its __init__) first, then y when y is a
            # submodule: an arrow to both
            out.append((name, node.lineno))
            for a in node.names:
                sub = f"{name}.{a.name}"
                if _exists(sub):
                    out.append((sub, node.lineno))
    return out


def _exists(module: str) -> bool:
    p = SRC.parent.joinpath(*module.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_part_has_a_layer() -> None:
    parts = {_part(_module_name(p)) for p in _files()} - {None}
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"


def test_no_upward_import() -> None:
    bad = []
    for path in _files():
        src = _part(_module_name(path))
        if src is None:  # fp8lab/__init__.py re-exports the public API of every layer
            continue
        for target, line in _imports(path):
            dst = _part(target)
            # the top-level package re-exports every layer below the CLI
            level = LAYERS[dst] if dst is not None else LAYERS["cli"] - 0.5
            if level > LAYERS[src]:
                bad.append(f"{path.relative_to(SRC)}:{line} ({src}) imports {target} ({dst})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _files():
        mod = _module_name(path)
        graph[mod] = {t for t, _ in _imports(path) if t != mod and _exists(t)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle() -> None:
    # every arrow counts, a package's __init__ re-exporting its submodules included: a submodule
    # that imports its own package back (`from fp8lab.guard import detectors` inside fp8lab.guard)
    # closes a cycle through the __init__
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, expect", [
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
])  # fmt: skip
def test_cycle_finder(graph: dict[str, set[str]], expect: bool) -> None:
    assert (_cycle(graph) is not None) == expect
