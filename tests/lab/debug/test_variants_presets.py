"""Every counterfactual variant of the debugger, of every preset, without a model.

`variants.per_layer` checks that each chosen layer runs the intended recipe and raises otherwise;
before per-layer rules could reset a key, the fake-quantization variant of any preset whose
accumulator has ``promote_every`` (deepseek-v3, ...) raised here, and ``fp8lab debug`` exited 1.
The variants must also survive the fix file's round trip (TOML), since that is what a user
converts their model with.
"""

from __future__ import annotations

import pytest

import fp8lab
from fp8lab.lab.debug import remedies, variants
from fp8lab.recipe import LayerRule, Recipe, get_recipe

LAYERS = ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "lm_head"]


def _variants(rec: Recipe) -> dict[str, Recipe]:
    """Every variant the debugger builds (`method` and `remedies`), on ``LAYERS``."""
    hp = variants.hp_precision(get_recipe("bf16"))
    out = {"fake-quant": variants.per_layer(rec, LAYERS, variants.fake_quant_recipe, "fq")}
    out["all-cells"] = variants.cells_hp(rec, {x: list(variants.CELLS) for x in LAYERS}, hp, "x")
    for g, r in variants.CELLS:
        out[f"cell-{g}-{r}"] = variants.cells_hp(rec, {LAYERS[0]: [(g, r)]}, hp, "x")
    for r in variants.ROLES:
        cells = {x: [(g, r) for g in variants.ROLE_GEMMS[r]] for x in LAYERS[1:]}
        out[f"role-{r}"] = variants.cells_hp(rec, cells, hp, "x")
        for g in (None, *variants.ROLE_GEMMS[r]):
            for name, v in remedies.remedy_variants(rec, r, g, LAYERS[:2], hp).items():
                out[f"remedy-{r}-{g}-{name}"] = v
    return out


def _bases(name: str) -> list[Recipe]:
    """The preset as is, and with a rule of its own on one layer (a variant keeps it)."""
    rec = get_recipe(name)
    ruled = rec.with_layers(LayerRule(LAYERS[1], base="bf16"))
    return [rec, ruled]


@pytest.mark.parametrize("name", fp8lab.recipes())
def test_every_variant_of_every_preset_runs_the_intended_recipe(name: str) -> None:
    for rec in _bases(name):
        built = _variants(rec)  # per_layer raises naming the layer on a mismatch
        assert "fake-quant" in built
        for kind, v in built.items():
            back = Recipe.from_toml(v.to_toml())  # what the fix file holds reads back
            for layer in [*LAYERS, "other"]:
                assert back.for_layer(layer).fingerprint() == v.for_layer(layer).fingerprint(), (
                    name,
                    kind,
                    layer,
                )


@pytest.mark.parametrize("name", fp8lab.recipes())
def test_fake_quant_variant_is_fake_quant_recipe_on_each_layer(name: str) -> None:
    rec = get_recipe(name)
    v = variants.per_layer(rec, LAYERS[:2], variants.fake_quant_recipe, "fq")
    want = variants.fake_quant_recipe(rec)
    for layer in LAYERS[:2]:
        got = v.for_layer(layer)
        assert got.fingerprint() == want.fingerprint()
        assert all(got.gemm(g).accumulator.promote_every is None for g in variants.GEMMS)
    assert v.for_layer(LAYERS[2]).fingerprint() == rec.fingerprint()  # untouched


def test_the_reported_reproduction() -> None:
    v = variants.per_layer(get_recipe("deepseek-v3"), ["x.a"], variants.fake_quant_recipe, "fq")
    (rule,) = v.layers
    assert set(rule.reset) == {f"{g}.accumulator.promote_every" for g in variants.GEMMS}
