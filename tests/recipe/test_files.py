"""Recipe files and plain data: type-checked key by key, errors name the file, table and key."""

import pytest

from fp8lab.recipe import Recipe, RecipeFileError
from fp8lab.scaling.delayed import DelayedScalingConfig

BAD_FILES = [
    ("r.toml", 'attention = "yes"\n', ["[top level]", "'attention'", "bool", "'yes'"]),
    ("r.toml", 'loss_scale = "1e4"\n', ["[top level]", "'loss_scale'", "number"]),
    ("r.toml", 'save_for_backward = "fp8"\n', ["save_for_backward", "fp8"]),
    ("r.toml", 'optimiser_state = "fp32"\n', ["[top level]", "unknown Recipe keys", "optimiser"]),
    ("r.toml", '[input]\nformat = "e4m3"\nsaturate = "no"\n', ["[input]", "'saturate'", "bool"]),
    ("r.toml", '[input]\nformat = "e4m3"\nmargin = true\n', ["[input]", "'margin'", "integer"]),
    ("r.toml", '[weight]\nformatt = "e4m3"\n', ["[weight]", "unknown QuantSpec keys", "formatt"]),
    ("r.toml", '[weight]\nformat = "e9m9"\n', ["[weight]", "e9m9"]),
    ("r.toml", '[input]\ngranularity = [1, "x"]\n', ["[input]", "'granularity'"]),
    (
        "r.toml",
        '[input]\nformat = "e4m3"\n[input.scaling.delayed]\nhistory_len = "16"\n',
        ["[input.scaling.delayed]", "'history_len'", "integer"],
    ),
    (
        "r.toml",
        '[input]\nformat = "e4m3"\n[input.scaling.delayed]\nhistory = 16\n',
        ["[input.scaling.delayed]", "unknown DelayedScaling keys", "history"],
    ),
    (
        "r.toml",
        '[input]\nformat = "e4m3"\n[input.scaling.delayd]\nhistory_len = 16\n',
        ["[input.scaling]", "delayd"],
    ),
    ("r.toml", "[fprop]\nhigh_precision = 16\n", ["[fprop]", "'high_precision'", "string"]),
    (
        "r.toml",
        '[dgrad.accumulator]\nkind = "limited"\nmantissa_bits = 13.5\n',
        ["[dgrad.accumulator]", "'mantissa_bits'"],
    ),
    ("r.toml", '[dgrad.accumulator]\nkind = "fp64"\n', ["[dgrad.accumulator]", "fp64"]),
    (
        "r.toml",
        "[dgrad.overrides.grad_output]\nformat = 3\n",
        ["[dgrad.overrides.grad_output]", "'format'"],
    ),
    ("r.toml", '[dgrad.overrides.bias]\nformat = "e4m3"\n', ["[dgrad.overrides]", "bias"]),
    ("r.toml", "attention = \n", ["not valid TOML"]),
    ("r.json", '{"attention": "yes"}', ["[top level]", "'attention'"]),
    ("r.json", '{"attention": tru}', ["not valid JSON"]),
    ("r.json", "[1, 2]", ["must be a table"]),
]


@pytest.mark.parametrize(("fname", "text", "needles"), BAD_FILES)
def test_recipe_file_errors_name_the_file_table_and_key(tmp_path, fname, text, needles):
    p = tmp_path / fname
    p.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeFileError) as err:
        Recipe.load(p)
    msg = str(err.value)
    assert str(p) in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert isinstance(err.value, ValueError)  # the CLI's bad-input class


def test_missing_recipe_file_is_no_such_recipe_file(tmp_path):
    with pytest.raises(RecipeFileError, match=r"no such recipe file.*nothere\.toml"):
        Recipe.load(tmp_path / "nothere.toml")
    with pytest.raises(RecipeFileError, match="cannot read recipe file"):
        (tmp_path / "dir.toml").mkdir()
        Recipe.load(tmp_path / "dir.toml")


def test_good_recipe_file_with_every_table(tmp_path):
    text = """name = "mine"
attention = true
loss_scaling = "static"
loss_scale = 1024
[input]
format = "e4m3"
granularity = [1, 128]
scaling = "pow2_down"
[weight]
format = "e4m3"
[weight.scaling.delayed]
history_len = 16
algorithm = "most_recent"
[grad_output]
format = "e5m2"
scaling = 2.0
[dgrad]
high_precision = "bf16"
[wgrad.accumulator]
kind = "limited"
promote_every = 128
[fprop.overrides.weight]
format = "e5m2"
"""
    p = tmp_path / "mine.toml"
    p.write_text(text, encoding="utf-8")
    r = Recipe.load(p)
    assert r.attention is True and r.loss_scale == 1024.0 and r.input.granularity == (1, 128)
    assert r.weight.scaling == DelayedScalingConfig(history_len=16, algorithm="most_recent")
    assert r.grad_output.scaling == 2.0 and r.dgrad.high_precision == "bf16"
    assert r.wgrad.accumulator.promote_every == 128 and r.fprop.override("weight").format == "e5m2"
    assert Recipe.from_toml(r.to_toml()) == r
