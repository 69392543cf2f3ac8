"""``scripts/gpu_check.py`` imported as the module ``gpu_check`` (scripts/ is not a package), for
tests/scripts (its CPU tests) and tests/gpu (the CUDA-only ones)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def load() -> ModuleType:
    """The script's module (loaded once per process)."""
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
