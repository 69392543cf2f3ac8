"""The cost model against Transformer Engine's published GEMM timings, as Markdown tables.

Prints the calibration (fitted on the fprop sums only), every residual (fitted and held out), the
quantization share of current scaling on H200, the recipe-ordering check, the Llama 3.1 405B
Blackwell external check, the B200-only calibration's check on TE's B300 speedups and the NVFP4
Llama 3 8B outside check; ``--write`` rewrites ``src/fp8lab/cost/data/calibration.toml`` from the
fit. Also times one ``fp8lab cost`` run in a fresh process.

    .venv/bin/python benchmarks/bench_cost.py [--write]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from fp8lab.cost import calibration as C
from fp8lab.cost.devices import DATA


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="No --torch-device: the cost model computes no tensors (it is arithmetic on "
        "published timings and device specifications).",
    )
    ap.add_argument("--write", action="store_true", help="rewrite data/calibration.toml")
    args = ap.parse_args()
    cal = C.calibrate()
    text = C.calibration_toml(cal)
    if args.write:
        Path(DATA / "calibration.toml").write_text(text)
    print("## Calibration (fprop sums only)\n")
    for dev, c in cal.items():
        eff = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c["efficiency"].items()))
        print(
            f"- {dev}: GEMM efficiency {eff}; bandwidth efficiency {c['bandwidth_efficiency']:.3f}"
        )
    print("\n## Residuals\n")
    print("| device | recipe | quantity | published ms | predicted ms | residual | split |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in C.residuals(cal):
        split = "held out" if r.held_out else "fitted"
        print(
            f"| {r.device} | {r.recipe} | {r.quantity} | {r.published:.3f} | {r.predicted:.3f} "
            f"| {100 * r.error:+.1f} % | {split} |"
        )
    pub, pred = C.quantization_share(cal)
    print(f"\nQuantization share of te-current on H200: published {pub:.0%}, predicted {pred:.1%}")
    print("\n## Recipe ordering (pairs whose published speedups differ by > 5 %)\n")
    for p in C.ordering_check(cal):
        a, b = p["pair"]
        print(
            f"- {p['device']}: {a} {p['published'][0]:.2f}x vs {b} {p['published'][1]:.2f}x "
            f"published; predicted {p['predicted'][0]:.2f}x vs {p['predicted'][1]:.2f}x: "
            + ("agree" if p["agree"] else "DISAGREE")
        )
    print("\n## Second split: H200 NVL calibration applied to B300 (cross-architecture)\n")
    for r in C.cross_architecture_check(cal):
        print(
            f"- {r.recipe} {r.quantity}: published {r.published:.3f}, predicted "
            f"{r.predicted:.3f} ({100 * r.error:+.1f} %)"
        )
    ext = C.external_check(cal)
    print("\n## External check: Llama 3.1 405B on Blackwell\n")
    print(f"source: {ext['source']}; status: {ext['status']}")
    for r in ext["reported"]:
        print(f"- {r}: reported {ext['reported'][r]:.2f}x, predicted {ext['predicted'][r]:.2f}x")
    print(f"order agrees: {ext['agree']}")
    print("\n## Blackwell from named B200 figures: TE's B300 layer speedups (held out)\n")
    ps = cal["b200"]["peak_scaling"]
    print(
        f"peak scaling: tensor-core efficiency {ps['tensor_core_efficiency']:.3f}, fixed share "
        f"{ps['fixed_tflops']:.0f} TFLOP/s ({', '.join(ps['classes'])})"
    )
    for r in C.b300_speedup_check(cal):
        print(
            f"- {r.recipe}: published {r.published:.2f}x, predicted {r.predicted:.2f}x "
            f"({100 * r.error:+.1f} %)"
        )
    blog = C.nvfp4_blog_check(cal)
    print("\n## Outside check: NVIDIA NVFP4 Llama 3 8B on GB200 (priced as b200)\n")
    print(f"source: {blog['source']}; status: {blog['status']}")
    print(
        f"- reported {blog['reported']:.2f}x; Linears only {blog['predicted_gemm_only']:.2f}x "
        f"(share outside: {blog['implied_non_gemm_share']:.0%}); with bf16 attention "
        f"{blog['predicted_with_attention']:.2f}x (share outside: {blog['implied_other_share']:.0%})"
    )
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fp8lab.cli", "cost", "--device", "b300", "--json"],
        check=True,
        capture_output=True,
    )
    print(f"\nfp8lab cost --device b300 --json: {time.perf_counter() - t0:.1f} s (fresh process)")


if __name__ == "__main__":
    main()
