"""Cost of one training step of the lab's default GPT under each recipe, relative to fp32.

One run: ``python benchmarks/bench_train_step.py [--steps 6] [--rounds 3] [--threads 1]
[--recipes fp32,bf16,...] [--torch-device auto]``. Each round trains every recipe for ``--steps`` steps from the same
initial weights (``fp8lab.lab.train.train_run``, no evaluation inside the timed part) and keeps
the median of its per-step times after the first step; rounds interleave the recipes so that a
change of machine load hits them all alike, and the table shows the minimum over rounds and the
ratio to the fp32 recipe of the same run. A step = forward + backward + gradient clipping +
AdamW, the same code and timer as ``fp8lab compare``'s "step time / fp32" column.
Target (issue 6): the bf16 baseline step costs <= 1.2x the fp32 step. ``deepseek-v3-h100``
(deepseek-v3 with the bit-exact H100 tensor-core accumulator) has no target: its ratio decides
whether ``deepseek-v3`` itself could use the exact model (it could at <= 3x the fp32 step).
"""

from __future__ import annotations

import argparse
import statistics

from _device import add_torch_device
from _device import torch_device as parse_torch_device
from fp8lab.lab.data import load_corpus
from fp8lab.lab.machine import torch_device
from fp8lab.lab.pool import set_threads
from fp8lab.lab.recipes import resolve_recipe
from fp8lab.lab.train import LabConfig, train_run

TARGETS = {"bf16": 1.2}
DEFAULT = "fp32,bf16,te-current,te-delayed,deepseek-v3,deepseek-v3-h100,mxfp8,hif8-delayed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per recipe and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch and numba threads")
    ap.add_argument("--recipes", default=DEFAULT, help="comma-separated; fp32 is always added")
    add_torch_device(ap)
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step of a run is not timed)")
    parse_torch_device(args, lab=True)  # the lab's models and batches live there

    set_threads(args.threads)
    names = ["fp32", *[n for n in args.recipes.split(",") if n and n != "fp32"]]
    cfg = LabConfig().replace_train(
        steps=args.steps, eval_every=10**9, eval_batches=1, stats_every=0
    )
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    recipes = {n: resolve_recipe(n) for n in names}
    for n in names:  # warm-up: numba compilation, allocator
        train_run(recipes[n], cfg.replace_train(steps=2), corpus)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for n in names:
            records = train_run(recipes[n], cfg, corpus).records
            t = statistics.median(r["step_time_s"] for r in records[1:])
            best[n] = min(best.get(n, t), t)

    m = cfg.model
    print(
        f"training step, GPT {m.n_layer} layers d_model {m.d_model} d_ff {m.d_ff}, "
        f"{cfg.train.batch_size} x {m.block_size} tokens, on {torch_device()}, "
        f"{args.threads} thread(s), "
        f"min over {args.rounds} interleaved rounds of the median of {args.steps - 1} steps"
    )
    print(f"{'recipe':18s} {'ms/step':>9s} {'tokens/s':>9s} {'/ fp32':>7s} {'target':>9s}")
    ref = best["fp32"]
    tokens = cfg.train.batch_size * m.block_size
    for n in names:
        t = best[n]
        tgt = TARGETS.get(n)
        mark = "" if tgt is None else f"<={tgt:.2f}" + (" ok" if t / ref <= tgt else " MISS")
        print(f"{n:18s} {t * 1e3:9.1f} {tokens / t:9.0f} {t / ref:7.2f} {mark:>9s}")


if __name__ == "__main__":
    main()
