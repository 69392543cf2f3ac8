"""``--torch-device`` on the benchmarks (issue 24): each benchmark that computes tensors takes
the flag with the CLI's values (`benchmarks/_device.py`, one definition), resolves it before any
work, and exits 2 naming the problem for ``cuda`` on a machine without CUDA; the others say in
their --help why they have none.

"Accepts cpu" is checked in process without running the benchmark: the shared helper's resolver
is replaced by one that stops the benchmark with the resolved device right after parsing (a
full run takes minutes). Whether the tensors are created on the device is not checked here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
WITH_DEVICE = ("bench_cast", "bench_gemm", "bench_gemm_kernels", "bench_guard", "bench_linear",
               "bench_snr", "bench_train_step", "bench_watch", "guard_spike",
               "study_early_warning")  # fmt: skip
#: no --torch-device, with the reason in their --help; the kernel benchmarks are other parts'
WITHOUT = ("bench_cost", "bench_threads", "bench_dist", "bench_scale", "study_attention_mass",
           "study_fp4", "study_gallery", "study_optimizer_states")  # fmt: skip
OTHERS = ("ab_rev", "bench_kernels", "_device")  # bench_kernels: numba vs torch on the CPU
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


class Resolved(Exception):
    """Raised by the patched resolver: the benchmark parsed --torch-device and resolved it."""


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


def _main(mod, monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [f"{mod.__name__}.py", *args])
    mod.main()


def test_every_benchmark_is_listed() -> None:
    names = {p.stem for p in BENCH.glob("*.py")}
    assert names == {*WITH_DEVICE, *WITHOUT, *OTHERS}, "new benchmark: give it --torch-device"


@pytest.mark.parametrize("name", WITH_DEVICE)
def test_accepts_cpu_and_resolves_before_any_work(name, bench, monkeypatch) -> None:
    import _device

    real = _device.resolve_torch_device

    def stop(value):
        raise Resolved(real(value))

    monkeypatch.setattr(_device, "resolve_torch_device", stop)
    mod = bench(name)
    with pytest.raises(Resolved) as info:
        _main(mod, monkeypatch, "--torch-device", "cpu")
    assert info.value.args[0] == torch.device("cpu")


@NO_CUDA
@pytest.mark.parametrize("name", WITH_DEVICE)
def test_cuda_without_cuda_exits_2(name, bench, monkeypatch, capsys) -> None:
    mod = bench(name)
    with pytest.raises(SystemExit) as info:
        _main(mod, monkeypatch, "--torch-device", "cuda")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--torch-device cuda: CUDA is not available" in err and "Traceback" not in err


@pytest.mark.parametrize("name", WITHOUT)
def test_the_others_say_why_in_their_help(name, bench, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _main(bench(name), monkeypatch, "--help")
    assert info.value.code == 0
    assert "No --torch-device:" in " ".join(capsys.readouterr().out.split())


@NO_CUDA
def test_a_script_run_exits_2_with_the_message() -> None:
    """As a script (benchmarks/ on sys.path by Python itself): exit code 2, one line."""
    res = subprocess.run([sys.executable, str(BENCH / "bench_gemm.py"), "--torch-device", "cuda"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "bench_gemm.py: --torch-device cuda: CUDA is not available" in res.stderr
    assert "Traceback" not in res.stderr
