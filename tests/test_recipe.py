"""fp8lab.recipe: presets, queries, derivations, TOML/JSON round trip, bad input."""

import dataclasses
import tomllib

import pytest

import fp8lab
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe import GEMMS, GemmConfig, Recipe, get_recipe, recipes

EXPECTED = [
    "fp32",
    "bf16",
    "fp16-amp",
    "te-delayed",
    "te-delayed-hopper",
    "te-current",
    "deepseek-v3",
    "mxfp8",
    "hif8-current",
    "hif8-delayed",
    "nvfp4",
]


def test_presets_listed_and_exported():
    assert recipes() == EXPECTED
    assert fp8lab.recipes() == EXPECTED
    assert fp8lab.get_recipe("te-current") is get_recipe("te-current")
    assert fp8lab.Recipe is Recipe
    for n in EXPECTED:
        r = get_recipe(n)
        assert r.name == n and r.description and r.source  # each preset documents its source


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown recipe 'te-dlayed'.*te-delayed.*nvfp4"):
        get_recipe("te-dlayed")
    with pytest.raises(TypeError):
        get_recipe(3)


@pytest.mark.parametrize("name", EXPECTED)
def test_toml_and_json_round_trip(name, tmp_path):
    r = get_recipe(name)
    text = r.to_toml()
    tomllib.loads(text)  # valid TOML
    assert Recipe.from_toml(text) == r
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_toml(text).to_toml() == text
    for suffix in (".toml", ".json"):
        p = tmp_path / f"r{suffix}"
        r.save(p)
        assert Recipe.load(p) == r


def test_preset_contents_follow_their_sources():
    te = get_recipe("te-delayed")
    assert (te.input.format, te.weight.format, te.grad_output.format) == ("e4m3", "e4m3", "e5m2")
    ds = te.input.scaling
    assert (ds.history_len, ds.algorithm, ds.margin) == (1024, "max", 0)
    assert all(te.gemm(g).accumulator.kind == "fp32" for g in GEMMS)
    hop = get_recipe("te-delayed-hopper")
    assert hop.fprop.accumulator.kind == "limited" and hop.fprop.accumulator.promote_every is None
    assert hop.dgrad.accumulator.kind == "fp32"
    dsv3 = get_recipe("deepseek-v3")
    assert dsv3.input.granularity == (1, 128) and dsv3.weight.granularity == (128, 128)
    assert {dsv3.input.format, dsv3.weight.format, dsv3.grad_output.format} == {"e4m3"}
    assert all(dsv3.gemm(g).accumulator.promote_every == 128 for g in GEMMS)
    assert dsv3.optimizer_state == "bf16" and dsv3.master_weights == "fp32"
    mx = get_recipe("mxfp8")
    assert mx.input.granularity == "mx" and mx.input.scaling == "mx_rceil"
    hd = get_recipe("hif8-delayed").input.scaling
    assert hd.interval == 5 and 8 <= hd.nguard <= 12 and hd.first_step == "current"
    assert get_recipe("fp16-amp").loss_scaling == "dynamic"
    assert get_recipe("bf16").fprop.high_precision == "bf16"
    assert get_recipe("fp32").attention is False


def test_spec_lookup_with_override_and_high_precision():
    r = get_recipe("te-delayed")
    cur = QuantSpec("e5m2", scaling="max")
    r2 = r.with_override("dgrad", "grad_output", cur)
    assert r2.spec("dgrad", "grad_output") == cur
    assert r2.spec("wgrad", "grad_output") is r.grad_output  # the same gradient, other GEMM
    assert r2 != r and Recipe.from_toml(r2.to_toml()) == r2
    r3 = r.with_high_precision("dgrad")
    assert r3.dgrad.high_precision == "bf16" and r3.fprop.high_precision is None
    with pytest.raises(ValueError, match="not an operand"):
        r.spec("fprop", "grad_output")
    with pytest.raises(ValueError, match="unknown GEMM"):
        r.gemm("xgrad")


def test_frozen_and_readable_repr():
    r = get_recipe("te-current")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"
    text = repr(get_recipe("te-delayed").with_high_precision("dgrad"))
    assert "te-delayed" in text and "e5m2" in text and "delayed(h=1024" in text
    assert "high_precision=bf16" in text


def test_bad_recipe_fields():
    with pytest.raises(ValueError, match="save_for_backward"):
        Recipe(save_for_backward="fp8")
    with pytest.raises(ValueError, match="high_precision"):
        GemmConfig(high_precision="fp8")
    with pytest.raises(ValueError, match="override role"):
        GemmConfig(overrides={"bias": QuantSpec()})
    with pytest.raises(ValueError, match="unknown Recipe keys"):
        Recipe.from_dict({"name": "x", "fprop_acc": 1})
    with pytest.raises(ValueError, match="optimizer_state"):
        Recipe(optimizer_state="int4")
    with pytest.raises(ValueError, match="loss_scaling"):
        Recipe(loss_scaling="sometimes")
    with pytest.raises(ValueError, match=r"\.toml or \.json"):
        get_recipe("fp32").save("recipe.yaml")
