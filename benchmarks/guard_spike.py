"""Spike recovery at full size (issue 15's acceptance, measured once; README "Anomaly guard").

te-delayed on the lab's default GPT and corpus (400 steps), a x1e12 gradient spike at step T:
unspiked, unspiked + guard (bit-identical?), spiked without guard (the failure), spiked + guard
(rollback). Prints one JSON object: detection step and detector, per gradient operand the
underflow % before the spike and the worst after the restart, final validation losses.

    .venv/bin/python benchmarks/guard_spike.py [--steps 400] [--spike 200] [--out runs/guard-spike]
    .venv/bin/python benchmarks/guard_spike.py --hot-lr 64 --steps 200

``--nan-step T`` instead: the loss of step T becomes NaN once (``--inject-nan-step``); prints the
guarded run's events, whether every record and the final weights equal the unspiked run's, and
the unguarded run's skipped steps and final validation loss.

``--hot-lr M`` instead: no fault, the peak learning rate x M (a hot run, where delayed scales go
stale on many steps), with ``AnomalyGuard()``: prints on how many steps each detector fired or
warned, the guard's events and the final losses (``--steps`` as given, e.g. 200).

``--torch-device cpu|cuda|cuda:N|auto`` (default auto): the lab's device for every run, named
as ``torch_device`` in the printed JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _device import add_torch_device, torch_device


def grad_underflow(run: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in (run / "stats.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["role"] == "grad_output" and r["gemm"] == "dgrad":
            out.setdefault(r["step"], {})[r["layer"]] = r["underflow_pct"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--spike", type=int, default=200)
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--out", type=Path, default=Path("runs/guard-spike"))
    ap.add_argument("--nan-step", type=int, default=None)
    ap.add_argument("--hot-lr", type=float, default=None)
    add_torch_device(ap)
    args = ap.parse_args()
    args.torch_device = str(torch_device(args, lab=True))  # resolved: the runs' device
    torch.set_num_threads(1)
    if args.nan_step is not None:
        return nan_main(args)
    if args.hot_lr is not None:
        return hot_main(args)
    import fp8lab
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.inject import InjectConfig
    from fp8lab.lab.train import LabConfig, train_run

    base = LabConfig().replace_train(steps=args.steps, stats_every=10)
    spiked = LabConfig(model=base.model, data=base.data, train=base.train,
                       inject=InjectConfig(grad_spike_step=args.spike, grad_spike_scale=1e12))  # fmt: skip
    corpus = load_corpus(base.data, base.model.block_size)
    recipe = fp8lab.get_recipe(args.recipe)
    runs = {}
    for name, cfg, guard in (("clean", base, None), ("clean_guarded", base, AnomalyGuard()),
                             ("spiked", spiked, None), ("spiked_guarded", spiked, AnomalyGuard())):  # fmt: skip
        t0 = time.time()
        res = train_run(recipe, cfg, corpus, args.out / name, guard=guard)
        runs[name] = res
        print(f"{name}: {time.time() - t0:.0f} s, val {res.summary['final_val_loss']}", flush=True)
    sa, sb = runs["clean"].model.state_dict(), runs["clean_guarded"].model.state_dict()
    same = [(r["train_loss"], r["grad_norm"]) for r in runs["clean"].records] == [
        (r["train_loss"], r["grad_norm"]) for r in runs["clean_guarded"].records
    ] and all(torch.equal(sa[k], sb[k]) for k in sa)
    g = grad_underflow(args.out / "spiked_guarded")
    u = grad_underflow(args.out / "spiked")
    pre = g[args.spike]
    after = {layer: max(g[s][layer] for s in g if s > args.spike + 10) for layer in pre}
    ref = runs["clean"].summary["final_val_loss"]
    out = {
        "recipe": args.recipe, "steps": args.steps, "spike_step": args.spike,
        "torch_device": args.torch_device,
        "clean_guarded_events": runs["clean_guarded"].summary["guard_events"],
        "clean_guarded_bit_identical": same,
        "events": runs["spiked_guarded"].summary["guard_events"],
        "underflow_pre_spike": pre, "underflow_after_restart_max": after,
        "underflow_unguarded_after_spike_max": {
            layer: max(u[s][layer] for s in u if s > args.spike) for layer in pre},
        "val_clean": ref,
        "val_spiked_guarded": runs["spiked_guarded"].summary["final_val_loss"],
        "val_spiked_unguarded": runs["spiked"].summary["final_val_loss"],
        "rel_gap_guarded_pct": 100 * (runs["spiked_guarded"].summary["final_val_loss"] - ref) / ref,
        "rel_gap_unguarded_pct": 100 * (runs["spiked"].summary["final_val_loss"] - ref) / ref,
    }  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


def nan_main(args: argparse.Namespace) -> None:
    import fp8lab
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.inject import InjectConfig
    from fp8lab.lab.train import LabConfig, train_run

    base = LabConfig().replace_train(steps=args.steps)
    nan = LabConfig(model=base.model, data=base.data, train=base.train,
                    inject=InjectConfig(nan_step=args.nan_step))  # fmt: skip
    corpus = load_corpus(base.data, base.model.block_size)
    recipe = fp8lab.get_recipe(args.recipe)
    clean = train_run(recipe, base, corpus, args.out / "clean")
    guarded = train_run(recipe, nan, corpus, args.out / "nan_guarded", guard=AnomalyGuard())
    plain = train_run(recipe, nan, corpus, args.out / "nan")
    sa, sb = clean.model.state_dict(), guarded.model.state_dict()
    key = [(r["step"], r["train_loss"], r["grad_norm"]) for r in clean.records]
    out = {
        "recipe": args.recipe, "steps": args.steps, "nan_step": args.nan_step,
        "torch_device": args.torch_device,
        "events": guarded.summary["guard_events"],
        "records_equal_clean": key == [(r["step"], r["train_loss"], r["grad_norm"])
                                       for r in guarded.records],
        "weights_equal_clean": all(torch.equal(sa[k], sb[k]) for k in sa),
        "val_clean": clean.summary["final_val_loss"],
        "val_nan_guarded": guarded.summary["final_val_loss"],
        "val_nan_unguarded": plain.summary["final_val_loss"],
        "skipped_unguarded": plain.summary["skipped_steps"],
    }  # fmt: skip
    (args.out / "result_nan.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


def hot_main(args: argparse.Namespace) -> None:
    from collections import Counter

    import fp8lab
    from fp8lab.guard import AnomalyGuard
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run

    base = LabConfig()
    cfg = base.replace_train(steps=args.steps, lr=TrainConfig().lr * args.hot_lr)
    corpus = load_corpus(base.data, base.model.block_size)
    fired: Counter[str] = Counter()
    warned: Counter[str] = Counter()

    def count(ev: dict) -> None:
        if ev["event"] == "guard_signals":
            fired.update(ev["fired"])
            warned.update(ev["warned"])

    t0 = time.time()
    res = train_run(fp8lab.get_recipe(args.recipe), cfg, corpus, None, count, guard=AnomalyGuard())
    events = res.summary["guard_events"]
    out = {
        "recipe": args.recipe, "steps": args.steps, "lr": cfg.train.lr,
        "torch_device": args.torch_device,
        "steps_fired": dict(fired), "steps_warned": dict(warned),
        "events": [{k: e.get(k) for k in ("action", "step", "detector", "tensor", "value")}
                   for e in events],
        "actions": dict(Counter(e["action"] for e in events)),
        "final_train_loss": res.summary["final_train_loss"],
        "final_val_loss": res.summary["final_val_loss"],
        "seconds": round(time.time() - t0),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"result_hot_x{args.hot_lr:g}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
