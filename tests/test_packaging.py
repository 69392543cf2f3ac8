"""pyproject.toml and constraints.txt (issue 24): the package's dependencies carry lower bounds
only, so fp8lab installs next to the torch a GPU machine already has; the exact versions `make`
installs are pinned in constraints.txt, which must pin every package pyproject names (the
dependencies and every extra) at a version that satisfies pyproject's bounds."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return out


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        assert m, f"constraints.txt:{n}: {line!r} is not NAME==VERSION"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def test_every_dependency_has_a_lower_bound_and_no_pin() -> None:
    for where, req in _requirements():
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", "~="}, f"pyproject {where}: {req} has no lower bound"
        assert not ops & {"==", "==="}, f"pyproject {where}: {req} is pinned; pin in constraints"


def test_constraints_pin_every_dependency_within_its_bounds() -> None:
    pins = _pins()
    for where, req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject {where}: {req.name} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject {where}: {req}"
        )


def test_torch_lower_bound_admits_a_gpu_machines_torch() -> None:
    (torch,) = [r for _, r in _requirements() if r.name == "torch"]
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.11.0+cu130")


def test_make_installs_torch_first_and_with_the_constraints() -> None:
    lines = [ln.strip() for ln in (ROOT / "Makefile").read_text().splitlines()]
    installs = [ln for ln in lines if "pip install" in ln]
    assert installs and all("-c constraints.txt" in ln for ln in installs), installs
    assert installs[0].endswith(" torch"), installs[0]  # the CPU wheel before anything pulls one
