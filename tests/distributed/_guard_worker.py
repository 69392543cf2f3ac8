"""The anomaly guard under torchrun (2 gloo ranks): tests/distributed/test_guard_dist.py.

argv: out_dir [fsdp]. Runs three tiny guarded te-delayed trainings one after another in the
same process group -- clean; ``inject.nan_step`` 4; and "split", where rank 1 alone finds a
(fake, one-shot) anomaly on step 5 -- and writes this rank's guard events, losses and final
weights to ``out_dir/rank{R}.pt``. With ``fsdp``: FSDP2 (te-current, FP8 all-gather)."""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    out_dir = sys.argv[1]
    fsdp = len(sys.argv) > 2 and sys.argv[2] == "fsdp"
    torch.set_num_threads(1)
    from fp8lab.distributed.runtime import init_from_env
    from fp8lab.guard import AnomalyGuard, Finding
    from fp8lab.guard import monitor as guard_monitor
    from fp8lab.lab.data import DataConfig, load_corpus
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.inject import InjectConfig
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run
    from fp8lab.recipe import get_recipe

    ctx = init_from_env(timeout_s=60)
    rank = ctx.rank if ctx else 0
    text = os.path.join(out_dir, "t.txt")
    corpus = load_corpus(DataConfig(paths=(text,), split_chunk=256), block_size=16)
    model = GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64)
    train = TrainConfig(steps=8, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4,
                        eval_batches=1, stats_every=0, checkpoint_every=3)  # fmt: skip
    recipe = get_recipe("te-current" if fsdp else "te-delayed")
    # the per-operand percentages every 2 steps: per-rank numbers, agreed like the rest
    guard = AnomalyGuard(checkpoint_every=3, detectors={"underflow": {"every": 2},
                                                        "saturation": {"every": 2}})  # fmt: skip

    orig = guard_monitor.GuardMonitor.check
    fired: list[int] = []

    def check(self, step, loss, grad_norm, rows=None):  # rank 1 alone sees a one-shot anomaly
        found = orig(self, step, loss, grad_norm, rows)
        if split and rank == 1 and step == 5 and not fired:
            fired.append(step)
            found = [*found, Finding("loss_zscore", 99.0, 10.0, None)]
        return found

    guard_monitor.GuardMonitor.check = check
    out = {}
    for mode, inject in (("clean", {}), ("nan", {"nan_step": 4}), ("split", {})):
        split = mode == "split"
        cfg = LabConfig(model=model, train=train, inject=InjectConfig(**inject))
        measured: list[bool] = []

        def on_event(ev: dict, measured: list[bool] = measured) -> None:
            if ev["event"] == "guard_signals":
                measured.append(ev.get("underflow_pct") is not None)

        res = train_run(recipe, cfg, corpus, os.path.join(out_dir, mode), on_event, guard=guard,
                        fsdp=fsdp, fp8_allgather=fsdp)  # fmt: skip
        out[mode] = {
            "events": [
                [e["action"], e["step"], e["detector"], e.get("to_step")]
                for e in res.summary["guard_events"]
            ],
            "losses": [r["train_loss"] for r in res.records],
            "steps": [r["step"] for r in res.records],
            "percentages_measured": sum(measured),
        }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
