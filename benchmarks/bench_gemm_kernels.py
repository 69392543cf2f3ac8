"""numba vs the device-generic torch kernels for the emulated GEMM accumulators (issue 24).

    .venv/bin/python benchmarks/bench_gemm_kernels.py                 # CPU, sizes 128 256 512
    .venv/bin/python benchmarks/bench_gemm_kernels.py --sizes 256 --repeat 5
    .venv/bin/python benchmarks/bench_gemm_kernels.py --torch-device cuda   # torch kernels on a GPU

For each accumulator and size (M = K = N) it times `qmatmul` on pre-quantized operands under
``numba`` and under ``torch`` (on ``--torch-device``, default auto; numba always on the CPU) and prints the times
and the ratio torch / numba, both measured in the same process, best of ``--repeat``. It also
checks that both gave the same bits. On a CUDA device the fused accumulator's FP8 fast domain
runs as one Triton kernel (`fp8lab.gemm.fused_triton`): there the ``torch`` column is the torch
kernel alone (``using_triton("0")``) and the ``triton`` column the default (Triton, probed), with
its ratio to the torch kernel and its own bit check; elsewhere the column says why it is empty. On the CPU numba stays the default (the torch kernels are
there for other devices and as the oracle's second implementation); the issue's GPU targets are
measured by ``scripts/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch

from _device import HELP, sync, torch_device
from fp8lab import Accumulator, QuantSpec, qmatmul, quantize
from fp8lab.gemm.fused import fast_path_applies
from fp8lab.gemm.fused_triton import triton_available, using_triton
from fp8lab.kernels import using_kernels

CASES = [
    ("h100 fused, per tensor", Accumulator("h100"), False),
    ("h100 fused, 1x128 x 128x128, promote 128", Accumulator("h100", promote_every=128), True),
    ("b200 fused (exact sums), per tensor", Accumulator("b200"), False),
    ("limited 13 bits, per tensor", Accumulator("limited"), False),
    ("limited, 1x128 x 128x128, promote 128", Accumulator("limited", promote_every=128), True),
]


def best_of(fn: Callable[[], torch.Tensor], repeat: int, device: torch.device) -> float:
    fn()  # warm-up (numba compilation, caching allocator)
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def triton_row(da, db, acc: Accumulator, repeat: int, device: torch.device, want, t_torch) -> str:
    """The Triton column of one row: its time, ratio to the torch kernel and bit check, or why
    there is none."""
    if device.type != "cuda":
        return "   (no CUDA)"
    if not triton_available():
        return "(no triton)"
    if not fast_path_applies(acc.resolve("e4m3", "e4m3"), "e4m3", "e4m3"):
        return "(not fast)"
    with using_kernels("torch"), using_triton("1"):
        t = best_of(lambda: qmatmul(da, db, acc), repeat, device)
        got = qmatmul(da, db, acc).cpu()
    same = torch.equal(got.view(torch.int32), want.view(torch.int32))
    return f"{t:9.4f} {t / t_torch:6.2f}x {'same' if same else 'DIFFER'}"


def run(sizes: list[int], repeat: int, device: torch.device) -> None:
    print(f"device for torch kernels: {device}; torch threads {torch.get_num_threads()}")
    if device.type != "cuda":
        print("triton: skipped (the Triton fused kernel runs on CUDA devices only)")
    print(f"{'case':44s} {'size':>5s} {'numba s':>9s} {'torch s':>9s} {'torch/numba':>11s} bits "
          f"{'triton s':>9s} {'/torch':>7s} bits")  # fmt: skip
    for size in sizes:
        g = torch.Generator().manual_seed(size)
        a = torch.randn(size, size, generator=g)
        b = torch.randn(size, size, generator=g)
        per_tensor = (quantize(a, QuantSpec("e4m3")), quantize(b, QuantSpec("e4m3")))
        blocks = (
            quantize(a, QuantSpec("e4m3", (1, 128), "pow2_down")),
            quantize(b, QuantSpec("e4m3", (128, 128), "pow2_down")),
        )
        for name, acc, blocked in CASES:
            qa, qb = blocks if blocked else per_tensor
            da, db = (
                dataclasses.replace(
                    q, values=q.values.to(device), scales=q.scales.to(device), _dense=[None]
                )
                for q in (qa, qb)
            )
            with using_kernels("numba"):
                t_numba = best_of(lambda qa=qa, qb=qb, acc=acc: qmatmul(qa, qb, acc), repeat,
                                  torch.device("cpu"))  # fmt: skip
                want = qmatmul(qa, qb, acc)
            with using_kernels("torch"), using_triton("0"):
                t_torch = best_of(lambda da=da, db=db, acc=acc: qmatmul(da, db, acc), repeat,
                                  device)  # fmt: skip
                got = qmatmul(da, db, acc).cpu()
            same = torch.equal(got.view(torch.int32), want.view(torch.int32))
            tri = triton_row(da, db, acc, repeat, device, want, t_torch)
            print(
                f"{name:44s} {size:5d} {t_numba:9.4f} {t_torch:9.4f} {t_torch / t_numba:11.1f} "
                f"{'same' if same else 'DIFFER'} {tri}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--repeat", type=int, default=3)
    # --device: this benchmark's first name of the flag (elsewhere --device is the cost model's GPU)
    p.add_argument("--torch-device", "--device", dest="torch_device", default="auto",
                   help=f"{HELP} (--device: deprecated alias)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.sizes, args.repeat, torch_device(args))


if __name__ == "__main__":
    main()
