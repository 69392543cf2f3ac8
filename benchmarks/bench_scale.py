"""Cost of a training step at the sizes users bring: an MLP stack under each recipe vs fp32.

One run: ``python benchmarks/bench_scale.py [--d-models 256,512,1024,2048]
[--recipes te-delayed,te-current,mxfp8,nvfp4,deepseek-v3,deepseek-v3-h100] [--tokens 1024]
[--threads 2] [--repeats 5] [--json OUT.json] [--figure OUT.png]``; ``--load A.json,B.json``
merges saved runs (e.g. the largest d_model measured on its own with fewer rounds) into one
table and figure without measuring.

The model (issue 36): two blocks ``Linear(d, 4d) -> GELU -> Linear(4d, d)``, every Linear
converted (`fp8lab.nn.convert` with ``default_exclude=False``), ``--tokens`` rows of input that
requires grad (the stack as an inner part of a model: dgrad runs for the first layer too). A step
is forward + backward (dx, dW, db of every layer), no optimizer. For each d_model every recipe
and fp32 (plain ``torch.nn.Linear``) start from the same weights; after one warm-up step each
(numba compilation, allocator, delayed-scaling step 0), ``--repeats`` rounds interleave all of
them, so that a change of the machine's load hits every recipe alike. The table gives the median
step time and its ratio to the median fp32 step of the same d_model in the same run.

The machine is recorded with the table (`fp8lab.lab.machine.machine_info`: CPU model, torch's CPU
capability, torch / numba versions and threads; whether ``lscpu`` lists AVX-512; the load average
before and after): ratios depend on the CPU (an AVX-512 fp32 GEMM is ~2-4x an AVX2 one's rate,
while the accumulator models' kernels gain less) and on other jobs sharing the cores.
``--json`` writes the table and the machine record; ``--figure`` draws ratio against d_model
(log-log) for every recipe. ``--profile RECIPE`` then runs ``--repeats`` steps of that recipe
at the largest d_model under cProfile and prints where the time goes (numba kernels appear as
their Python names).

Targets at d_model 1024, idle machine, 2 threads (issue 36): te-delayed and te-current <= 1.15x,
mxfp8 and nvfp4 <= 1.3x, deepseek-v3 <= 3x, deepseek-v3-h100 <= 8x.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from fp8lab.lab.machine import machine_info
from fp8lab.lab.pool import set_threads
from fp8lab.nn import convert

DEFAULT = "te-delayed,te-current,mxfp8,nvfp4,deepseek-v3,deepseek-v3-h100"
TARGETS = {  # at d_model 1024
    "te-delayed": 1.15,
    "te-current": 1.15,
    "mxfp8": 1.3,
    "nvfp4": 1.3,
    "deepseek-v3": 3.0,
    "deepseek-v3-h100": 8.0,
}
TARGET_D = 1024


def mlp(d: int) -> torch.nn.Sequential:
    """Two blocks Linear(d, 4d) -> GELU -> Linear(4d, d) (fp32, torch's default init)."""
    layers: list[torch.nn.Module] = []
    for _ in range(2):
        layers += [torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)]
    return torch.nn.Sequential(*layers)


def step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> float:
    """Seconds of one forward + backward."""
    xx = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(xx).backward(dy)
    return time.perf_counter() - t0


def avx512() -> bool | None:
    """Whether ``lscpu`` lists an avx512 flag (None when lscpu cannot run)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return "avx512" in out


def models_for(d: int, recipes: list[str]) -> dict[str, torch.nn.Module]:
    """fp32 and one converted copy per recipe, all from the same weights."""
    torch.manual_seed(0)
    base = mlp(d)
    out: dict[str, torch.nn.Module] = {"fp32": base}
    for r in recipes:
        out[r] = convert(copy.deepcopy(base), r, default_exclude=False)
    return out


def measure(d: int, recipes: list[str], tokens: int, repeats: int) -> dict[str, Any]:
    """Median step time of fp32 and each recipe at one d_model, interleaved rounds."""
    models = models_for(d, recipes)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d, generator=g)
    dy = torch.randn(tokens, d, generator=g)
    for m in models.values():  # warm-up
        step(m, x, dy)
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(repeats):
        for n, m in models.items():
            times[n].append(step(m, x, dy))
    ref = statistics.median(times["fp32"])
    rows = {}
    for n, ts in times.items():
        med = statistics.median(ts)
        rows[n] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "ratio": med / ref}
    return rows


def figure(result: dict[str, Any], path: Path) -> None:
    """Ratio to fp32 against d_model, one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted(int(d) for d in result["table"])
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    for r in result["recipes"]:
        pts = [(d, result["table"][str(d)][r]["ratio"]) for d in ds if r in result["table"][str(d)]]
        (line,) = ax.plot(*zip(*pts, strict=True), marker="o", label=r)
        if r in TARGETS:  # the target at d_model 1024
            ax.plot([TARGET_D], [TARGETS[r]], marker="_", ms=14, mew=2, color=line.get_color())
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ds, [str(d) for d in ds])
    ticks = [1, 1.15, 1.3, 2, 3, 4, 6, 8, 12, 16]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("d_model (MLP stack, 2 blocks d -> 4d -> d)")
    ax.set_ylabel("step time / fp32 step (bars: targets at 1024)")
    m = result["machine"]
    ax.set_title(
        f"{m['cpu']} ({'AVX-512' if result['avx512'] else 'no AVX-512'}), "
        f"{m['torch_threads']} threads, {result['tokens']} tokens, {result['date'][:10]}",
        fontsize=9,
    )
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


ACC_KERNELS = ("_acc_sums", "_acc_per_product", "_fused_fast", "_fused_general", "_acc_step")


def category(file: str, name: str) -> str | None:
    """Where a profiled function's own time belongs (None: torch or Python, not fp8lab)."""
    file = file.replace("\\", "/")
    if "retile" in name or file.endswith("/retile.py"):
        return "re-tiling"
    if "/fp8lab/gemm/" in file:
        return "accumulator kernel" if name.startswith(ACC_KERNELS) else "GEMM operand prep"
    if any(p in file for p in ("/fp8lab/qtensor/", "/fp8lab/scaling/", "/fp8lab/formats/")):
        return "quantize (amax, scale, cast)"
    if "/fp8lab/" in file:
        return "fp8lab Python (Linear, plan, epilogue)"
    return None


def breakdown(stats: Any) -> dict[str, float]:
    """Seconds per `category` from a ``pstats.Stats``: a built-in's (torch op's) own time goes
    to its callers' categories in proportion to the calls' times; ``torch.mm`` called from
    fp8lab is the "fp32 GEMM (torch.mm)" of the dequantized operands; the rest is torch's own
    work (autograd, GELU, bias gradients, the fp32 recipe's GEMMs) and Python."""
    out: dict[str, float] = {}
    for (file, _, name), (_, _, tt, _, callers) in stats.stats.items():
        if file != "~":
            cat = category(file, name) or "torch / Python outside fp8lab"
            out[cat] = out.get(cat, 0.0) + tt
            continue
        shares = [(category(cf, cn), c[2]) for (cf, _, cn), c in callers.items()]
        total = sum(t for _, t in shares) or 1.0
        for cat, t in shares or [(None, total)]:
            if cat is not None and "torch.mm" in name:
                cat = "fp32 GEMM (torch.mm)"
            cat = cat or "torch / Python outside fp8lab"
            out[cat] = out.get(cat, 0.0) + tt * t / total
    return out


def profile(d: int, recipe: str, tokens: int, repeats: int) -> dict[str, float]:
    """cProfile of ``repeats`` steps of ``recipe`` at ``d`` (after a warm-up step): prints the
    `breakdown` and the top functions; returns the breakdown in seconds per step."""
    import cProfile
    import pstats

    model = models_for(d, [recipe])[recipe]
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)
    step(model, x, dy)
    prof = cProfile.Profile()
    prof.enable()
    total = sum(step(model, x, dy) for _ in range(repeats))
    prof.disable()
    stats = pstats.Stats(prof)
    parts = {k: v / repeats for k, v in breakdown(stats).items()}
    print(f"\nprofile of {recipe} at d_model {d}, {repeats} steps, {total / repeats:.3f} s/step")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v:8.3f} s/step {100 * v * repeats / total:5.1f} %")
    stats.sort_stats("tottime").print_stats(12)
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="No --torch-device: it measures what the CPU path costs against fp32 on this CPU "
        "(the kernels fp8lab runs where no GPU is).",
    )
    ap.add_argument("--d-models", default="256,512,1024,2048", help="comma-separated")
    ap.add_argument("--recipes", default=DEFAULT, help="comma-separated presets or files")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    ap.add_argument("--json", metavar="PATH", help="write the table and machine here")
    ap.add_argument("--figure", metavar="PATH", help="PNG of ratio vs d_model")
    ap.add_argument("--profile", metavar="RECIPE", help="cProfile RECIPE at the largest d_model")
    ap.add_argument(
        "--load",
        metavar="A.json,B.json",
        help="measure nothing: merge these --json results (their d_models; machine and date of "
        "the first) and print, write and draw them",
    )
    args = ap.parse_args(argv)
    if args.load:
        result = merge([json.loads(Path(f).read_text()) for f in args.load.split(",") if f])
        report(result, args)
        return
    try:
        ds = [int(v) for v in args.d_models.split(",") if v]
    except ValueError:
        ap.error(f"--d-models: expected integers, got {args.d_models!r}")
    recipes = [r for r in args.recipes.split(",") if r and r != "fp32"]
    if not ds or min(ds) < 1 or args.tokens < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--d-models, --tokens, --repeats and --threads must be >= 1")

    set_threads(args.threads)
    load0 = os.getloadavg()
    t0 = dt.datetime.now(dt.UTC)
    result: dict[str, Any] = {
        "model": "2 x (Linear(d, 4d) -> GELU -> Linear(4d, d)), forward + backward",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "recipes": recipes,
        "date": t0.strftime("%Y-%m-%d %H:%M UTC"),
        "avx512": avx512(),
        "machine": machine_info(),
        "table": {},
    }
    for d in ds:
        result["table"][str(d)] = measure(d, recipes, args.tokens, args.repeats)
        result["seconds"] = round((dt.datetime.now(dt.UTC) - t0).total_seconds(), 1)
        result["load_average"] = {"before": list(load0), "after": list(os.getloadavg())}
        row = result["table"][str(d)]
        print(f"d_model {d}: " + ", ".join(f"{n} {v['ratio']:.2f}" for n, v in row.items()),
              flush=True)  # fmt: skip
        if args.json:  # a long run keeps what it measured so far
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    report(result, args)
    if args.profile:
        profile(max(ds), args.profile, args.tokens, args.repeats)


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs: the union of their d_models (a later run's row wins), the
    recipes in first-seen order; the machine and date of the first, every run's date and load
    average kept under ``runs``."""
    out = dict(results[0])
    out["table"], out["recipes"], out["runs"] = {}, [], []
    for r in results:
        out["table"].update(r["table"])
        out["recipes"] += [n for n in r["recipes"] if n not in out["recipes"]]
        out["runs"] += r.get("runs") or [
            {k: r[k] for k in ("date", "load_average", "repeats", "seconds") if k in r}
        ]
    return out


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table (Markdown), then write ``--json`` and draw ``--figure`` if asked."""
    m, recipes, table = result["machine"], result["recipes"], result["table"]
    runs = result.get("runs") or [result]
    loads = "; ".join(
        f"{r['date']} load average {r['load_average']['before'][0]:.1f} -> "
        f"{r['load_average']['after'][0]:.1f} ({r['repeats']} rounds)"
        for r in runs
    )
    print(
        f"MLP stack 2 x (d -> 4d -> d), {result['tokens']} tokens, forward + backward, "
        f"{m['torch_threads']} torch / {m['numba_threads']} numba threads, median of "
        f"interleaved rounds; {m['cpu']} (torch capability {m['cpu_capability']}, "
        f"AVX-512 {'yes' if result['avx512'] else 'no'}), torch {m['torch']}, numba {m['numba']}; "
        f"{loads}"
    )
    print("| d_model | fp32 ms | " + " | ".join(recipes) + " |")
    print("|---:|---:|" + "---:|" * len(recipes))
    for d in sorted(table, key=int):
        row = table[d]
        cells = " | ".join(f"{row[r]['ratio']:.2f}" if r in row else "—" for r in recipes)
        print(f"| {d} | {row['fp32']['median_s'] * 1e3:.1f} | {cells} |")
    target_row = table.get(str(TARGET_D), {})
    marks = [
        f"{r} <= {TARGETS[r]:g}: {'ok' if target_row[r]['ratio'] <= TARGETS[r] else 'MISS'}"
        for r in recipes
        if r in TARGETS and r in target_row
    ]
    if marks:
        print(f"targets at d_model {TARGET_D}: " + "; ".join(marks))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        figure(result, Path(args.figure))


if __name__ == "__main__":
    main()
