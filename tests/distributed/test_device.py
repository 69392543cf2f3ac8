"""Devices under fp8lab.distributed.runtime (issue 24): ``--torch-device`` resolved to a concrete
device, this rank's GPU under torchrun, and where collectives put their tensors. CPU only: CUDA
is simulated by patching torch.cuda's availability and device count, never called."""

from __future__ import annotations

import pytest
import torch

from fp8lab.distributed.runtime import collective_device, resolve_torch_device


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_cpu_and_auto_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert resolve_torch_device("cpu") == torch.device("cpu")
    assert resolve_torch_device("auto") == torch.device("cpu")
    assert resolve_torch_device(None) == torch.device("cpu")
    assert resolve_torch_device(" CPU ") == torch.device("cpu")


def test_cuda_without_cuda_names_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    for value in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=f"--torch-device {value}: CUDA is not available"):
            resolve_torch_device(value)


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:", "tpu", "cuda:-1", ""])
def test_bad_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"expected one of auto, cpu, cuda, cuda:N"):
        resolve_torch_device(value)


def test_gpu_index_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    assert resolve_torch_device("cuda") == torch.device("cuda", 0)
    assert resolve_torch_device("auto") == torch.device("cuda", 0)
    assert resolve_torch_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"cuda:7: GPU 7 does not exist, this machine has 1 GPU "):
        resolve_torch_device("cuda:7")


def test_under_torchrun_each_rank_takes_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_torch_device("auto") == torch.device("cuda", 2)
    assert resolve_torch_device("cuda") == torch.device("cuda", 2)
    assert resolve_torch_device("cuda:1") == torch.device("cuda", 1)  # explicit: as given
    assert resolve_torch_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ValueError, match=r"\(LOCAL_RANK=5\): GPU 5 does not exist"):
        resolve_torch_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        resolve_torch_device("auto")


def test_collectives_use_the_cpu_without_a_group_and_under_gloo(tmp_path) -> None:
    import torch.distributed as d

    from fp8lab.distributed.runtime import agree_any

    assert collective_device() == torch.device("cpu")
    store = d.FileStore(str(tmp_path / "store"), 1)
    d.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert collective_device() == torch.device("cpu")
        assert agree_any(True) and not agree_any(False)
    finally:
        d.destroy_process_group()
