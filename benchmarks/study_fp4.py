"""FP4 ablation study (issue 33): what each technique of NVIDIA's NVFP4 recipe (arXiv 2509.25149)
does to the final validation loss of a small GPT, and how MXFP4, Quartet and 4over6 compare.

One command: ``python benchmarks/study_fp4.py [--seeds 3] [--steps 300] [--jobs 2] [--threads 1]
[--out runs/study-fp4] [--figure docs/figures/study_fp4.png]``. The lab's GPT at the issue's
size (6 layers, d_model 128, d_ff 384, block 128, 8 sequences per step, the built-in corpus),
300 steps, every recipe under the same seed sees the same initial weights and batches. Per seed
``S`` (train.seed 1337 + S) one `fp8lab.lab.compare.run_comparison` against ``bf16`` of:

- ``nvfp4-bare`` (no technique), then each technique alone on top of it: ``+hp-last``
  (``hp_last_blocks = "auto"``: the last block of 6 in bf16), ``+rht`` (``rht_gemms = "wgrad"``),
  ``+2d-weights`` (16x16 weight tiles), ``+sr`` (stochastic rounding of grad_output);
- all four: ``nvfp4-paper``;
- ``mxfp4``, ``mxfp4-quartet``, ``nvfp4-4over6``.

The first seed's comparison also trains bf16 under two more seeds (``noise_seeds = 2``, the
``compare --noise-seeds`` band): the spread of a bf16 final validation loss across seeds, the
yardstick for every gap. Each gap is ``(final val loss - bf16's) / bf16's`` in percent, per
seed; the table gives its mean and the min..max over seeds. Runs are cached in OUT (a rerun
resumes or reads them back). Prints a Markdown table, writes OUT/study_fp4.json and the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fp8lab
from fp8lab import Recipe

BASE = 1337
#: (label, how it is made from nvfp4-bare, or a preset name)
ABLATION: list[tuple[str, dict[str, Any] | str]] = [
    ("nvfp4-bare", "nvfp4-bare"),
    ("+hp-last", {"hp_last_blocks": None}),
    ("+rht", {"rht_gemms": "wgrad"}),
    ("+2d-weights", {"weight": {"format": "e2m1", "granularity": [16, 16], "scaling": "nvfp4"}}),
    ("+sr", {"grad_output": {"format": "e2m1", "granularity": "nvfp4", "scaling": "nvfp4",
                             "rounding": "stochastic"}}),
    ("nvfp4-paper", "nvfp4-paper"),
    ("mxfp4", "mxfp4"),
    ("mxfp4-quartet", "mxfp4-quartet"),
    ("nvfp4-4over6", "nvfp4-4over6"),
]  # fmt: skip


def _recipes(out: Path) -> dict[str, str]:
    """label -> a preset name or the path of the recipe file written for it (nvfp4-bare + one
    technique)."""
    out.mkdir(parents=True, exist_ok=True)
    got = {}
    for label, how in ABLATION:
        if isinstance(how, str):
            got[label] = how
            continue
        bare = fp8lab.get_recipe("nvfp4-bare").to_dict()
        rec = Recipe.from_dict({**bare, **how, "name": f"nvfp4-bare{label}",
                                "description": f"nvfp4-bare with {label[1:]} only"})  # fmt: skip
        path = out / f"nvfp4-bare{label.replace('+', '-')}.toml"
        if not path.exists() or Recipe.load(path) != rec:
            rec.save(path)
        got[label] = str(path)
    return got


def _config(seed: int, steps: int) -> Any:
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import LabConfig, TrainConfig

    return LabConfig(
        model=GPTConfig(n_layer=6, d_model=128, d_ff=384),
        train=TrainConfig(steps=steps, seed=BASE + seed, stats_every=0, eval_every=50,
                          checkpoint_every=100),
    )  # fmt: skip


def _final(records: list[dict]) -> float | None:
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return vals[-1] if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="No --torch-device: the study is sized for a 2-core CPU and its table is "
        "measured there; fp8lab compare --torch-device runs its recipes on a GPU.",
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads per job (default 1: two jobs on two cores; 0 = torch's "
        "default, which oversubscribes the cores and stalls on OpenMP waits)",
    )
    ap.add_argument("--out", default="runs/study-fp4")
    ap.add_argument("--figure", default=None, help="default: OUT/study_fp4.png")
    ap.add_argument("--only", default=None, help="comma-separated labels (timing runs)")
    a = ap.parse_args(argv)
    from fp8lab.lab.compare import run_comparison

    out = Path(a.out)
    files = _recipes(out / "recipes")
    labels = [lab for lab, _ in ABLATION if a.only is None or lab in a.only.split(",")]
    t0 = time.time()
    final: dict[str, list[float | None]] = {lab: [] for lab in ["bf16", *labels]}
    noise: list[float] = []
    for s in range(a.seeds):
        res = run_comparison(_config(s, a.steps), [files[lab] for lab in labels], "bf16",
                             out / f"seed{s}", jobs=a.jobs, threads=a.threads, noise_seeds=2 if s == 0 else 0)  # fmt: skip
        final["bf16"].append(_final(res.metrics["bf16"]))
        for lab in labels:
            final[lab].append(_final(res.metrics[files[lab]]))
        if s == 0:  # the noise replicas: bf16 under seeds BASE + 1, BASE + 2
            from fp8lab.lab.compare_runs import run_dir
            from fp8lab.lab.loop import read_metrics
            from fp8lab.lab.recipes import seed_replica

            for k in (1, 2):
                rd = run_dir(out / "seed0", seed_replica("bf16", BASE + k))
                noise.append(_final(read_metrics(rd)))
    elapsed = time.time() - t0
    result = _report(final, noise, elapsed, a)
    (out / "study_fp4.json").write_text(json.dumps(result, indent=2) + "\n")
    _figure(result, Path(a.figure) if a.figure else out / "study_fp4.png")
    return 0


def _gap(x: float | None, ref: float | None) -> float | None:
    return None if x is None or ref is None else 100.0 * (x - ref) / ref


def _report(final: dict, noise: list, elapsed: float, a: Any) -> dict[str, Any]:
    ref = final["bf16"]
    band = [_gap(v, ref[0]) for v in noise]
    rows = {}
    print(f"| recipe | final val loss (mean) | gap to bf16, % (mean) | min..max over {a.seeds} "
          "seeds |")  # fmt: skip
    print("|---|---|---|---|")
    for lab, vals in final.items():
        gaps = [_gap(v, r) for v, r in zip(vals, ref, strict=True)]
        ok = [g for g in gaps if g is not None]
        mean_loss = statistics.fmean([v for v in vals if v is not None]) if any(vals) else None
        rows[lab] = {"final_val_loss": vals, "gap_pct": gaps}
        if lab == "bf16":
            print(f"| bf16 | {mean_loss:.4f} | 0 (reference) | |")
            continue
        g = f"{statistics.fmean(ok):+.2f}" if ok else "diverged"
        mm = f"{min(ok):+.2f}..{max(ok):+.2f}" if ok else ""
        print(f"| {lab} | {mean_loss:.4f} | {g} | {mm} |")
    ok = [b for b in band if b is not None]
    if ok:
        print(f"\nbf16 noise band (seed {BASE} vs seeds {BASE + 1}, {BASE + 2}, same batches "
              f"per seed): {min(ok):+.2f}..{max(ok):+.2f} %")  # fmt: skip
    print(f"\n{sum(len(v) for v in final.values()) + len(noise)} runs in {elapsed / 60:.1f} min")
    return {"rows": rows, "noise_band_pct": band, "minutes": elapsed / 60, "steps": a.steps,
            "seeds": a.seeds, "jobs": a.jobs}  # fmt: skip


def _figure(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in result["rows"].items() if k != "bf16"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, r in enumerate(rows.values()):
        gaps = [g for g in r["gap_pct"] if g is not None]
        ax.scatter([i] * len(gaps), gaps, color="C0", s=14)
        if gaps:
            ax.plot([i - 0.25, i + 0.25], [statistics.fmean(gaps)] * 2, color="C0")
    band = [b for b in result["noise_band_pct"] if b is not None]
    if band:
        lo, hi = min(0.0, *band), max(0.0, *band)
        ax.axhspan(lo, hi, color="grey", alpha=0.3, label="bf16 seed noise")
        ax.legend(loc="upper left")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), list(rows), rotation=30, ha="right")
    ax.set_ylabel("final val loss gap to bf16 (%)")
    n = result["seeds"]
    ax.set_title(f"FP4 ablation: 6-layer GPT, d_model 128, {result['steps']} steps, {n} seed(s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
