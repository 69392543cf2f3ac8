"""The debugger's start checkpoint (`convert_checkpoint`) keeps the optimizer's master weights
where the probe's optimizer keeps one: a probe under FP8 parameter storage with an fp32 master
continues its master bit for bit instead of restarting it from the FP8 parameter."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.debug.runner import convert_checkpoint, load_state
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import CHECKPOINT, LabConfig, TrainConfig, train_run

CFG = LabConfig(
    model=GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=32, d_ff=32),
    train=TrainConfig(steps=3, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=3,
                      eval_batches=1, stats_every=0, checkpoint_every=2),
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("init", ["high_precision", "from_fp8"])
def test_converted_start_continues_the_fp32_master_bit_for_bit(tmp_path, init):
    f = tmp_path / "t.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears. " * 20)
    corpus = load_corpus(DataConfig(paths=(str(f),), split_chunk=128), block_size=8)
    recipe = fp8lab.get_recipe("te-current").replace(param_storage="fp8", param_master_init=init)
    full = train_run(recipe, CFG, corpus, tmp_path / "full")
    train_run(recipe, CFG, corpus, tmp_path / "part", stop_after=2)
    saved = load_state(tmp_path / "part" / CHECKPOINT)
    masters = [s["master"] for s in saved["optimizer"]["state"].values() if "master" in s]
    assert masters  # FP8 storage with an fp32 master: the masters are checkpointed
    convert_checkpoint(tmp_path / "part" / CHECKPOINT, tmp_path / "probe" / CHECKPOINT,
                       recipe, CFG, corpus)  # fmt: skip
    conv = load_state(tmp_path / "probe" / CHECKPOINT)["optimizer"]["state"]
    for k, s in saved["optimizer"]["state"].items():
        if "master" in s:  # the master itself, not the FP8 parameter it was quantized to
            assert torch.equal(conv[k]["master"], s["master"])
    probe = train_run(recipe, CFG, corpus, tmp_path / "probe")
    sa, sb = probe.model.state_dict(), full.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert probe.records[-1]["train_loss"] == full.records[-1]["train_loss"]
