"""Wall time of the whole ``fp8lab snr --preset seed000`` study (budget: 60 s on 2 cores).

The preset draws every figure of the dot-product study of the blog article "从DeepSeek V3看FP8
训练的挑战" (its simfloat notebook).

One run: ``python benchmarks/bench_snr.py [--samples 200] [--repeats 3] [--figures]
[--tensor-core] [--torch-device auto]``. Prints the median time of the SNR engine over the preset's configurations (one
warm-up run first, so numba's cache load is excluded), the ratio to the 60 s budget, and the ratio
to a plain float64 ``np.dot`` baseline computing the same reference dot products in the same
process. ``--figures`` also times writing the 9 PNGs and the table. ``--tensor-core`` also times
the study through GEMM accumulator models (length 4096, E4M3, per-vector scaling: no promotion,
promotion every 128, block 128) beside the exact fp64 accumulator. ``--torch-device``: where the
engine's casts and GEMM models compute (as ``fp8lab snr --torch-device``); the np.dot baseline
stays on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np

from _device import add_torch_device, torch_device
from fp8lab.lab import snr

BUDGET_S = 60.0


def _baseline(configs: list[snr.SnrConfig]) -> float:
    """float64 np.dot over every (config, sample) of the preset: the reference alone."""
    vecs = {}
    for c in configs:
        key = (c.length, c.rho, c.correlation_model)
        if key not in vecs:
            vecs[key] = snr.generate_vectors(c)
    t0 = time.perf_counter()
    acc = 0.0
    for c in configs:
        a, b = vecs[(c.length, c.rho, c.correlation_model)]
        for i in range(c.samples):
            acc += float(np.dot(a[i], b[i]))
    dt = time.perf_counter() - t0
    assert np.isfinite(acc)
    return dt


def _tensor_core(samples: int, repeats: int) -> None:
    """Engine time per configuration for the GEMM accumulator models against fp64."""
    base = snr.SnrConfig(length=4096, samples=samples)
    print(f"tensor-core accumulators (length 4096, {samples} samples, median of {repeats}):")
    for acc in ("fp64", "limited", "h100", "b200"):
        for kw in ({}, {"promote_every": 128}, {"block": 128}):
            cfg = replace(base, accumulator=acc, **kw)
            snr.run(cfg)  # warm-up: numba cache load
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                snr.run(cfg)
                times.append(time.perf_counter() - t0)
            what = ", ".join(f"{k}={v}" for k, v in kw.items()) or "no promotion"
            print(f"  {acc:8s} {what:18s} {statistics.median(times):8.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--figures", action="store_true", help="also time the PNGs + table")
    ap.add_argument(
        "--tensor-core", action="store_true", help="also time the GEMM accumulator models"
    )
    add_torch_device(ap)
    args = ap.parse_args()
    device = torch_device(args, lab=True)  # the engine computes on the lab's device

    preset = snr.preset("seed000", samples=args.samples)
    configs = preset.configs()
    n_dots = sum(c.samples for c in configs)
    n_elems = sum(c.samples * c.length for c in configs)

    results = snr.run_many(configs)  # warm-up (numba cache load, imports)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = snr.run_many(configs)
        times.append(time.perf_counter() - t0)
    t_engine = statistics.median(times)
    t_dot = statistics.median(_baseline(configs) for _ in range(args.repeats))

    print(
        f"seed000 preset: {len(configs)} configurations, {n_dots} dot products, "
        f"{n_elems / 1e6:.1f} M products, on {device}"
    )
    print(
        f"  fp8lab snr engine      {t_engine:8.2f} s   ({t_engine / BUDGET_S:.3f} of the 60 s budget)"
    )
    print(f"  float64 np.dot         {t_dot:8.4f} s   (engine / np.dot = {t_engine / t_dot:,.0f}x)")
    if args.figures:
        from fp8lab.report.snr import write_preset_report

        res = dict(zip(configs, results, strict=True))
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            write_preset_report(preset, res, d)
            t_fig = time.perf_counter() - t0
        total = t_engine + t_fig
        print(f"  figures + table        {t_fig:8.2f} s")
        print(f"  total                  {total:8.2f} s   ({total / BUDGET_S:.3f} of the budget)")
    status = "OK" if t_engine <= BUDGET_S else "OVER BUDGET"
    print(f"  budget check: {status}")
    if args.tensor_core:
        _tensor_core(args.samples, args.repeats)


if __name__ == "__main__":
    main()
