"""Emulated GEMM speed (ratios against fp32 ``a @ b`` measured in the same run) and the DeepSeek-V3
accumulation-precision table.

    .venv/bin/python benchmarks/bench_gemm.py            # speed at 2048^3 + accuracy table
    .venv/bin/python benchmarks/bench_gemm.py --speed    # speed only
    .venv/bin/python benchmarks/bench_gemm.py --table    # accuracy table only

Speed targets (issue 3): per-tensor fp32-accumulation qmatmul incl. quantization <= 1.2x;
1x128 x 128x128 block-scaled <= 1.5x; limited group-sum accumulation <= 8x; per_product reported.
Times are the best of ``--repeat`` runs (the machine is shared; the best run is the least
disturbed one); every ratio divides by the fp32 matmul timed in the same way in the same process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fp8lab import Accumulator, QuantSpec, qmatmul, quantize


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up (numba compilation, allocator)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def speed(size: int, repeat: int, per_product: bool) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    tensor = QuantSpec("e4m3")
    act = QuantSpec("e4m3", (1, 128), "pow2_down")
    wgt = QuantSpec("e4m3", (128, 128), "pow2_down")
    lim = Accumulator("limited")
    lim_p = Accumulator("limited", promote_every=128)
    qa_t, qb_t = quantize(a, tensor), quantize(b, tensor)

    cases: list[tuple[str, Callable[[], object], str]] = [
        ("fp32 a @ b (baseline)", lambda: a @ b, ""),
        ("quantize per-tensor e4m3 (one operand)", lambda: quantize(a, tensor), ""),
        ("quantize 1x128 e4m3 (one operand)", lambda: quantize(a, act), ""),
        (
            "per-tensor, fp32 accum, incl. quantization",
            lambda: qmatmul(a, b, "fp32", spec=tensor, spec_b=tensor),
            "<= 1.2",
        ),
        (
            "1x128 x 128x128, fp32 accum, incl. quantization",
            lambda: qmatmul(a, b, "fp32", spec=act, spec_b=wgt),
            "<= 1.5",
        ),
        (
            "per-tensor, native torch._scaled_mm (pre-quantized)",
            lambda: qmatmul(qa_t, qb_t, native=True),
            "",
        ),
        (
            "per-tensor, limited 13 bits, no promotion, incl. quant.",
            lambda: qmatmul(a, b, lim, spec=tensor, spec_b=tensor),
            "<= 8",
        ),
        (
            "1x128 x 128x128, limited 13 bits, promote 128, incl. quant.",
            lambda: qmatmul(a, b, lim_p, spec=act, spec_b=wgt),
            "<= 8",
        ),
    ]
    if per_product:
        cases.append(
            (
                "per-tensor, limited per_product, promote 128 (pre-quantized)",
                lambda: qmatmul(
                    qa_t, qb_t, Accumulator("limited", promote_every=128, per_product=True)
                ),
                "(no target)",
            )
        )
    print(f"## qmatmul speed, M = N = K = {size}, torch threads = {torch.get_num_threads()}\n")
    print("| case | time (s) | ratio vs fp32 a @ b | target |")
    print("|---|---:|---:|---|")
    base = None
    for name, fn, target in cases:
        rep = 1 if "per_product" in name else repeat
        t = best_of(fn, rep)
        base = base or t
        print(f"| {name} | {t:.3f} | {t / base:.2f}x | {target} |", flush=True)
    print()


def accuracy(mn: int, ks: list[int]) -> None:
    print(
        f"## Limited-precision accumulation error (DeepSeek-V3 §3.3), M = N = {mn}, e4m3 "
        "per-tensor operands from standard-normal matrices\n"
    )
    print(
        "Errors of the emulated GEMM against float64 of the same quantized operands "
        "(accumulation error only): relative Frobenius error / largest elementwise relative "
        "error over outputs with |ref| above the median. `total` is the fp32-accumulation "
        "result against float64 of the unquantized matrices (the quantization error, for scale)."
    )
    print()
    models = [
        ("13 bits, no promotion", Accumulator("limited", mantissa_bits=13)),
        ("14 bits, no promotion", Accumulator("limited", mantissa_bits=14)),
        ("13 bits, promote 128", Accumulator("limited", mantissa_bits=13, promote_every=128)),
        ("14 bits, promote 128", Accumulator("limited", mantissa_bits=14, promote_every=128)),
        ("fp32", Accumulator("fp32")),
    ]
    print("| K | " + " | ".join(n for n, _ in models) + " | total (fp32 accum) |")
    print("|---:|" + "---|" * (len(models) + 1))
    for k in ks:
        g = torch.Generator().manual_seed(k)
        a = torch.randn(mn, k, generator=g)
        b = torch.randn(k, mn, generator=g)
        qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3")
        ref = qa.dequantize().double() @ qb.dequantize().double()
        big = ref.abs() > ref.abs().median()
        cells = []
        for _, acc in models:
            d = qmatmul(qa, qb, acc).double() - ref
            frob = (d.norm() / ref.norm()).item()
            mx = (d.abs() / ref.abs())[big].max().item()
            cells.append(f"{frob:.2e} / {mx:.2e}")
        true = a.double() @ b.double()
        d = qmatmul(qa, qb, "fp32").double() - true
        tb = true.abs() > true.abs().median()
        cells.append(
            f"{(d.norm() / true.norm()).item():.2e} / {(d.abs() / true.abs())[tb].max().item():.2e}"
        )
        print(f"| {k} | " + " | ".join(cells) + " |", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="speed section only")
    ap.add_argument("--table", action="store_true", help="accuracy table only")
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-per-product", action="store_true", help="skip the slow per_product run")
    ap.add_argument("--mn", type=int, default=128, help="M = N of the accuracy table")
    args = ap.parse_args()
    both = not (args.speed or args.table)
    if args.speed or both:
        speed(args.size, args.repeat, not args.no_per_product)
    if args.table or both:
        accuracy(args.mn, [512, 1024, 2048, 4096, 8192, 16384])


if __name__ == "__main__":
    main()
