"""Overhead of `fp8lab.watch` on a training step, at every=50 (the default) and every=1, and of
the lab's ``stats.jsonl`` at its ``train.stats_every``.

One run: ``python benchmarks/bench_watch.py [--triples 20] [--threads 1]
[--recipes te-delayed,deepseek-v3,mxfp8] [--lab-every 100] [--torch-device auto]`` (model and
batches on that device). A plain PyTorch step (forward,
cross-entropy, backward, AdamW step) on the lab's default GPT (fp8lab.lab.gpt, 2 layers, d_model
256, 8 x 128 byte tokens of random data), converted to each recipe, is timed three ways in
adjacent triples, in rotating order: unwatched; a skipped step of an open watch (its counting
pre-hook only); a sampled step (``watch(every=1)``: the operand hook and the statistics of every
operand). Step times on a shared machine drift with its load, so each triple's times are taken
as ratios to its own unwatched step and the medians of those ratios are reported (with the
quartiles of the sampled ratio). From them:

- every=50: ``(sampled + 49 * skipped) / 50`` (one period of 50 steps, per step);
- every=1: the sampled ratio (every step is sampled);
- lab/k: the lab samples with the same per-step sampler (`fp8lab.observe.sample`) every k =
  ``--lab-every`` steps (default: ``TrainConfig().stats_every``) and registers nothing on the other
  steps: ``(sampled + k - 1) / k``.

Goal (issue 13): <= 1.10 at every=50 and at the lab's default.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8lab
from _device import add_torch_device, sync, torch_device
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.lab.train import TrainConfig
from fp8lab.nn import convert

GOAL = 1.10


def _step(model, opt, x, y) -> float:
    """Seconds of one step (forward + backward + AdamW)."""
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(x.device)
    return time.perf_counter() - t0


def _triples(model, opt, batches, n: int) -> list[dict[str, float]]:
    """``n`` triples of step times {unwatched, skipped, sampled}, in rotating order."""
    skipper = fp8lab.watch(model, every=10**9, keep=False)
    with skipper:  # its step 0 is sampled: run it untimed, every later step is skipped
        _step(model, opt, *batches[0])

    def unwatched(x, y):
        return _step(model, opt, x, y)

    def skipped(x, y):
        with skipper:  # re-entered: the next forward advances to a step that is not sampled
            return _step(model, opt, x, y)

    def sampled(x, y):
        with fp8lab.watch(model, every=1, keep=False):
            return _step(model, opt, x, y)

    modes = [("unwatched", unwatched), ("skipped", skipped), ("sampled", sampled)]
    out = []
    for i in range(n):
        t: dict[str, float] = {}
        for k in range(3):
            name, fn = modes[(i + k) % 3]
            t[name] = fn(*batches[(3 * i + k) % len(batches)])
        out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triples", type=int, default=20, help="timed triples per recipe")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--recipes", default="te-delayed,deepseek-v3,mxfp8")
    ap.add_argument("--lab-every", type=int, default=TrainConfig().stats_every,
                    help="the lab's stats_every (default: TrainConfig's)")  # fmt: skip
    add_torch_device(ap)
    args = ap.parse_args()
    device = torch_device(args)
    if args.triples < 3:
        raise SystemExit("--triples must be >= 3")
    if args.lab_every < 1:
        raise SystemExit("--lab-every must be a positive integer")
    torch.set_num_threads(args.threads)
    cfg = GPTConfig()
    batch = 8
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(
            torch.randint(0, 256, (batch, cfg.block_size), generator=g).to(device) for _ in range(2)
        )
        for _ in range(12)
    ]
    k = args.lab_every
    print(
        f"watch overhead, GPT {cfg.n_layer} layers d_model {cfg.d_model}, {batch} x "
        f"{cfg.block_size} tokens, AdamW, on {device}, {args.threads} thread(s), {args.triples} "
        "triples per "
        "recipe; ratios to the unwatched step of the same triple (medians)"
    )
    print(f"{'recipe':12s} {'unwatched':>9s} {'skipped':>7s} {'sampled':>7s} {'(IQR)':>13s} "
          f"{'every=50':>8s} {'every=1':>7s} {'lab/' + str(k):>8s}  "
          f"unwatched in ms/step; goal <= {GOAL:.2f}")  # fmt: skip
    for n in [n for n in args.recipes.split(",") if n]:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        convert(model, n)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _triples(model, opt, batches, 2)  # warm-up: numba compilation, allocator
        ts = _triples(model, opt, batches, args.triples)
        base = statistics.median(t["unwatched"] for t in ts)
        skipped = statistics.median(t["skipped"] / t["unwatched"] for t in ts)
        samp = [t["sampled"] / t["unwatched"] for t in ts]
        sampled = statistics.median(samp)
        q1, _, q3 = statistics.quantiles(samp, n=4)
        per50 = (sampled + 49 * skipped) / 50
        lab = (sampled + k - 1) / k
        ok = "ok" if max(per50, lab) <= GOAL else "MISSED"
        print(f"{n:12s} {1e3 * base:9.1f} {skipped:7.3f} {sampled:7.3f} {f'({q1:.2f}-{q3:.2f})':>13s} "
              f"{per50:8.3f} {sampled:7.3f} {lab:8.3f}  {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
