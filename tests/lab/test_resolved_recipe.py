"""A lab run writes the recipe it resolved against its model (the NVFP4 paper's high-precision
blocks as a ``[[layer]]`` rule) into its run directory, as a recipe file the user can edit."""

from __future__ import annotations

import fp8lab
from fp8lab import Recipe
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.parts import RESOLVED_RECIPE
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.nn import Linear

ONE_STEP = LabConfig(
    model=GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(steps=1, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=1,
                      eval_batches=1, stats_every=0, checkpoint_every=1),
)  # fmt: skip


def test_a_run_writes_the_resolved_high_precision_blocks(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Once more unto the breach, dear friends, once more. " * 20)
    corpus = load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)
    rec = fp8lab.get_recipe("nvfp4-bare").replace(name="bare-hp", hp_last_blocks=None)
    r = train_run(rec, ONE_STEP, corpus, tmp_path / "run")
    written = Recipe.load(tmp_path / "run" / RESOLVED_RECIPE)
    # 2 blocks: max(1, round(0.15 * 2)) = 1, the last one, from the bf16 preset
    assert written.hp_last_blocks == 0
    assert [x.to_dict() for x in written.layers] == [{"match": "blocks.1.*", "base": "bf16"}]
    hp = {n for n, m in r.model.named_modules()
          if isinstance(m, Linear) and m.recipe.fprop.high_precision == "bf16"}  # fmt: skip
    assert hp and all(n.startswith("blocks.1.") for n in hp)
    assert all(m.recipe.fprop.high_precision is None for n, m in r.model.named_modules()
               if isinstance(m, Linear) and n.startswith("blocks.0."))  # fmt: skip
    plain = train_run(fp8lab.get_recipe("nvfp4-bare"), ONE_STEP, corpus, tmp_path / "plain")
    assert plain.records and not (tmp_path / "plain" / RESOLVED_RECIPE).exists()
