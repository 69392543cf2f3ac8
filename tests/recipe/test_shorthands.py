"""Recipe keys of issue 33: ``backward_override`` (TE's), ``rht_gemms``, ``hp_last_blocks`` /
``hp_first_blocks``, and the new presets' pinned fingerprints. None of them serialises at its
default, so every earlier preset's fingerprint is unchanged (tests/recipe/test_recipe.py)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from typer.testing import CliRunner

import fp8lab
from fp8lab import Recipe
from fp8lab.cli import app
from fp8lab.recipe import GemmConfig, RecipeFileError

# sha256[:16] of each new preset's fingerprint (run directories resume on it)
NEW_PRESET_FINGERPRINTS = {
    "nvfp4-te": "2a6eac5909c573f1",
    "nvfp4-paper": "8df04378285440e0",
    "nvfp4-4over6": "6d40ad2f26b17bc3",
    "mxfp4-quartet": "92dde3401887f599",
    "nvfp4-bare": "bd87ad3006439ef0",
    "torchao-tensorwise": "ba50fe9574e57530",
    "torchao-rowwise": "5bf0d2c8b51163bb",
    "torchao-rowwise-gw-hp": "986d238c4c5bd39a",
    "mxfp8-2d": "9dbe45c6c8eb82a5",
    "mxfp4": "2b49007692eae67a",
}


def test_new_preset_fingerprints_are_pinned():
    for name, digest in NEW_PRESET_FINGERPRINTS.items():
        fp = fp8lab.get_recipe(name).fingerprint().encode()
        assert hashlib.sha256(fp).hexdigest()[:16] == digest, name


@pytest.mark.no_arithmetic
def test_new_keys_are_absent_at_their_defaults():
    d = Recipe().to_dict()
    for k in ("backward_override", "rht_gemms", "hp_last_blocks", "hp_first_blocks"):
        assert k not in d
    r = fp8lab.get_recipe("nvfp4-bare").replace(hp_last_blocks=None, hp_first_blocks=1)
    d = r.to_dict()
    assert d["hp_last_blocks"] == "auto" and d["hp_first_blocks"] == 1  # TOML has no null
    assert Recipe.from_toml(r.to_toml()) == r
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_dict({**d, "hp_last_blocks": None}) == r  # JSON null reads as None too
    assert r.fingerprint() != fp8lab.get_recipe("nvfp4-bare").fingerprint()


@pytest.mark.no_arithmetic
@pytest.mark.parametrize("preset", ["te-current", "mxfp8", "nvfp4", "deepseek-v3"])
def test_backward_override_is_the_expanded_recipe(preset):
    base = fp8lab.get_recipe(preset)
    hp = base.replace(backward_override="high_precision")
    deq = base.replace(backward_override="dequantized")
    want_hp = base.with_high_precision("dgrad", "wgrad", precision="bf16")
    src = {g: dataclasses.replace(want_hp.gemm(g), operand_source="saved_dequantized")
           for g in ("dgrad", "wgrad")}  # fmt: skip
    want_deq = want_hp.replace(**src)
    assert (hp.dgrad, hp.wgrad) == (want_hp.dgrad, want_hp.wgrad)
    assert (deq.dgrad, deq.wgrad) == (want_deq.dgrad, want_deq.wgrad)
    assert deq.wgrad.source("input") == "saved_dequantized" == deq.dgrad.source("weight")
    # same numerics, same fingerprint; the shorthand stays in the file
    assert hp.fingerprint() == want_hp.fingerprint() and deq.fingerprint() == want_deq.fingerprint()
    for r in (hp, deq):
        assert Recipe.from_toml(r.to_toml()) == r
        assert r.to_dict()["backward_override"] == r.backward_override


@pytest.mark.no_arithmetic
@pytest.mark.parametrize(
    ("plain", "match"),
    [
        ({"base": "te-current", "backward_override": "bf16"}, "backward_override must be one of"),
        ({"base": "te-delayed", "backward_override": "dequantized"}, "Delayed.*supports only"),
        ({"base": "hif8-delayed", "backward_override": "high_precision"}, "delayed scaling"),
        ({"base": "te-current", "backward_override": "high_precision",
          "dgrad": {"high_precision": "fp32"}}, r"\[dgrad\] high_precision = 'fp32'"),
        ({"base": "te-current", "backward_override": "dequantized",
          "wgrad": {"operand_source": {"input": "high_precision"}}}, "operand_source"),
        ({"base": "nvfp4", "rht_gemms": "all"}, "rht_gemms must be one of"),
        ({"base": "nvfp4", "rht_gemms": "wgrad",
          "wgrad": {"high_precision_roles": {"input": "bf16"}}}, "transforms both wgrad operands"),
        ({"base": "nvfp4", "rht_gemms": "wgrad",
          "wgrad": {"operand_source": "saved_quantized"}}, "from the high-precision"),
        ({"base": "nvfp4", "hp_last_blocks": -1}, "hp_last_blocks must be an integer >= 0"),
        ({"base": "nvfp4", "hp_last_blocks": "all"}, "hp_last_blocks must be"),
        ({"base": "nvfp4", "hp_first_blocks": 1.5}, "hp_first_blocks"),
    ],
)  # fmt: skip
def test_bad_values_name_the_file_and_key(plain, match):
    with pytest.raises(RecipeFileError, match=match) as e:
        Recipe.from_dict(plain, where="recipe file 'fix.toml'")
    assert "fix.toml" in str(e.value)


@pytest.mark.no_arithmetic
def test_the_cli_refuses_a_bad_backward_override_with_exit_2(tmp_path):
    f = tmp_path / "fix.toml"
    f.write_text('base = "te-delayed"\nbackward_override = "dequantized"\n')
    small = ["--hidden", "512", "--ffn", "1024", "--layers", "2", "--tokens", "1024"]
    res = CliRunner().invoke(app, ["cost", "--recipes", str(f), *small])
    assert res.exit_code == 2, res.output
    assert "fix.toml" in res.stderr and "backward_override" in res.stderr
    assert res.stderr.count("Error:") == 1


@pytest.mark.no_arithmetic
def test_rht_gemms_leaves_a_high_precision_wgrad_alone():
    # the expansion of backward_override runs wgrad in bf16: nothing to transform there
    r = fp8lab.get_recipe("te-current").replace(rht_gemms="wgrad", backward_override="dequantized")
    assert r.wgrad == r.replace(rht_gemms="none").wgrad
    assert r.spec("wgrad", "input") == r.input  # no rht on a high-precision GEMM's operand
    assert GemmConfig(high_precision="bf16").high_precision == r.wgrad.high_precision
