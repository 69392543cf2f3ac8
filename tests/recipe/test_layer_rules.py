"""Per-layer recipes: `base = "PRESET"`, `[[layer]]` rules, the single-cell high-precision switch."""

import pytest

from fp8lab.qtensor import QuantSpec
from fp8lab.recipe import LayerRule, Recipe, RecipeFileError, get_recipe

FILE = """
base = "te-delayed"
name = "fix"
[grad_output]
scaling = "max"

[[layer]]
match = "blocks.1.mlp.*"
[layer.dgrad.high_precision_roles]
grad_output = "bf16"

[[layer]]
match = ["blocks.0.*", "blocks.1.mlp.down"]
base = "bf16"

[[layer]]
match = "blocks.0.attn.*"
[layer.input]
granularity = [1, 32]
"""


def test_base_inherits_the_preset_and_overrides_only_what_is_written():
    r = Recipe.from_toml(FILE)
    base = get_recipe("te-delayed")
    assert r.name == "fix"
    assert r.input == base.input and r.weight == base.weight
    assert r.grad_output == base.grad_output.replace(scaling="max")  # format e5m2 kept
    assert r.grad_output.format == base.grad_output.format
    assert (r.fprop, r.dgrad, r.wgrad) == (base.fprop, base.dgrad, base.wgrad)
    assert r.optimizer_state == base.optimizer_state and len(r.layers) == 3


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_layered_recipe_round_trips(tmp_path, suffix):
    r = Recipe.from_toml(FILE)
    p = tmp_path / f"r{suffix}"
    r.save(p)
    back = Recipe.load(p)
    assert back == r and hash(back) == hash(r)
    assert back.fingerprint() == r.fingerprint()
    assert back.for_layer("blocks.0.attn.q") == r.for_layer("blocks.0.attn.q")


def test_rules_apply_in_order_last_match_wins():
    r = Recipe.from_toml(FILE)
    assert r.layer_rules_for("blocks.1.mlp.gate") == [0]
    assert r.layer_rules_for("blocks.1.mlp.down") == [0, 1]
    assert r.layer_rules_for("blocks.0.attn.q") == [1, 2]
    assert r.layer_rules_for("blocks.2.attn.q") == []
    gate = r.for_layer("blocks.1.mlp.gate")
    assert gate.precision("dgrad", "grad_output") == "bf16"
    assert (
        gate.precision("dgrad", "weight") is None and gate.precision("wgrad", "grad_output") is None
    )
    # rule 2 (base bf16) comes after rule 1: the cell switch is gone, the whole layer is bf16
    down = r.for_layer("blocks.1.mlp.down")
    assert down == get_recipe("bf16").replace(
        name="fix",
        description=r.description,
        source=r.source,
        optimizer_state=r.optimizer_state,
        master_weights=r.master_weights,
        loss_scaling=r.loss_scaling,
        loss_scale=r.loss_scale,
    )
    # rule 3 after rule 2: bf16 base, then an input spec written over the (absent) input role
    q = r.for_layer("blocks.0.attn.q")
    assert q.input is not None and q.input.block == (1, 32)
    assert q.fprop.high_precision == "bf16"  # still the bf16 GEMMs: precision wins over specs
    assert r.for_layer("blocks.2.attn.q") == r.replace(layers=())


def test_with_layers_and_cell_switch_from_python():
    r = get_recipe("te-current").with_layers(
        LayerRule("blocks.0.*", changes={"grad_output": QuantSpec("e4m3")}),
        {"match": "blocks.0.mlp.up", "dgrad": {"high_precision_roles": {"grad_output": "fp32"}}},
    )
    up = r.for_layer("blocks.0.mlp.up")
    assert up.grad_output.format == "e4m3" and up.precision("dgrad", "grad_output") == "fp32"
    assert r.for_layer("blocks.1.mlp.up").grad_output == get_recipe("te-current").grad_output
    cell = get_recipe("te-current").with_cell_high_precision("wgrad", "input")
    assert cell.wgrad.high_precision_roles == (("input", "bf16"),)
    assert cell.precision("wgrad", "input") == "bf16" and cell.precision("fprop", "input") is None
    with pytest.raises(ValueError, match="not an operand of fprop"):
        cell.with_cell_high_precision("fprop", "grad_output")


BAD = [
    ('base = "te-dlayed"\n', ["base", "te-dlayed", "te-delayed"]),
    ("base = 3\n", ["'base'", "preset name"]),
    ('[[layer]]\nbase = "bf16"\n', ["[layer] 1", "match"]),
    ('[[layer]]\nmatch = "a"\nlr = 3\n', ["[layer] 1", "'lr'"]),
    ('[[layer]]\nmatch = "a"\noptimizer_state = "bf16"\n', ["[layer] 1", "whole-model"]),
    ('[[layer]]\nmatch = "a"\nbase = "nope"\n', ["[layer] 1", "nope"]),
    ('[[layer]]\nmatch = "a"\n[layer.grad_output]\nformat = "e9m9"\n', ["[[layer]] 1", "e9m9"]),
    ('[dgrad.high_precision_roles]\ngrad_output = "fp8"\n', ["high_precision", "fp8"]),
    ('[dgrad.high_precision_roles]\nbias = "bf16"\n', ["[dgrad.high_precision_roles]", "bias"]),
    ("[dgrad.high_precision_roles]\ngrad_output = 16\n", ["grad_output", "string"]),
    ('[[layer]]\nmatch = "a"\nreset = ["lr"]\n', ["[layer] 1", "'reset'", "'lr'"]),
    ('[[layer]]\nmatch = "a"\nreset = 3\n', ["[layer] 1", "'reset'", "3"]),
]


@pytest.mark.parametrize(("text", "needles"), BAD)
def test_bad_layer_files_name_the_problem(tmp_path, text, needles):
    p = tmp_path / "r.toml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeFileError) as err:
        Recipe.load(p)
    msg = str(err.value)
    assert str(p) in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_rule_free_recipes_keep_their_fingerprint():
    # no "layer" / "high_precision_roles" keys unless used: old run directories still resume
    for name in ("te-delayed", "deepseek-v3", "mxfp8"):
        d = get_recipe(name).to_dict()
        assert "layer" not in d
        assert all("high_precision_roles" not in d[g] for g in ("fprop", "dgrad", "wgrad"))


def test_reset_removes_a_key_a_merge_cannot(tmp_path):
    # deepseek-v3's accumulators promote every 128 elements; a plain fp32 accumulator has no
    # promote_every, which only a reset can express in a [[layer]] rule (TOML has no null)
    p = tmp_path / "r.toml"
    p.write_text(
        'base = "deepseek-v3"\n[[layer]]\nmatch = "blocks.0.*"\n'
        'reset = ["fprop.accumulator.promote_every"]\n'
        '[layer.fprop.accumulator]\nkind = "fp32"\n',
        encoding="utf-8",
    )
    r = Recipe.load(p)
    assert r.for_layer("blocks.0.q").fprop.accumulator.promote_every is None
    assert r.for_layer("blocks.0.q").dgrad.accumulator.promote_every == 128
    assert r.for_layer("blocks.1.q").fprop.accumulator.promote_every == 128
    back = Recipe.from_toml(r.to_toml())
    assert back.fingerprint() == r.fingerprint() and back.layers[0].reset == r.layers[0].reset
    # a rule without reset keeps its fingerprint: no "reset" key appears
    assert "reset" not in LayerRule("a", changes={"grad_output": {"scaling": "max"}}).to_dict()
