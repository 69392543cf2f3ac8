"""The recipe files under examples/ load, round-trip and differ from their preset as they say."""

from pathlib import Path

import pytest

import fp8lab
from fp8lab.lab.compare import resolve_recipe

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "recipes").glob("*.toml"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipe_loads_and_round_trips(path):
    r = resolve_recipe(str(path))
    assert r.name == path.stem
    assert fp8lab.Recipe.from_toml(r.to_toml()).to_dict() == r.to_dict()


def test_hif8_g12_differs_from_the_preset_only_in_nguard():
    r = resolve_recipe(str(EXAMPLES[[p.stem for p in EXAMPLES].index("hif8-delayed-g12")]))
    preset = fp8lab.get_recipe("hif8-delayed")
    for role in ("input", "weight", "grad_output"):
        got, want = getattr(r, role), getattr(preset, role)
        assert got.scaling.nguard == 12 and want.scaling.nguard == 8
        assert got.format == want.format == "hif8" and got.rounding == want.rounding
        assert got.scaling.interval == want.scaling.interval
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert getattr(r, gemm).to_dict() == getattr(preset, gemm).to_dict()
