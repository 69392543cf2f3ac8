"""Overhead of `fp8lab.watch` on a training step, at every=50 (the default) and every=1.

One run: ``python benchmarks/bench_watch.py [--steps 50] [--rounds 3] [--threads 1]
[--recipes te-delayed,deepseek-v3,mxfp8]``. A plain PyTorch loop (forward, cross-entropy,
backward, AdamW step) on the lab's default GPT (fp8lab.lab.gpt, 2 layers, d_model 256, 8 x 128
byte tokens of random data), converted to each recipe. Per recipe and round, interleaved: the
loop unwatched, under ``watch(every=50)`` and under ``watch(every=1)`` (``--steps // 5``
steps), every step timed on its own. Step times on a shared machine have outliers, so the
statistics are robust ones: the unwatched step is the median step; the every=50 step is
``(sampled + 49 * median of the skipped steps) / 50`` (what one period of 50 costs per step), the
sampled step the minimum over rounds; every=1 the median step. Each ratio is to the unwatched step
of the same run. Goal (issue 13): <= 1.10 at every=50.

The lab's ``stats.jsonl`` is written by the same per-step sampler (`fp8lab.observe.sample`) every
``train.stats_every`` steps (default 100) and registers nothing on the other steps, so its cost
per step is ``(sampled + (k - 1) * unwatched) / k`` with k = ``--lab-every``: column ``lab/k``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8lab
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.lab.train import TrainConfig
from fp8lab.nn import convert

GOAL = 1.10


def _loop(model, opt, batches, watch_every: int | None) -> list[float]:
    """Seconds of each step over ``batches`` (forward + backward + AdamW)."""
    times = []

    def run() -> None:
        for x, y in batches:
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)

    if watch_every is None:
        run()
    else:
        with fp8lab.watch(model, every=watch_every):
            run()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="steps per timed loop (x 50)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--recipes", default="te-delayed,deepseek-v3,mxfp8")
    ap.add_argument("--lab-every", type=int, default=TrainConfig().stats_every,
                    help="the lab's stats_every (default: TrainConfig's)")  # fmt: skip
    args = ap.parse_args()
    if args.steps < 50 or args.steps % 50:
        raise SystemExit("--steps must be a positive multiple of 50 (whole every=50 periods)")
    if args.lab_every < 1:
        raise SystemExit("--lab-every must be a positive integer")
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
    runs: dict[tuple[str, str], list[list[float]]] = {}
    modes = {"unwatched": (None, batches), "every=50": (50, batches),
             "every=1": (1, batches[: max(5, args.steps // 5)])}  # fmt: skip
    for _ in range(args.rounds):
        for n in names:
            model, opt = setups[n]
            for mode, (every, bs) in modes.items():
                runs.setdefault((n, mode), []).append(_loop(model, opt, bs, every))
    print(
        f"watch overhead, GPT {cfg.n_layer} layers d_model {cfg.d_model}, {batch} x "
        f"{cfg.block_size} tokens, {args.threads} thread(s), {args.rounds} interleaved rounds "
        f"of {args.steps} steps (every=1: {len(modes['every=1'][1])})"
    )
    print(f"{'recipe':12s} {'unwatched':>9s} {'sampled':>8s} {'skipped':>8s} {'every=50':>8s} "
          f"{'ratio':>6s} {'every=1':>8s} {'ratio':>6s} {'lab/' + str(args.lab_every):>8s}  "
          f"ms/step; goal every=50 <= {GOAL:.2f}")  # fmt: skip
    for n in names:
        base = statistics.median(t for r in runs[(n, "unwatched")] for t in r)
        w50 = runs[(n, "every=50")]
        sampled = min(t for r in w50 for i, t in enumerate(r) if i % 50 == 0)
        skipped = statistics.median(t for r in w50 for i, t in enumerate(r) if i % 50)
        per50 = (sampled + 49 * skipped) / 50
        w1 = statistics.median(t for r in runs[(n, "every=1")] for t in r)
        k = args.lab_every
        lab = (sampled + (k - 1) * base) / k / base
        ok = "ok" if max(per50 / base, lab) <= GOAL else "MISSED"
        print(f"{n:12s} {1e3 * base:9.1f} {1e3 * sampled:8.1f} {1e3 * skipped:8.1f} "
              f"{1e3 * per50:8.1f} {per50 / base:6.3f} {1e3 * w1:8.1f} {w1 / base:6.3f} "
              f"{lab:8.3f}  {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
