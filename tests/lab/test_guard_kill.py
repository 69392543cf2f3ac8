"""kill -9 while a checkpoint is being written: the previous checkpoint stays loadable (atomic
write: temporary file + os.replace) and the rerun resumes, bit-identical to an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

import fp8lab
from fp8lab.guard import AnomalyGuard
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run

SCRIPT = r"""
import io, json, os, sys, time
import torch
torch.set_num_threads(1)
import fp8lab
from fp8lab.guard import AnomalyGuard
from fp8lab.lab.data import load_corpus
from fp8lab.lab.train import LabConfig, train_run

cfg_path, run_dir, mark = sys.argv[1:4]
real, calls = torch.save, [0]

def stalling_save(obj, f, *a, **k):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint: half written, then wait to be killed
        buf = io.BytesIO()
        real(obj, buf, *a, **k)
        data = buf.getvalue()
        with open(f, "wb") as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            os.fsync(fh.fileno())
        open(mark, "w").close()
        time.sleep(600)
    return real(obj, f, *a, **k)

torch.save = stalling_save
cfg = LabConfig.from_dict(json.load(open(cfg_path)))
corpus = load_corpus(cfg.data, cfg.model.block_size)
train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, run_dir, guard=AnomalyGuard(checkpoint_every=4))
"""


def test_kill_9_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun. " * 40)
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
        data=DataConfig(paths=(str(text),), split_chunk=256),
        train=TrainConfig(steps=12, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=6,
                          eval_batches=1, stats_every=0, checkpoint_every=4),
    )  # fmt: skip
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    run, mark = tmp_path / "run", tmp_path / "mark"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cfg.json"), str(run), str(mark)], env=env
    )
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():
            assert proc.poll() is None, "the training process ended before the stalled save"
            assert time.monotonic() < deadline, "the stalled save never came"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (run / "checkpoint.tmp").exists()  # the half-written file, never renamed
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["loop"]["step"] == 4  # the first checkpoint, intact
    recipe = fp8lab.get_recipe("te-delayed")
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    resumed = train_run(recipe, cfg, corpus, run, guard=AnomalyGuard(checkpoint_every=4))
    whole = train_run(recipe, cfg, corpus, tmp_path / "whole", guard=AnomalyGuard())
    assert [r["step"] for r in resumed.records] == list(range(1, 13))
    key = [(r["train_loss"], r["grad_norm"]) for r in whole.records]
    assert [(r["train_loss"], r["grad_norm"]) for r in resumed.records] == key
