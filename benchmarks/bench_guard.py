"""Overhead of the anomaly guard's detectors (issue 15 target: <= 3 % of the step time).

One run: ``python benchmarks/bench_guard.py [--recipe te-delayed] [--steps 100] [--threads 1]
[--torch-device auto]`` (the models and batches on that device, with the lab's deterministic
kernels on a GPU: `fp8lab.lab.machine.deterministic_kernels`).
Two copies of the lab's default GPT (same initial weights) train side by side in one process,
step by step in alternation, ABBA order (so a change of machine load, and whichever copy runs
second, hits both alike): one unguarded, one
under ``AnomalyGuard(policy="rollback")`` with its defaults (per-step checks, per-operand
percentages every 10 steps, an in-memory snapshot every 50 steps). Each step's wall time covers
everything the loop does for it (the guard's check, its bookkeeping after the step, snapshots).
Prints the mean step time of each, the ratio and the overhead in %. The guarded copy must
record no event (the two runs are then bit-identical, checked).

``--percentages N``: the cost of one sampled step's per-operand percentages instead. N forward
and backward passes of one model, three variants alternating (no collector; the guard's
collector, `fp8lab.guard.percent`; the same operands measured with the watch's full
`fp8lab.stats.error_stats`); prints the medians and the ratios to no collector.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _device import add_torch_device, sync, torch_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--percentages", type=int, default=0, metavar="N")
    add_torch_device(ap)
    args = ap.parse_args()
    device = torch_device(args, lab=True)  # the lab's models and batches go there
    from fp8lab.lab.machine import deterministic_kernels

    with deterministic_kernels(device):  # as a lab run: the two copies must agree bit for bit
        if args.percentages:
            percentages_ab(args, device)
        else:
            guard_ab(args, device)


def guard_ab(args: argparse.Namespace, device: torch.device) -> None:
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.inject import Injector
    from fp8lab.lab.loop import LoopState, _guard_run, make_step, train_step
    from fp8lab.lab.parts import build_model, make_optimizer
    from fp8lab.lab.pool import set_threads
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.lab.train import LabConfig
    from fp8lab.optim import LossScaler

    set_threads(args.threads)
    recipe = resolve_recipe(args.recipe)
    cfg = LabConfig().replace_train(steps=args.steps + 1, stats_every=0, eval_every=10**9)
    corpus = load_corpus(cfg.data, cfg.model.block_size)

    def setup(guarded: bool):
        model = build_model(cfg.model, recipe, cfg.train.seed)
        opt = make_optimizer(model, recipe, cfg.train)
        scaler = LossScaler.from_recipe(recipe)
        grun = _guard_run(AnomalyGuard() if guarded else None, model, opt, scaler, recipe)
        st = LoopState()
        if grun is not None:
            grun.snapshot(st)
        tc = cfg.train
        ts, watch = make_step(model, opt, scaler, Injector(model, cfg.inject), st, tc.grad_clip,
                              tc.stats_every, recipe, None, grun)  # fmt: skip
        return ts, watch, st, grun

    runs = {"plain": setup(False), "guarded": setup(True)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.steps + 1):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]  # ABBA: no position bias
        for name in order:
            ts, watch, st, grun = runs[name]
            t0 = time.perf_counter()
            rec, _ = train_step(ts, watch, st, corpus, cfg)  # the lab loop's step (lab.loop)
            sync(device)
            if grun is not None:
                assert grun.after_step(st) is None, "the guard acted on a healthy run"
            if i > 0:  # the first step compiles / loads kernels
                times[name].append(time.perf_counter() - t0)
            losses[name].append(rec["train_loss"])
    assert losses["plain"] == losses["guarded"], "guarded run differs"
    mp, mg = statistics.fmean(times["plain"]), statistics.fmean(times["guarded"])
    m = cfg.model
    print(
        f"guard overhead, {args.recipe}, GPT {m.n_layer} layers d_model {m.d_model}, "
        f"{cfg.train.batch_size} x {m.block_size} tokens, on {device}, {args.threads} thread(s), "
        f"{args.steps} alternating steps each (no event; losses bit-identical)"
    )
    print(
        f"unguarded {1000 * mp:8.1f} ms/step (median {1000 * statistics.median(times['plain']):.1f})"
    )
    print(
        f"guarded   {1000 * mg:8.1f} ms/step (median {1000 * statistics.median(times['guarded']):.1f})"
    )
    print(f"ratio {mg / mp:.4f}  overhead {100 * (mg / mp - 1):+.2f} %  (target <= 3 %)")
    torch.set_num_threads(torch.get_num_threads())


def percentages_ab(args: argparse.Namespace, device: torch.device) -> None:
    import contextlib

    from fp8lab.guard.percent import operand_percentages
    from fp8lab.lab.data import get_batch, load_corpus
    from fp8lab.lab.parts import build_model
    from fp8lab.lab.pool import set_threads
    from fp8lab.lab.recipes import resolve_recipe
    from fp8lab.lab.train import LabConfig
    from fp8lab.nn import on_operand
    from fp8lab.observe.records import NATURAL_OPERANDS
    from fp8lab.qtensor import QTensor
    from fp8lab.stats import error_stats

    set_threads(args.threads)
    recipe = resolve_recipe(args.recipe)
    cfg = LabConfig()
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    model = build_model(cfg.model, recipe, cfg.train.seed)
    x, y = get_batch(corpus.train, cfg.train.batch_size, cfg.model.block_size, cfg.train.seed, 0)

    @contextlib.contextmanager
    def full_stats():
        rows = []

        def cb(layer, gemm, role, hp, used):
            if (gemm, role) in NATURAL_OPERANDS and isinstance(used, QTensor):
                dq = used.dequantize()
                rows.append(error_stats(hp.detach().float(), dq, used.spec.fmt,
                                        used.values.reshape(dq.shape)))  # fmt: skip

        with on_operand(cb):
            yield rows

    variants = {"none": lambda: contextlib.nullcontext([]), "guard": operand_percentages,
                "error_stats": full_stats}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(args.percentages + 1):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for k in order:
            t0 = time.perf_counter()
            with variants[k]():
                _, loss = model(x, y)
                loss.backward()
            sync(device)
            model.zero_grad(set_to_none=True)
            if i > 0:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"sampled step, {args.recipe}, default GPT, on {device}, {args.percentages} "
          "alternating passes each")  # fmt: skip
    for k, v in med.items():
        print(f"{k:12s} {1000 * v:8.1f} ms  ratio {v / med['none']:.3f}")


if __name__ == "__main__":
    main()
