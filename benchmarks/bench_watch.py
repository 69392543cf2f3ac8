"""Overhead of `fp8lab.watch` on a training step, at every=50 (the default) and every=1.

One run: ``python benchmarks/bench_watch.py [--steps 100] [--rounds 2] [--threads 1]
[--recipes te-delayed,deepseek-v3,mxfp8]``. A plain PyTorch loop (forward, cross-entropy,
backward, AdamW step) on the lab's default GPT (fp8lab.lab.gpt, 2 layers, d_model 256, 8 x 128
byte tokens of random data), converted to each recipe. For each recipe and round: ``--steps``
steps unwatched, the same under ``watch(every=50)`` (steps 0 and 50 of 100 sampled: exactly one
in 50) and ``--steps // 5`` steps under ``watch(every=1)``; the mean step time of each (wall
clock over the whole loop), the minimum over rounds interleaved so that machine load hits all
alike, and the ratio to the unwatched step of the same run. Goal (issue 13): <= 1.10 at every=50.
"""

from __future__ import annotations

import argparse
import time

import torch

import fp8lab
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.nn import convert

GOAL = 1.10


def _loop(model, opt, batches, watch_every: int | None) -> float:
    """Mean seconds per step over ``batches`` (forward + backward + AdamW)."""

    def run() -> None:
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    if watch_every is None:
        run()
    else:
        with fp8lab.watch(model, every=watch_every):
            run()
    return (time.perf_counter() - t0) / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="steps per timed loop (>= 50)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--recipes", default="te-delayed,deepseek-v3,mxfp8")
    args = ap.parse_args()
    if args.steps < 50 or args.steps % 50:
        raise SystemExit("--steps must be a positive multiple of 50 (whole every=50 periods)")
    torch.set_num_threads(args.threads)
    cfg = GPTConfig()
    batch = 8
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, 256, (batch, cfg.block_size), generator=g) for _ in range(2))
        for _ in range(args.steps)
    ]
    names = [n for n in args.recipes.split(",") if n]
    setups = {}
    for n in names:
        torch.manual_seed(0)
        model = GPT(cfg)
        convert(model, n)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _loop(model, opt, batches[:3], None)  # warm-up: numba compilation, allocator
        _loop(model, opt, batches[:2], 1)
        setups[n] = (model, opt)
    best: dict[tuple[str, str], float] = {}
    modes = {"unwatched": (None, batches), "every=50": (50, batches),
             "every=1": (1, batches[: max(5, args.steps // 5)])}  # fmt: skip
    for _ in range(args.rounds):
        for n in names:
            model, opt = setups[n]
            for mode, (every, bs) in modes.items():
                t = _loop(model, opt, bs, every)
                best[(n, mode)] = min(best.get((n, mode), t), t)
    print(
        f"watch overhead, GPT {cfg.n_layer} layers d_model {cfg.d_model}, {batch} x "
        f"{cfg.block_size} tokens, {args.threads} thread(s), mean step time, min over "
        f"{args.rounds} interleaved rounds ({args.steps} steps; every=1: {len(modes['every=1'][1])})"
    )
    print(f"{'recipe':14s} {'unwatched ms':>12s} {'every=50 ms':>12s} {'ratio':>6s} "
          f"{'every=1 ms':>11s} {'ratio':>6s}  goal every=50 <= {GOAL:.2f}")  # fmt: skip
    for n in names:
        base = best[(n, "unwatched")]
        r50, r1 = best[(n, "every=50")] / base, best[(n, "every=1")] / base
        ok = "ok" if r50 <= GOAL else "MISSED"
        print(f"{n:14s} {1e3 * base:12.1f} {1e3 * best[(n, 'every=50')]:12.1f} {r50:6.3f} "
              f"{1e3 * best[(n, 'every=1')]:11.1f} {r1:6.3f}  {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
