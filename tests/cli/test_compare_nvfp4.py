"""``fp8lab compare --recipes nvfp4-te,nvfp4-paper`` on a user's model (a transformers Llama
config, ``--model hf:...``): both train, and nvfp4-paper's run directory holds the recipe resolved
against ``model.layers`` (its last block in bf16)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab import Recipe
from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

pytest.importorskip("transformers")


@pytest.mark.slow
def test_compare_nvfp4_te_and_paper_on_a_user_model(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40)
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"d_model": 128, "d_ff": 256}, steps=2, batch_size=2,
                                  eval_every=2, checkpoint_every=2))  # fmt: skip
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "max_position_embeddings": 64}))  # fmt: skip
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["compare", "--config", str(conf), "--out", str(out), "--quiet",
                                   "--recipes", "nvfp4-te,nvfp4-paper", "--json",
                                   "--model", f"hf:{llama}"])  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert {"nvfp4-te", "nvfp4-paper"} <= set(summary["recipes"])
    assert not any(r["diverged"] for r in summary["recipes"].values())
    resolved = Recipe.load(out / "runs" / "nvfp4-paper" / "recipe.toml")
    # 2 blocks: max(1, round(0.3)) = 1, the last one (HF's model.layers, inside the lab's wrapper)
    (rule,) = [r.to_dict() for r in resolved.layers]
    assert rule["base"] == "bf16" and rule["match"].endswith("model.layers.1.*")
    assert not (out / "runs" / "nvfp4-te" / "recipe.toml").exists()
