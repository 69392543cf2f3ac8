"""The recipe key ``operand_source`` of ``[dgrad]``/``[wgrad]``: stored per role, absent from
``to_dict`` when ``auto`` (preset fingerprints unchanged), round-tripped through TOML and JSON,
accepted by ``[[layer]]`` rules, and refused with the file, table and key named when wrong."""

from __future__ import annotations

import dataclasses

import pytest

import fp8lab
from fp8lab import Recipe
from fp8lab.recipe import GemmConfig, RecipeFileError
from fp8lab.recipe.config import OPERAND_SOURCES


def test_auto_is_absent_from_plain_data_so_fingerprints_stay():
    for name in fp8lab.recipes():
        rec = fp8lab.get_recipe(name)
        assert all(rec.gemm(g).operand_source == "auto" for g in ("fprop", "dgrad", "wgrad"))
        assert "operand_source" not in rec.fingerprint(), name
    explicit = Recipe.from_dict({"base": "te-current", "wgrad": {"operand_source": "auto"}})
    assert explicit.fingerprint() == fp8lab.get_recipe("te-current").fingerprint()
    per_role = GemmConfig(operand_source={"input": "auto", "grad_output": "auto"})
    assert per_role.operand_source == "auto" and per_role == GemmConfig()


def test_one_value_is_stored_per_role_of_the_gemm():
    rec = Recipe.from_dict({"base": "deepseek-v3", "wgrad": {"operand_source": "high_precision"},
                            "dgrad": {"operand_source": "saved_dequantized"}})  # fmt: skip
    assert rec.wgrad.operand_source == (("grad_output", "high_precision"),
                                        ("input", "high_precision"))  # fmt: skip
    assert rec.dgrad.operand_source == (("weight", "saved_dequantized"),)
    assert rec.wgrad.source("input") == "high_precision" and rec.fprop.source("input") == "auto"
    table = Recipe.from_dict({"base": "deepseek-v3", "wgrad": {"operand_source": {
        "input": "high_precision", "grad_output": "high_precision"}},
        "dgrad": {"operand_source": {"weight": "saved_dequantized"}}})  # fmt: skip
    assert table == rec and table.fingerprint() == rec.fingerprint()
    assert "grad_output from high_precision" in repr(rec)


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_round_trip(fmt, tmp_path):
    rec = Recipe.from_dict(
        {
            "base": "te-delayed",
            "name": "src",
            "wgrad": {
                "operand_source": {"input": "saved_quantized", "grad_output": "high_precision"}
            },
            "dgrad": {"operand_source": "saved_dequantized"},
        }
    )
    d = rec.to_dict()
    assert d["wgrad"]["operand_source"] == {"grad_output": "high_precision",
                                            "input": "saved_quantized"}  # fmt: skip
    path = tmp_path / f"r.{fmt}"
    rec.save(path)
    back = Recipe.load(path)
    assert back == rec and back.fingerprint() == rec.fingerprint()
    assert back.fingerprint() != fp8lab.get_recipe("te-delayed").fingerprint()


def test_layer_rules_take_the_key():
    rec = Recipe.from_toml(
        """
base = "deepseek-v3"
[[layer]]
match = "blocks.0.*"
[layer.wgrad]
operand_source = { input = "high_precision" }
"""
    )
    assert rec.for_layer("blocks.0.fc").wgrad.source("input") == "high_precision"
    assert rec.for_layer("blocks.1.fc").wgrad.source("input") == "auto"
    assert Recipe.from_toml(rec.to_toml()) == rec


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[wgrad]\noperand_source = "fp8"\n', ["r.toml", "[wgrad]", "operand_source", "'fp8'"]),
        ('[wgrad]\noperand_source = 1\n', ["r.toml", "[wgrad]", "operand_source", "1"]),
        ('[wgrad.operand_source]\ninput = "x"\n',
         ["r.toml", "[wgrad]", "operand_source for input", "'x'"]),
        ('[wgrad.operand_source]\nbias = "auto"\n', ["r.toml", "wgrad.operand_source", "bias"]),
        ('[wgrad.operand_source]\nweight = "high_precision"\n',
         ["r.toml", "[wgrad]", "'weight'", "input, grad_output"]),
        ('[dgrad.operand_source]\ngrad_output = "saved_quantized"\n',
         ["r.toml", "[dgrad]", "'grad_output'", "always quantized from dy"]),
        ('[fprop]\noperand_source = "high_precision"\n', ["r.toml", "[fprop]", "fprop takes no"]),
        ('[[layer]]\nmatch = "a"\n[layer.wgrad]\noperand_source = "nope"\n',
         ["r.toml", "layer", "operand_source", "'nope'"]),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_file_table_and_key(tmp_path, text, words):
    path = tmp_path / "r.toml"
    path.write_text('base = "te-current"\n' + text, encoding="utf-8")
    with pytest.raises(RecipeFileError) as err:
        Recipe.load(path)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_python_constructors_check_the_key():
    with pytest.raises(ValueError, match="operand_source must be one of"):
        GemmConfig(operand_source="sometimes")
    with pytest.raises(ValueError, match="operand_source: role must be one of"):
        GemmConfig(operand_source={"bias": "auto"})
    with pytest.raises(ValueError, match="fprop takes no operand"):
        Recipe(fprop=GemmConfig(operand_source="saved_quantized"))
    rec = fp8lab.get_recipe("te-current")
    ok = rec.replace(wgrad=dataclasses.replace(rec.wgrad, operand_source="saved_quantized"))
    assert ok.wgrad.source("grad_output") == "saved_quantized"
    assert set(OPERAND_SOURCES) == {"auto", "high_precision", "saved_quantized",
                                    "saved_dequantized"}  # fmt: skip
