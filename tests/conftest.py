"""Shared test setup. This file also puts ``tests/`` on the import path, so tests can import
the helpers kept here (``from tiny_lab import tiny_lab_toml``)."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

import fp8lab


def _torch_kernels_run() -> bool:
    from fp8lab import kernels

    return kernels.get_kernels() == "torch"


def pytest_configure(config: pytest.Config) -> None:
    # The CLI's tables take their width from COLUMNS (a pipe without it: 120 columns). pytest-xdist's
    # workers inherit COLUMNS=80 and LINES=24 from its launcher: a test that wants a width says so.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    config.addinivalue_line(
        "markers",
        "numba_only: tests numba kernels themselves; skipped under FP8LAB_KERNELS=torch",
    )
    if _torch_kernels_run():
        _fence_numba()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _torch_kernels_run():
        return
    skip = pytest.mark.skip(reason="tests a numba kernel itself; FP8LAB_KERNELS=torch run")
    for item in items:
        if item.get_closest_marker("numba_only"):
            item.add_marker(skip)


class NumbaKernelCalled(AssertionError):
    """A numba kernel ran although FP8LAB_KERNELS=torch asked for the generic kernels only."""


def _fence_numba() -> None:
    """Under ``FP8LAB_KERNELS=torch``, make every numba kernel of fp8lab raise when called.

    So the run proves that the generic kernels, not numba, produced every result it checks: a
    kernel that is not yet routed through `fp8lab.kernels.use_torch` fails its tests loudly.
    """
    from numba.core.registry import CPUDispatcher

    for info in pkgutil.walk_packages(fp8lab.__path__, "fp8lab."):
        if ".cli" in info.name or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional dependency (triton, lightning) absent
            if (exc.name or "").split(".")[0] == "fp8lab":
                raise
            continue  # such a module holds no numba kernel
        for name, value in list(vars(module).items()):
            if isinstance(value, CPUDispatcher):
                setattr(module, name, _refuse(f"{info.name}.{name}"))


def _refuse(name: str):
    def kernel(*args, **kwargs):
        raise NumbaKernelCalled(f"numba kernel {name} called under FP8LAB_KERNELS=torch")

    return kernel


@pytest.fixture
def threads():
    """Restore torch's and numba's thread counts after the test (tests of the numba kernels'
    thread policy set both)."""
    import numba
    import torch

    t, n = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(t)
    numba.set_num_threads(n)
