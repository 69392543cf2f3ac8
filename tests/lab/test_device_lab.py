"""The lab on a torch device (issue 24): the run's device is recorded (run.json's machine), is
not part of a run's identity, and checkpoints hold CPU tensors loaded with map_location onto the
run's device; a model and a batch on different devices are one clear error, checked once.

CPU only here: a GPU run and the GPU -> CPU resume are tested where CUDA is available."""

from __future__ import annotations

import json

import pytest
import torch

from fp8lab import step as step_mod
from fp8lab.lab import checkpoint as ckpt
from fp8lab.lab.data import DataConfig, get_batch, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.machine import machine_info, torch_device, using_torch_device
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.recipe import get_recipe
from fp8lab.step import TrainStep

TINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(
        steps=4, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=2, eval_batches=1,
        stats_every=0, checkpoint_every=2,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("Now is the winter of our discontent made glorious summer. " * 80)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


def _losses(records):
    return [(r["step"], r["train_loss"], r.get("val_loss"), r["grad_norm"]) for r in records]


def test_machine_record_names_the_device() -> None:
    m = machine_info()
    assert m["torch_device"] == str(torch_device()) == "cpu"
    assert m["gpu"] is None and m["cuda"] is None
    assert m["kernels"] in ("auto", "numba", "torch")
    # the Triton mode in effect, not the environment variable: set_triton changes it
    from fp8lab.gemm.fused_triton import using_triton

    with using_triton("interpret"):
        assert machine_info()["triton"] == "interpret"
    assert machine_info()["triton"] == m["triton"] in ("1", "0", "interpret")


def test_resume_with_map_location_is_bit_identical(corpus, tmp_path) -> None:
    """cpu -> cpu through the device path: train_run(torch_device=...) saves CPU tensors and
    loads them with map_location onto the run's device."""
    recipe = get_recipe("te-delayed")
    whole = train_run(recipe, TINY, corpus, tmp_path / "whole", torch_device="cpu")
    train_run(recipe, TINY, corpus, tmp_path / "split", stop_after=2, torch_device="cpu")
    state = torch.load(tmp_path / "split" / ckpt.CHECKPOINT, weights_only=True)
    assert "cuda_rng" not in state  # written on the CPU
    resumed = train_run(recipe, TINY, corpus, tmp_path / "split", torch_device="auto")
    assert _losses(resumed.records) == _losses(whole.records)
    run = json.loads((tmp_path / "split" / "run.json").read_text())
    assert run["machine"]["torch_device"] == "cpu"
    assert "torch_device" not in json.dumps(run["lab"])  # not part of the run's identity
    assert torch_device() == torch.device("cpu")  # train_run restored the process's device


def test_to_cpu_keeps_structure_and_cpu_tensors() -> None:
    t = torch.ones(3)
    tree = {"a": [t, (t, 1)], "b": {"c": t}, "d": "x"}
    out = ckpt.to_cpu(tree)
    assert out["a"][0] is t and isinstance(out["a"][1], tuple) and out["d"] == "x"
    assert out["b"]["c"] is t


def test_model_and_batch_on_different_devices_is_one_clear_error(monkeypatch) -> None:
    lin = torch.nn.Linear(4, 1).to("meta")
    ts = TrainStep(lambda b: lin(b[0]).sum(), params=list(lin.parameters()))
    batch = (torch.ones(2, 4), torch.ones(2, 1))
    with pytest.raises(ValueError, match="the model is on meta but the batch is on cpu"):
        ts(0, batch)


def test_devices_are_checked_once_per_step_object(monkeypatch) -> None:
    calls = []
    real = step_mod.check_devices
    monkeypatch.setattr(step_mod, "check_devices", lambda *a: calls.append(1) or real(*a))
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    ts = TrainStep(lambda b: lin(b).square().mean(), opt)
    for i in range(3):
        ts(i, torch.ones(2, 4))
    assert calls == [1]


def test_a_cuda_device_without_cuda_is_refused(corpus) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        train_run(None, TINY, corpus, torch_device="cuda")
    with pytest.raises(ValueError, match="expected one of auto, cpu, cuda, cuda:N"):
        using_torch_device("gpu").__enter__()
    assert torch_device() == torch.device("cpu")


def test_batches_are_the_same_on_every_device(corpus) -> None:
    """Drawn on the CPU, then moved: the batch of a step does not depend on the device."""
    x, y = get_batch(corpus.train, 2, 16, 1337, 5)
    assert x.device == torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        with using_torch_device("cuda"):
            xg, yg = get_batch(corpus.train, 2, 16, 1337, 5)
        assert xg.is_cuda and torch.equal(xg.cpu(), x) and torch.equal(yg.cpu(), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_resumes_on_the_cpu_and_back(corpus, tmp_path) -> None:  # pragma: no cover
    recipe = get_recipe("te-delayed")
    out = tmp_path / "run"
    r = train_run(recipe, TINY, corpus, out, stop_after=2, torch_device="cuda")
    assert next(r.model.parameters()).is_cuda
    state = torch.load(out / ckpt.CHECKPOINT, weights_only=True)
    leaves = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    assert leaves and all(v.device.type == "cpu" for v in leaves)
    assert "cuda_rng" in state
    done = train_run(recipe, TINY, corpus, out, torch_device="cpu")
    assert done.summary["complete"] and not done.summary["diverged"]
    run = json.loads((out / "run.json").read_text())
    assert run["machine"]["torch_device"] == "cpu"


def test_a_cpu_model_under_nccl_is_refused(monkeypatch) -> None:
    """Under torchrun with NCCL (simulated: no process group is made) a CPU model fails before
    DDP wraps it, naming both sides."""
    import fp8lab.distributed.runtime as runtime
    from fp8lab.lab.parts import data_parallel

    monkeypatch.setattr(runtime, "world_size", lambda group=None: 2)
    monkeypatch.setattr(runtime, "collective_device", lambda group=None: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="the model is on cpu but the process group is NCCL"):
        data_parallel(torch.nn.Linear(2, 2), "world", "fp32")


def worker_setting(events) -> tuple[str, str, str]:
    """A pool job: the torch device, kernel choice and Triton mode its worker computes with."""
    from fp8lab.gemm.fused_triton import get_triton
    from fp8lab.kernels import get_kernels

    return str(torch_device()), get_kernels(), get_triton()


def test_spawned_workers_take_the_parents_device_and_kernels() -> None:
    from fp8lab.gemm.fused_triton import using_triton
    from fp8lab.kernels import using_kernels
    from fp8lab.lab.pool import Job, WorkerPool

    with using_kernels("torch"), using_triton("0"), WorkerPool(2, threads=1) as pool:
        got = pool.run([Job(f"j{i}", worker_setting) for i in range(2)])
    assert got == [("cpu", "torch", "0"), ("cpu", "torch", "0")]
