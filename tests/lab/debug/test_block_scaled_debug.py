"""``fp8lab debug`` end to end on every block-scaled preset (slow: ``make test-slow``).

The debugger's other end-to-end tests run te-* recipes only; a fake-quantization variant that
could not express a block-scaled preset's accumulator (``promote_every``) stopped every
deepseek-v3 debug run after its first stage ("does not run the intended recipe", exit 1). Each
run plants a fault in the preset (every block's gradient operand with a fixed scale of 1, so
most of it flushes) so that the gap exceeds the attribution floor and the debugger goes on to
the fake-quantization, screening and remedy stages, on a small GPT (2 layers of width 64, 48
steps, the search limited to the second block).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.recipe import get_recipe

runner = CliRunner()
BLOCK_SCALED = [
    "deepseek-v3",
    "deepseek-v3-h100",
    "mxfp8",
    "nvfp4",
    "nvfp4-te",
    "nvfp4-paper",
    "nvfp4-bare",
    "nvfp4-4over6",
    "torchao-rowwise",
    "torchao-rowwise-gw-hp",
    "mxfp8-2d",
    "mxfp4",
    "mxfp4-quartet",
]
SMALL = ["--set", "model.block_size=16", "--set", "model.n_layer=2", "--set", "model.n_head=2",
         "--set", "model.d_model=64", "--set", "model.d_ff=128", "--set", "train.batch_size=8",
         "--set", "train.lr=1e-3", "--set", "train.warmup_steps=5", "--set",
         "train.eval_every=16", "--set", "train.eval_batches=2", "--set", "train.stats_every=0",
         "--steps", "48", "--checkpoints", "1", "--layers", "blocks.1.*", "--jobs", "1",
         "--threads", "1", "--quiet"]  # fmt: skip


def test_the_list_is_every_block_scaled_preset() -> None:
    import fp8lab

    blocked = [n for n in fp8lab.recipes()
               if any(s is not None and s.block != (-1, -1)
                      for s in (getattr(get_recipe(n), r) for r in ("input", "weight")))]  # fmt: skip
    assert sorted(blocked) == sorted(BLOCK_SCALED)


# A debug run per block-scaled family (about a minute each): the other presets differ from one
# of these only in a scaling rule or block shape (nvfp4-bare/-paper/-4over6 from nvfp4 and
# nvfp4-te, mxfp8-2d and mxfp4 from mxfp8, torchao-rowwise-gw-hp from torchao-rowwise), whose
# every debugger variant tests/lab/debug/test_variants_presets.py builds and checks
DEBUG_RUNS = ["deepseek-v3", "deepseek-v3-h100", "mxfp8", "nvfp4", "nvfp4-te", "mxfp4-quartet",
              "torchao-rowwise"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("preset", DEBUG_RUNS)
def test_debug_runs_through_every_stage(preset: str, tmp_path: Path) -> None:
    recipe = tmp_path / f"{preset}-planted.toml"
    # the planted fault: unscaled gradients (a fixed scale 1), which TE's RHT refuses (it
    # transforms NVFP4-scaled operands only): such presets plant it without the RHT
    rht = '\nrht_gemms = "none"' if get_recipe(preset).rht_gemms != "none" else ""
    recipe.write_text(
        f'base = "{preset}"\nname = "{preset}-planted"{rht}\n\n'
        '[[layer]]\nmatch = "blocks.*"\n[layer.grad_output]\nscaling = 1.0\n'
    )
    out = tmp_path / "dbg"
    r = runner.invoke(app, ["debug", "--recipe", str(recipe), "--out", str(out), "--json", *SMALL])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    probes = {p["name"] for p in d["probes"]}
    assert "fake-quant" in probes, (sorted(probes), d)  # past the gap stage
    assert (out / "fix.toml").exists() or d["culprit"] is None
