"""Deterministic kernels for a lab run on CUDA (issue 24): the seam that decides and applies
``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG`` for a device type,
called here with a CUDA device on a machine without one (the settings are process state that
needs no GPU); that they are restored; that CPU runs are unchanged; and that the lab's runs go
through it with their device. A GPU run itself is not tested here (no CUDA on this machine)."""

from __future__ import annotations

import pytest
import torch

from fp8lab.lab import machine as machines
from fp8lab.lab.machine import deterministic_for, deterministic_kernels, machine_info

CFG = "CUBLAS_WORKSPACE_CONFIG"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(CFG, raising=False)
    monkeypatch.delenv(machines.DETERMINISTIC_ENV, raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(False)  # a failing test leaves no global mode behind


def _state() -> tuple[bool, bool, str | None]:
    import os

    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get(CFG))  # fmt: skip


def test_cuda_gets_deterministic_kernels_and_they_are_restored() -> None:
    assert deterministic_for("cuda") and deterministic_for(torch.device("cuda", 3))
    with deterministic_kernels(torch.device("cuda", 0)) as on:
        assert on and _state() == (True, False, ":4096:8")
    assert _state() == (False, False, None)


def test_restored_after_an_exception_and_the_callers_settings_come_back(monkeypatch) -> None:
    monkeypatch.setenv(CFG, ":0:0")  # not a reproducible setting: replaced inside, restored
    torch.use_deterministic_algorithms(False, warn_only=True)
    with pytest.raises(RuntimeError, match="boom"), deterministic_kernels("cuda"):
        assert _state()[0] and _state()[2] == ":4096:8"
        raise RuntimeError("boom")
    assert _state() == (False, True, ":0:0")


def test_a_reproducible_workspace_setting_of_the_caller_is_kept(monkeypatch) -> None:
    monkeypatch.setenv(CFG, ":16:8")
    with deterministic_kernels("cuda"):
        assert _state() == (True, False, ":16:8")
    assert _state() == (False, False, ":16:8")


def test_cpu_runs_are_unchanged() -> None:
    assert not deterministic_for("cpu")
    with deterministic_kernels("cpu") as on:
        assert not on and _state() == (False, False, None)
    m = machine_info()
    assert m["deterministic"] is False and m["torch_device"] == "cpu"
    torch.use_deterministic_algorithms(True)  # the caller's own choice is reported, kept
    assert deterministic_for("cpu") and machine_info()["deterministic"] is True
    with deterministic_kernels("cpu") as on:
        assert on and _state()[0]
    assert _state()[0]


def test_opt_out_and_bad_value(monkeypatch) -> None:
    monkeypatch.setenv(machines.DETERMINISTIC_ENV, "0")
    assert not deterministic_for("cuda")
    with deterministic_kernels("cuda") as on:
        assert not on and _state() == (False, False, None)
    monkeypatch.setenv(machines.DETERMINISTIC_ENV, "yes")
    with pytest.raises(ValueError, match=r"FP8LAB_DETERMINISTIC='yes': expected 0 or 1"):
        deterministic_for("cuda")


def test_lab_runs_go_through_the_seam_with_their_device(monkeypatch, tmp_path) -> None:
    """train_run (compare, debug, the pool's workers) and replay_step enter
    deterministic_kernels with the lab's device; on the CPU the run computes in the
    default mode."""
    from contextlib import contextmanager

    from fp8lab.lab import replay, train
    from fp8lab.lab.data import DataConfig, load_corpus
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import LabConfig, TrainConfig
    from fp8lab.recipe import get_recipe
    from tiny_lab import TINY_MODEL, TINY_TRAIN

    seen: list[torch.device] = []
    real = machines.deterministic_kernels

    @contextmanager
    def spy(device):
        seen.append(torch.device(device))
        with real(device) as on:
            yield on

    monkeypatch.setattr(machines, "deterministic_kernels", spy)
    monkeypatch.setattr(replay, "deterministic_kernels", spy)
    f = tmp_path / "t.txt"
    f.write_text("Now is the winter of our discontent made glorious summer. " * 80)
    data = DataConfig(paths=(str(f),), split_chunk=256)
    tiny = LabConfig(model=GPTConfig(**TINY_MODEL), data=data,
                     train=TrainConfig(steps=2, batch_size=2, eval_every=2, checkpoint_every=1,
                                       **TINY_TRAIN))  # fmt: skip
    corpus = load_corpus(data, block_size=16)
    modes: list[bool] = []
    cb = lambda event: modes.append(torch.are_deterministic_algorithms_enabled())  # noqa: E731
    train.train_run(get_recipe("bf16"), tiny, corpus, tmp_path / "run", callback=cb,
                    torch_device="cpu")  # fmt: skip
    assert seen == [torch.device("cpu")] and modes and not any(modes)
    replay.replay_step(tmp_path / "run", 1)
    assert seen == [torch.device("cpu")] * 2
