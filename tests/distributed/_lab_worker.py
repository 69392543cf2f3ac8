"""A tiny lab training run under torchrun (or alone): tests/distributed/test_lab_ddp.py.

argv: run_dir steps [kill_at [mode]]. With kill_at >= 0, the last rank kills itself (SIGKILL)
right after that step's event (a checkpoint is written every 3 steps). mode: ddp (te-delayed,
default), fsdp8 (te-current, FSDP2 with the FP8 all-gather; on one rank a plain run) or
none-resume (te-delayed, --amax-group none: an uninterrupted run and one stopped at its step-3
checkpoint and resumed, in one launch) or fsdp8d-resume (the same with te-delayed under FSDP2 with
the FP8 all-gather, --amax-group world).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch


def main() -> None:
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    mode = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    torch.set_num_threads(1)
    from fp8lab.distributed.runtime import init_from_env
    from fp8lab.lab.data import DataConfig, load_corpus
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run
    from fp8lab.recipe import get_recipe

    ctx = init_from_env(timeout_s=60)
    rank, last = (ctx.rank, ctx.world - 1) if ctx else (0, 0)
    text = os.path.join(os.path.dirname(run_dir), "t.txt")
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
        train=TrainConfig(
            steps=steps, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=3, eval_batches=1,
            stats_every=0, checkpoint_every=3,
        ),
    )  # fmt: skip
    corpus = load_corpus(DataConfig(paths=(text,), split_chunk=256), block_size=16)

    def on_event(ev: dict) -> None:
        if ev["event"] == "step" and ev["step"] == kill_at and rank == last:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode in ("none-resume", "fsdp8d-resume"):  # a run stopped at its step-3 checkpoint and
        # resumed (every rank's own scaling state restored) vs an uninterrupted run
        recipe = get_recipe("te-delayed")
        kw = ({"amax_group": "none"} if mode == "none-resume"
              else {"fsdp": True, "fp8_allgather": True})  # fmt: skip
        full = train_run(recipe, cfg, corpus, run_dir + "-full", **kw)
        train_run(recipe, cfg, corpus, run_dir, stop_after=3, **kw)
        res = train_run(recipe, cfg, corpus, run_dir, **kw)
        if rank == 0:
            print(json.dumps({"final": res.records[-1]["train_loss"], "steps": len(res.records),
                              "want": full.records[-1]["train_loss"],
                              "spread": full.records[-1].get("scale_spread_binades"),
                              "sharding": full.records[-1]["sharding"]}))  # fmt: skip
        return
    fsdp = mode == "fsdp8"
    recipe = get_recipe("te-current" if fsdp else "te-delayed")
    res = train_run(recipe, cfg, corpus, run_dir, callback=on_event, fsdp=fsdp, fp8_allgather=fsdp)
    if rank == 0:
        print(json.dumps({"final": res.records[-1]["train_loss"], "steps": len(res.records)}))


if __name__ == "__main__":
    main()
