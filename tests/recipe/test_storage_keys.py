"""Recipe keys exp_avg_dtype / exp_avg_sq_dtype, moment_expansion, param_storage,
param_master_init, save_activations and master_weights fp16-scaled / none."""

from __future__ import annotations

import pytest

import fp8lab
from fp8lab import Recipe
from fp8lab.recipe import RecipeFileError

NEW_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "moment_expansion", "param_storage",
            "param_master_init", "save_activations")  # fmt: skip
OPTIONS = [
    {"exp_avg_dtype": "fp8"},
    {"exp_avg_dtype": "e4m3", "exp_avg_sq_dtype": "e5m2", "moment_expansion": True},
    {"optimizer_state": "fp8", "moment_expansion": True},
    {"param_storage": "fp8"},
    {"param_storage": "fp8", "master_weights": "none", "param_master_init": "from_fp8"},
    {"master_weights": "fp16-scaled"},
    {"save_activations": "quantized"},
]


@pytest.mark.no_arithmetic
def test_absent_at_default_so_presets_keep_their_fingerprints():
    from fp8lab.recipe.presets import recipes

    for name in recipes():
        d = fp8lab.get_recipe(name).to_dict()
        assert not set(NEW_KEYS) & set(d)
        assert "optimizer_state" in d


@pytest.mark.no_arithmetic
@pytest.mark.parametrize("kw", OPTIONS)
def test_round_trip_through_toml_and_json(kw):
    r = fp8lab.get_recipe("te-current").replace(**kw)
    assert Recipe.from_toml(r.to_toml()) == r and Recipe.from_json(r.to_json()) == r
    assert r.fingerprint() != fp8lab.get_recipe("te-current").fingerprint()
    assert Recipe.from_toml(r.to_toml()).fingerprint() == r.fingerprint()


@pytest.mark.no_arithmetic
def test_per_moment_dtypes_and_the_exclusive_forms():
    r = Recipe.from_toml('base = "deepseek-v3"\nexp_avg_dtype = "fp8"\n')
    assert r.moment_dtypes == ("fp8", "fp32")  # the base's optimizer_state gives way
    assert fp8lab.get_recipe("deepseek-v3").moment_dtypes == ("bf16", "bf16")
    with pytest.raises(RecipeFileError, match="not both"):
        Recipe.from_toml(
            'base = "te-current"\noptimizer_state = "bf16"\nexp_avg_sq_dtype = "fp8"\n'
        )
    with pytest.raises(ValueError, match="not both"):
        Recipe(optimizer_state="bf16", exp_avg_dtype="fp8")
    with pytest.raises(RecipeFileError, match=r"exp_avg_dtype must be one of .*'fp7'"):
        Recipe.from_toml('base = "te-current"\nexp_avg_dtype = "fp7"\n', where="f.toml")
    with pytest.raises(RecipeFileError, match=r"exp_avg_dtype.*expected a string"):
        Recipe.from_toml('base = "te-current"\nexp_avg_dtype = 8\n')
    with pytest.raises(ValueError, match="moment_expansion"):
        Recipe(optimizer_state="bf16", moment_expansion=True)
    with pytest.raises(RecipeFileError, match="whole-model"):
        Recipe.from_toml('base = "te-current"\n[[layer]]\nmatch = "x"\nparam_storage = "fp8"\n')


@pytest.mark.no_arithmetic
def test_param_storage_needs_codes_and_master_none_needs_fp8_storage():
    with pytest.raises(ValueError, match="no such codes"):
        Recipe(param_storage="fp8")  # no weight spec
    with pytest.raises(ValueError, match="weight format bf16"):
        Recipe(weight="bf16", param_storage="fp8")
    with pytest.raises(ValueError, match="needs param_storage"):
        fp8lab.get_recipe("te-current").replace(master_weights="none")
    with pytest.raises(ValueError, match="param_storage = 'fp8'"):
        fp8lab.get_recipe("te-current").replace(param_master_init="from_fp8")
