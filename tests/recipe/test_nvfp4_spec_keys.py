"""The NVFP4 QuantSpec keys (rht, four_over_six, four_over_six_use_256, row_scaled, hadamard) in
recipe TOML role tables: round trip, type errors and combination errors naming table and key."""

from __future__ import annotations

import dataclasses

import pytest

from fp8lab import QuantSpec
from fp8lab.recipe import Recipe, RecipeFileError, get_recipe

pytestmark = pytest.mark.no_arithmetic


def _recipe() -> Recipe:
    return dataclasses.replace(
        get_recipe("nvfp4"),
        input=QuantSpec("e2m1", "nvfp4", "nvfp4", row_scaled=True),
        weight=QuantSpec(
            "e2m1", (16, 16), "nvfp4", four_over_six="mse", four_over_six_use_256=False
        ),
        grad_output=QuantSpec("e2m1", "nvfp4", "nvfp4", rht=True),
    )


def test_toml_round_trip_and_plain_presets_unchanged():
    r = _recipe()
    text = r.to_toml()
    assert 'four_over_six = "mse"' in text and "four_over_six_use_256 = false" in text
    assert Recipe.from_toml(text) == r
    q = dataclasses.replace(r, input=QuantSpec("e2m1", "mx", "quest", hadamard=32))
    assert Recipe.from_toml(q.to_toml()) == q
    assert "rht" not in get_recipe("nvfp4").to_toml()


def test_bad_keys_name_table_and_key():
    text = _recipe().to_toml()
    with pytest.raises(RecipeFileError, match=r"\[weight\] key 'four_over_six': expected a string"):
        Recipe.from_toml(text.replace('four_over_six = "mse"', "four_over_six = 3"))
    with pytest.raises(RecipeFileError, match=r"\[grad_output\] rht=True with four_over_six"):
        Recipe.from_toml(text.replace("rht = true", 'rht = true\nfour_over_six = "mae"'))
    with pytest.raises(RecipeFileError, match=r"\[input\] key 'row_scaled': expected a bool"):
        Recipe.from_toml(text.replace("row_scaled = true", 'row_scaled = "yes"'))
