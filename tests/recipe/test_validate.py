"""One validation path for recipe files: empty files, layer rules that match nothing, shapes
that do not tile the recipe's blocks (issue 22, part C)."""

import pytest
import torch

from fp8lab.recipe import Recipe, RecipeFileError, get_recipe


def test_an_empty_toml_recipe_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "empty.toml"
    p.write_text("# nothing here\n")
    with pytest.raises(RecipeFileError, match=r"empty\.toml.*empty recipe"):
        Recipe.load(p)


def test_an_empty_json_recipe_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "empty.json"
    p.write_text("{}\n")
    with pytest.raises(RecipeFileError, match=r"empty\.json.*empty recipe"):
        Recipe.load(p)


def test_a_loaded_recipe_remembers_its_file_but_compares_equal(tmp_path):
    p = tmp_path / "r.toml"
    get_recipe("te-current").save(p)
    rec = Recipe.load(p)
    assert rec.path == str(p)
    assert rec == get_recipe("te-current")
    assert "path" not in rec.to_dict()


def test_a_layer_rule_matching_nothing_names_the_file_not_the_recipe(tmp_path):
    from fp8lab.nn import convert

    p = tmp_path / "fix.toml"
    p.write_text('base = "te-delayed"\n[[layer]]\nmatch = "nothing.*"\nbase = "bf16"\n')
    rec = Recipe.load(p)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"fix\.toml.*\[\[layer\]\] 1.*matches no") as e:
        convert(model, rec, default_exclude=False)
    assert "te-delayed-custom" not in str(e.value)


def test_check_shapes_refuses_k_or_n_that_do_not_tile_the_blocks(tmp_path):
    from fp8lab.recipe.validate import check_shapes

    rec = get_recipe("deepseek-v3")  # 1x128 activations, 128x128 weights
    check_shapes(rec, [("a", 256, 512)], tokens=256)  # tiles: no error
    with pytest.raises(RecipeFileError, match=r"recipe 'deepseek-v3'.*layer 'a'.*100"):
        check_shapes(rec, [("a", 100, 512)], tokens=256)  # K = 100
    with pytest.raises(RecipeFileError, match=r"layer 'b'.*200"):
        check_shapes(rec, [("b", 256, 200)], tokens=256)  # N = 200
    check_shapes(get_recipe("te-current"), [("a", 100, 200)], tokens=7)  # per tensor: any shape
    # wgrad taking the saved 1x128 copies dequantized quantizes nothing: 100 tokens tile no 128x1
    # block, and that is no longer asked for
    with pytest.raises(RecipeFileError, match=r"wgrad.*100"):
        check_shapes(rec, [("a", 256, 512)], tokens=100)
    deq = Recipe.from_dict(
        {"base": "deepseek-v3", "wgrad": {"operand_source": "saved_dequantized"}}
    )
    check_shapes(deq, [("a", 256, 512)], tokens=100)
