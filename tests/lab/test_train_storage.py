"""The lab resumes bit for bit under the optimizer-state, parameter-storage and
saved-activation recipe keys (FP8 parameters, masters, expanded moments are all checkpointed)."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run

CFG = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=6,
                      eval_batches=1, stats_every=0, checkpoint_every=3),
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"param_storage": "fp8", "master_weights": "none", "exp_avg_dtype": "fp8",
         "exp_avg_sq_dtype": "e4m3", "moment_expansion": True, "save_activations": "quantized"},
        {"param_storage": "fp8", "master_weights": "fp16-scaled", "param_master_init": "from_fp8"},
    ],
)  # fmt: skip
def test_resume_is_bit_identical(tmp_path, kw):
    f = tmp_path / "t.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears. " * 30)
    corpus = load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)
    recipe = fp8lab.get_recipe("te-current").replace(**kw)
    full = train_run(recipe, CFG, corpus, tmp_path / "full")
    train_run(recipe, CFG, corpus, tmp_path / "part", stop_after=3)
    resumed = train_run(recipe, CFG, corpus, tmp_path / "part")
    assert [r["train_loss"] for r in resumed.records] == [r["train_loss"] for r in full.records]
    sa, sb = resumed.model.state_dict(), full.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.no_arithmetic
def test_fp8_parameters_are_refused_with_fsdp():
    """The documented refusal (docs/recipes.md): FP8 storage re-quantizes each rank's shard after
    the optimizer step, which under FSDP would scale a shard by its own amax."""
    from fp8lab.lab.parts import build_run_parts

    recipe = fp8lab.get_recipe("te-current").replace(param_storage="fp8")
    with pytest.raises(ValueError, match="param_storage = 'fp8' is simulated on unsharded"):
        build_run_parts(CFG, recipe, fsdp=True)
