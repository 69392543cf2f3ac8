"""Quick start 1: compare FP8 recipes on a model (the library side of ``fp8lab compare``).

Trains the built-in GPT on the embedded Shakespeare text under a bf16 baseline and three FP8
recipes from the same weights on the same batches, then prints each recipe's final validation
loss and its gap to the baseline. ``--tiny``: one layer of width 32, a few steps (seconds).

    .venv/bin/python examples/quickstart_compare.py [--tiny] [--out runs/quickstart-compare]
"""

from __future__ import annotations

import argparse

from fp8lab.lab.compare import run_comparison
from fp8lab.lab.train import LabConfig

RECIPES = ["bf16", "te-delayed", "deepseek-v3", "mxfp8"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and a few steps")
    ap.add_argument("--out", default="runs/quickstart-compare")
    args = ap.parse_args(argv)
    config: dict = {"train": {"steps": 200}}
    if args.tiny:
        config = {
            "model": {"block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64},
            "train": {"steps": 3, "warmup_steps": 1, "eval_batches": 1, "stats_every": 0},
        }
    result = run_comparison(LabConfig.from_dict(config), RECIPES, "bf16", args.out, threads=1)
    print(f"{'recipe':<12} {'final val loss':>14} {'gap to bf16':>12}")
    for name, row in result.summary["recipes"].items():
        gap = row["rel_gap_pct"]
        gap_text = "-" if gap is None else f"{gap:+.2f} %"
        print(f"{name:<12} {row['final_val_loss']:>14.4f} {gap_text:>12}")
    return result.summary


if __name__ == "__main__":
    main()
