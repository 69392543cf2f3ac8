"""Every CLI command sets the lab's torch device for its process (``--torch-device``, default
auto); in the test process the next test gets the device back."""

from __future__ import annotations

import pytest

from fp8lab.lab import machine


@pytest.fixture(autouse=True)
def _restore_torch_device():
    old = machine.torch_device()
    yield
    machine.set_torch_device(old)
