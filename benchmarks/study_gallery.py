"""The gallery study: published FP8/FP4 failures, reproduced at small size, and the debugger's
verdict on each (README table; docs/debug.md, "The gallery").

One command: ``python benchmarks/study_gallery.py [--scenarios a,b] [--seeds 3] [--size small|
default] [--steps N] [--jobs 2] [--threads 1] [--out runs/gallery]``. Per scenario
(`fp8lab.lab.debug.scenarios.GALLERY`) and seed (``train.seed`` = 1337, 1338, ...: ``--first-seed``):

1. ``fp8lab debug --scenario NAME`` (in this process: `fp8lab.lab.debug.run_debug`) into
   OUT/NAME/seed-S: R's gap to bf16, the noise (fp32 against bf16), the verdict;
2. the paper's fix (the scenario's ``expect["fixed"]``: another recipe, or model options) trained
   once more from the same weights and batches: the share of R's gap it removes;
3. the verdict scored by `fp8lab.lab.debug.scenarios.check_verdict` against ``expect`` (layers
   computed from R's own records where the failure is emergent).

The onset is the first evaluation step where R's validation loss exceeds the baseline's by more
than twice the noise. A scenario *reproduces* on a seed when R's gap exceeds 3x the noise
(`fp8lab.lab.noise.ATTRIBUTE`) and the fix removes >= 70 % of it. Prints the machine (lscpu
model), the command and the date, then a Markdown table; writes OUT/gallery.json. Finished
debug runs are reused (the debugger resumes its probes).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

#: what each paper measured (the README table's second column)
CLAIMS = {
    "swiglu-outliers": "Llama2-7B, FP8 delayed scaling: diverges after ~200B tokens as SwiGLU "
    "channels align; Smooth-SwiGLU trains on par with BF16 (arXiv 2409.12517)",
    "mx-layernorm-affine": "small proxy LMs: MX-quantized LayerNorm affine parameters give loss "
    "spikes; those parameters in high precision remove them (arXiv 2506.20752)",
    "stale-after-warmup": "TE DelayedScaling defaults (history 1024, max): a falling amax keeps "
    "an old scale (TE documentation)",
    "attention-logit-growth": "attention logits grow by orders of magnitude before divergence "
    "at high learning rates; QK-norm prevents it (arXiv 2309.14322)",
    "nvfp4-all-layers": "ablation: NVFP4 on every linear layer trains worse; a few last blocks "
    "in BF16 keep it on track (arXiv 2509.25149)",
    "fp16-loss-scale": "FP16 gradients must be scaled above 2^-24 (they flush) and below "
    "65504 (they overflow, steps are skipped); loss scaling restores FP32 accuracy "
    "(arXiv 1710.03740)",
}
SMALL = ["model.block_size=16", "model.n_layer=2", "model.n_head=2", "model.d_model=48",
         "model.d_ff=96", "train.batch_size=8", "train.warmup_steps=5", "train.eval_every=25",
         "train.eval_batches=2"]  # fmt: skip


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))  # fmt: skip
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _final(run_dir: Path) -> float | None:
    try:
        s = json.loads((run_dir / "run.json").read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return None
    return None if s.get("diverged") else s.get("final_val_loss")


def _val(run_dir: Path) -> dict[int, float]:
    from fp8lab.lab.train import read_metrics

    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir)
            if r.get("val_loss") is not None}  # fmt: skip


def onset(out: Path, noise: float | None) -> int | None:
    """The first evaluation step where R is worse than the baseline by > 2x the noise (%)."""
    r, b = _val(out / "probes" / "recipe"), _val(out / "probes" / "baseline")
    tol = 2 * (noise or 0.0)
    for step in sorted(set(r) & set(b)):
        if 100.0 * (r[step] - b[step]) / b[step] > tol:
            return step
    return None


def run_fixed(
    expect: dict[str, Any], recipe: Any, cfg: Any, out: Path
) -> tuple[float | None, Path | None]:
    """Final validation loss of the scenario's published fix (another recipe, or model
    options on R's recipe), trained from the same weights and batches without operand records,
    and the run directory of its own baseline: a fix that changes the model (QK-norm) is
    measured against the baseline recipe on that model (None: R's baseline serves)."""
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.lab.train import train_run

    fixed = expect.get("fixed") or {}
    rec = resolve_recipe(fixed["recipe"]) if "recipe" in fixed else recipe
    cfg = cfg.replace_train(stats_every=0)
    own_base = None
    if "model" in fixed:
        cfg = replace(cfg, model=replace(cfg.model, **fixed["model"]))
        own_base = out / "fixed-baseline"
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    for r, run_dir in ((rec, out / "fixed"), (resolve_recipe("bf16"), own_base)):
        if run_dir is not None and _final(run_dir) is None:
            train_run(r, cfg, corpus, run_dir)
    return _final(out / "fixed"), own_base


def one(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from fp8lab.lab.debug import run_debug
    from fp8lab.lab.debug.scenarios import (
        check_verdict,
        plant,
        resolve_expect,
        scenario_config,
    )
    from fp8lab.lab.train import LabConfig

    # as `fp8lab debug --scenario NAME --set ...` builds it: the scenario's training settings,
    # then the size and seed on top (so a CLI run with these sets is reused)
    sets = [*(SMALL if args.size == "small" else []), f"train.seed={seed}"]
    cfg = scenario_config(LabConfig(), name).with_overrides(sets)
    if args.steps:
        cfg = cfg.replace_train(steps=args.steps)
    recipe, cfg, expect = plant(name, cfg)
    out = Path(args.out) / name / f"seed-{seed}"
    t0 = time.perf_counter()
    res = run_debug(recipe, cfg, out, jobs=args.jobs, threads=args.threads, scenario=name)
    wall = time.perf_counter() - t0
    data = json.loads((out / "debug_result.json").read_text())
    plain = resolve_expect(expect, out / "probes" / "recipe")
    t1 = time.perf_counter()
    fixed, own_base = run_fixed(expect, recipe, cfg, out)
    wall_fixed = time.perf_counter() - t1
    base = _final(own_base or out / "probes" / "baseline")
    fixed_gap = None if fixed is None or base is None else 100.0 * (fixed - base) / base
    gap = res.gap_pct
    removed = None if gap in (None, 0) or fixed_gap is None else 1.0 - fixed_gap / gap
    from fp8lab.lab import noise as noise_rule

    noise = res.noise_pct or 0.0
    shows = gap is not None and gap > noise_rule.ATTRIBUTE * noise
    return {"scenario": name, "seed": seed, "gap_pct": gap, "noise_pct": res.noise_pct,
            "onset_step": onset(out, res.noise_pct), "fixed_gap_pct": fixed_gap,
            "removed": removed, "reproduces": bool(shows and removed is not None
                                                   and removed >= 0.7),
            "culprit": res.culprit, "best_remedy": data["details"].get("best_remedy"),
            "expect": plain, "verdict": check_verdict(plain, data),
            "wall_s": wall, "wall_fixed_s": wall_fixed}  # fmt: skip


def _f(v: Any, fmt: str = "+.2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | paper measured | reproduced (gap %, noise %, onset step; fix removes) "
             "| debugger verdict (right / seeds) | wall time |", "|---|---|---|---|---|"]  # fmt: skip
    for name in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == name]
        rep = "; ".join(f"s{r['seed']}: {_f(r['gap_pct'])} ({_f(r['noise_pct'], '.3f')}, "
                        f"step {r['onset_step']}; {_f(r['removed'], '.0%')})" for r in rs)  # fmt: skip
        right = sum(r["verdict"]["right"] for r in rs)
        verdicts = "; ".join(
            f"s{r['seed']}: " + ("right" if r["verdict"]["right"]
                                 else "wrong: " + ", ".join(r["verdict"]["why"])) for r in rs)  # fmt: skip
        wall = sum(r["wall_s"] + r["wall_fixed_s"] for r in rs) / 60
        lines.append(f"| {name} | {CLAIMS.get(name, '')} | {rep} | {right}/{len(rs)}: "
                     f"{verdicts} | {wall:.0f} min |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    from fp8lab.lab.debug.scenarios import GALLERY

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="No --torch-device: the gallery is sized for a 2-core CPU and its table is "
        "measured there; fp8lab debug --torch-device runs a scenario on a GPU.",
    )
    p.add_argument("--scenarios", default=",".join(GALLERY))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--first-seed",
        type=int,
        default=1337,
        help="seeds first-seed, first-seed + 1, ... (1337: the lab's default)",
    )
    p.add_argument("--size", choices=("small", "default"), default="small")
    p.add_argument("--steps", type=int, default=0, help="override the scenario's steps")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/gallery")
    args = p.parse_args()
    print(f"machine: {machine()}; command: python {' '.join(sys.argv)}; "
          f"date: {time.strftime('%Y-%m-%d', time.gmtime())}")  # fmt: skip
    rows = []
    for name in args.scenarios.split(","):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            rows.append(one(name, seed, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "expect"},
                             default=str), flush=True)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gallery.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
