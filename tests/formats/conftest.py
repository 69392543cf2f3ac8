"""Fixtures of the format tests: ``kernels`` runs a test once per kernel implementation."""

from __future__ import annotations

import pytest

from fp8lab.kernels import using_kernels

#: numba runs are skipped in the FP8LAB_KERNELS=torch run (its fence makes numba raise)
KERNELS = [pytest.param("numba", marks=pytest.mark.numba_only), "torch"]


@pytest.fixture(params=KERNELS)
def kernels(request: pytest.FixtureRequest):
    """The oracle tests that take this fixture run once on numba and once on the torch kernels."""
    with using_kernels(request.param):
        yield request.param
