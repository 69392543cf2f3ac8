"""The kernel choice: FP8LAB_KERNELS / set_kernels, and the device rule of `use_torch`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fp8lab
from fp8lab import kernels


@pytest.fixture(autouse=True)
def _restore():
    old = kernels.get_kernels()
    yield
    kernels.set_kernels(old)


def test_set_kernels_returns_previous_and_is_reexported():
    kernels.set_kernels("numba")
    assert fp8lab.set_kernels("torch") == "numba"
    assert fp8lab.get_kernels() == "torch"


def test_unknown_name_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown kernels 'cuda'.*auto, numba, torch"):
        kernels.set_kernels("cuda")


def test_cpu_tensor_follows_the_choice():
    x = torch.zeros(3)
    kernels.set_kernels("auto")
    assert not kernels.use_torch(x)
    kernels.set_kernels("torch")
    assert kernels.use_torch(x)
    kernels.set_kernels("numba")
    assert not kernels.use_torch(x)


def test_meta_device_stands_in_for_a_gpu():
    # any non-CPU device takes the generic kernels under auto, and is an error under numba
    x = torch.zeros(3, device="meta")
    kernels.set_kernels("auto")
    assert kernels.use_torch(x)
    kernels.set_kernels("numba")
    with pytest.raises(ValueError, match=r"meta.*numba"):
        kernels.use_torch(x, what="cast")


def test_mixed_devices_are_an_error():
    with pytest.raises(ValueError, match="different devices"):
        kernels.use_torch(torch.zeros(1), torch.zeros(1, device="meta"))


def test_using_kernels_restores_and_counts():
    kernels.kernel_counts(reset=True)
    before = kernels.get_kernels()
    with kernels.using_kernels("torch"):
        assert kernels.use_torch(torch.zeros(1))
    assert kernels.get_kernels() == before
    assert kernels.kernel_counts()["torch"] == 1


@pytest.mark.parametrize("value", ["torch", "NUMBA", " auto "])
def test_environment_variable(value):
    code = "import fp8lab.kernels as k; print(k.get_kernels())"
    env = {"FP8LAB_KERNELS": value, "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == value.strip().lower()


def test_bad_environment_variable_names_it():
    code = "import fp8lab.kernels as k; k.get_kernels()"
    env = {"FP8LAB_KERNELS": "gpu", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "FP8LAB_KERNELS" in out.stderr and "'gpu'" in out.stderr
