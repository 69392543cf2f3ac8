"""What a lab result depends on beyond its configuration: the machine that computed it.

fp8lab's own arithmetic (casts, scales, the emulated accumulators, the fused tensor-core model) is
bit-reproducible on any x86-64 CPU: numba compiles it without fast-math, so its float operations
are neither reassociated nor contracted, whatever vector width the CPU has. The GEMMs of a
training step are torch's (MKL / oneDNN on CPU): their summation order depends on the kernel
torch picks for the CPU (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512, ...;
``ATEN_CPU_CAPABILITY`` and ``MKL_ENABLE_INSTRUCTIONS`` lower it), on the torch and MKL versions
and on the thread count. A training run amplifies a last-bit difference step by step, so its
losses reproduce to the last digit only on the same CPU kind, versions and threads.

:func:`machine_info` records those; the lab stores it as ``machine`` in ``OUT/config.json``,
each run's ``run.json``, the ``--json`` summary and the report. It is never part of a run's
identity: a run started on one machine resumes on another (its later steps then follow the new
machine's rounding).

The torch device the lab computes on (``--torch-device``) is a setting of the process, like the
kernel choice (`fp8lab.kernels`): `set_torch_device` (scoped: `using_torch_device`) resolves it
(`fp8lab.distributed.runtime.resolve_torch_device`) and `torch_device` reads it (default: the CPU). The
lab builds its models, batches and optimizer state there and loads checkpoints onto it; the
machine record names it (``torch_device``, ``gpu``, ``cuda``, ``kernels``). Not part of a run's
identity either: a checkpoint written on the GPU resumes on the CPU and the other way round.

On a CUDA device a lab run (`fp8lab.lab.train.train_run`, `fp8lab.lab.replay.replay_step`) runs
under `deterministic_kernels`: ``torch.use_deterministic_algorithms(True)`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, both restored afterwards, because a run that resumes from a
checkpoint is bit-identical to the uninterrupted one only when every kernel gives the same bits
for the same inputs (cuBLAS with its default workspace, and torch's atomic-add kernels, do not
promise that). ``FP8LAB_DETERMINISTIC=0`` turns it off (for a model with an op that has no
deterministic CUDA kernel: torch then raises naming it); the machine record says which
(``deterministic``). CPU runs are left as they are: torch's CPU kernels the lab uses are
deterministic at a fixed thread count already.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fp8lab.distributed.runtime import resolve_torch_device
from fp8lab.gemm.fused_triton import get_triton
from fp8lab.kernels import get_kernels

#: environment variables that change the kernels torch or numba run, recorded when set
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "NUMBA_CPU_NAME",
              "NUMBA_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "FP8LAB_KERNELS", "FP8LAB_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG",
              "FP8LAB_TRITON")  # fmt: skip

#: the opt-out of `deterministic_kernels` on CUDA: ``FP8LAB_DETERMINISTIC=0``
DETERMINISTIC_ENV = "FP8LAB_DETERMINISTIC"
#: the cuBLAS workspace settings NVIDIA documents as reproducible (cuBLAS guide, "Results
#: reproducibility"); torch raises in deterministic mode unless one of them is set
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _library_versions() -> dict[str, str | None]:
    """MKL's and oneDNN's versions as torch reports them in ``torch.__config__.show()``."""
    text = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([0-9][0-9.]*)", text)
    onednn = re.search(r"MKL-DNN v([^\s]+)", text)
    return {"mkl": mkl and mkl.group(1), "onednn": onednn and onednn.group(1)}


_DEVICE = torch.device("cpu")


def torch_device() -> torch.device:
    """The torch device the lab computes on in this process (default: the CPU)."""
    return _DEVICE


def set_torch_device(value: str | torch.device | None) -> torch.device:
    """Compute the lab's models and batches on ``value`` (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``: `fp8lab.distributed.runtime.resolve_torch_device`) from now on; a CUDA device also
    becomes torch's current device. Returns the previous device.

    Raises:
        ValueError: an unknown value, CUDA not available, a GPU index that does not exist.
    """
    global _DEVICE
    new = resolve_torch_device(value)
    if new.type == "cuda":
        torch.cuda.set_device(new)
    old, _DEVICE = _DEVICE, new
    return old


@contextmanager
def using_torch_device(value: str | torch.device | None) -> Iterator[torch.device]:
    """Run a block on ``value`` (`set_torch_device`), then restore the previous device."""
    old = set_torch_device(value)
    try:
        yield torch_device()
    finally:
        set_torch_device(old)


def deterministic_for(device: torch.device | str) -> bool:
    """Whether a lab run on ``device`` runs under `deterministic_kernels`' settings: True on a
    CUDA device unless ``FP8LAB_DETERMINISTIC=0``; False on the CPU (left as it is). True too
    when the caller already enabled ``torch.use_deterministic_algorithms``.

    Raises:
        ValueError: ``FP8LAB_DETERMINISTIC`` is neither 0 nor 1.
    """
    value = os.environ.get(DETERMINISTIC_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{DETERMINISTIC_ENV}={value!r}: expected 0 or 1")
    on_cuda = torch.device(device).type == "cuda" and value == "1"
    return on_cuda or torch.are_deterministic_algorithms_enabled()


@contextmanager
def deterministic_kernels(device: torch.device | str) -> Iterator[bool]:
    """Run a block with deterministic kernels when `deterministic_for` ``device`` says so:
    ``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (a
    value of the reproducible settings the caller set is kept), restored on exit, also after an
    exception. Yields whether they apply. On the CPU (and with ``FP8LAB_DETERMINISTIC=0``)
    nothing changes.

    cuBLAS reads the workspace setting when torch first allocates a handle's workspace: in a
    process that made cuBLAS calls before, the earlier workspace size stays, which is still
    reproducible for the lab's single stream. torch checks the variable at every cuBLAS call
    in deterministic mode, so it must stay set for the whole block.
    """
    on = deterministic_for(device)
    if not on or torch.device(device).type != "cuda":
        yield on
        return
    old_mode = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    old_cfg = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if old_cfg not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    try:
        yield True
    finally:
        torch.use_deterministic_algorithms(old_mode, warn_only=old_warn)
        if old_cfg is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = old_cfg


def device_info(device: torch.device | None = None) -> dict[str, Any]:
    """The torch device of the lab (``device``, default `torch_device`) as plain data:
    ``torch_device`` (``"cpu"``, ``"cuda:0"``), ``gpu`` (its name; None on the CPU), ``cuda``
    (the CUDA version torch was built with; None on the CPU), ``kernels`` (the kernel
    choice, `fp8lab.kernels.get_kernels`), ``triton`` (the fused accumulator's Triton mode in
    effect, `fp8lab.gemm.get_triton`: ``FP8LAB_TRITON`` as read once, or `set_triton`'s) and
    ``deterministic`` (whether the lab's runs there use deterministic kernels:
    `deterministic_for`)."""
    dev = torch_device() if device is None else torch.device(device)
    cuda = dev.type == "cuda"
    return {
        "torch_device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "kernels": get_kernels(),
        "triton": get_triton(),
        "deterministic": deterministic_for(dev),
    }


def machine_info() -> dict[str, Any]:
    """The machine this process computes on: CPU model and architecture, the CPU capability
    torch's kernels use, the torch / MKL / oneDNN / numba versions, torch's and numba's thread
    counts (as set now: call it where the run computes), the kernel-selecting environment
    variables that are set and the torch device (`device_info`). Plain JSON data."""
    import numba

    try:
        import llvmlite.binding as llvm

        numba_cpu = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    except Exception:  # an llvmlite without the call: the name is only informative
        numba_cpu = os.environ.get("NUMBA_CPU_NAME")
    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        **_library_versions(),
        "numba": numba.__version__,
        "numba_cpu": numba_cpu,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "python": platform.python_version(),
        "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        **device_info(),
    }


#: the fields of :func:`machine_info` that decide the bits of a training run's losses
RESULT_FIELDS = ("cpu_capability", "torch", "mkl", "onednn", "torch_threads", "gpu", "cuda")


def same_results_expected(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two machines should give the same losses to the last digit: the same CPU model
    and the same :data:`RESULT_FIELDS` (False when either is unknown)."""
    if not a or not b:
        return False
    return a.get("cpu") == b.get("cpu") and all(a.get(k) == b.get(k) for k in RESULT_FIELDS)


def describe(m: dict[str, Any] | None) -> str:
    """One line: ``AMD EPYC, torch 2.13.0+cpu (AVX512), MKL 2024.2, oneDNN 3.12.0, 1 thread``."""
    if not m:
        return "unknown (written before fp8lab recorded the machine)"
    threads = m.get("torch_threads")
    return (
        f"{m.get('cpu')}, torch {m.get('torch')} (CPU capability {m.get('cpu_capability')}), "
        f"MKL {m.get('mkl')}, oneDNN {m.get('onednn')}, {threads} torch "
        f"thread{'s' * (threads != 1)}"
        + (f", on {m['torch_device']} {m['gpu']} (CUDA {m['cuda']})" if m.get("gpu") else "")
        + (f", env {m['env']}" if m.get("env") else "")
    )
