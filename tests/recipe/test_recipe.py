"""fp8lab.recipe: presets, queries, derivations, TOML/JSON round trip, bad input."""

import dataclasses
import hashlib
import tomllib

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe import GEMMS, GemmConfig, Recipe, get_recipe, recipes
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

EXPECTED = [
    "fp32",
    "bf16",
    "fp16-amp",
    "te-delayed",
    "te-delayed-hopper",
    "te-current",
    "deepseek-v3",
    "deepseek-v3-h100",
    "mxfp8",
    "hif8-current",
    "hif8-delayed",
    "nvfp4",
    "nvfp4-te",
    "nvfp4-paper",
    "nvfp4-bare",
    "nvfp4-4over6",
    "torchao-tensorwise",
    "torchao-rowwise",
    "torchao-rowwise-gw-hp",
    "mxfp8-2d",
    "mxfp4",
    "mxfp4-quartet",
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
    # Hopper's fast FP8 accumulation in fprop, never promoted: the H100 tensor-core model
    assert hop.fprop.accumulator.kind == "fused" and hop.fprop.accumulator.promote_every is None
    assert hop.fprop.accumulator.hardware == "h100"
    assert hop.dgrad.accumulator.kind == "fp32"
    dsv3 = get_recipe("deepseek-v3")
    assert dsv3.input.granularity == (1, 128) and dsv3.weight.granularity == (128, 128)
    assert {dsv3.input.format, dsv3.weight.format, dsv3.grad_output.format} == {"e4m3"}
    assert all(dsv3.gemm(g).accumulator.promote_every == 128 for g in GEMMS)
    h = get_recipe("deepseek-v3-h100")
    assert (
        h.replace(name="deepseek-v3", description=dsv3.description, source=dsv3.source).replace(
            **{g: dsv3.gemm(g) for g in GEMMS}
        )
        == dsv3
    )  # deepseek-v3 but for the accumulator
    assert all(h.gemm(g).accumulator.hardware == "h100" for g in GEMMS)
    assert all(h.gemm(g).accumulator.promote_every == 128 for g in GEMMS)
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


# ------------------------------------------------------------------ configuration, not state
def test_quantizing_with_a_preset_spec_leaves_presets_and_other_callers_unchanged():
    # issue 11 item 4: presets are immutable configuration; the history belongs to whoever
    # quantizes, so a caller quantizing under a preset spec writes into nobody's state
    preset = get_recipe("te-delayed")
    before, h = preset.to_dict(), hash(preset)
    mine = DelayedScaling.bind(preset.input.scaling, "e4m3")  # another caller's own state
    ref = DelayedScaling.bind(preset.input.scaling, "e4m3")  # the same caller, undisturbed
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        y = torch.randn(16, 32, generator=g) * (step + 1)
        q_mine = fp8lab.quantize(y, preset.input.replace(scaling=mine))
        # someone else quantizes huge tensors under the shared preset's spec in between
        for big in (1e4, 1e6):
            qb = fp8lab.quantize(y * big, get_recipe("te-delayed").input)
            assert qb.scales.item() == 1.0  # step 0 of a throwaway state (first_step="unit")
        q_ref = fp8lab.quantize(y, preset.input.replace(scaling=ref))
        assert torch.equal(q_mine.values, q_ref.values) and torch.equal(q_mine.scales, q_ref.scales)
        mine.update()
        ref.update()
        assert torch.equal(mine.amax_history, ref.amax_history)
    sc = get_recipe("te-delayed").input.scaling
    assert isinstance(sc, DelayedScalingConfig) and not hasattr(sc, "amax_history")
    assert get_recipe("te-delayed") is preset and preset.to_dict() == before and hash(preset) == h
    # first_step="current" presets: a throwaway state gives current scaling with the margin
    hd = get_recipe("hif8-delayed").input
    x = torch.tensor([3.0, -1.0])
    q = fp8lab.quantize(x, hd)
    s = float(np.float32(fp8lab.get_format("hif8").max * 2.0**-8) / np.float32(3.0))
    assert q.scale_multipliers.item() == s
    assert fp8lab.quantize(x, hd).scale_multipliers.item() == s  # nothing was recorded


def test_recipe_holds_configuration_only_and_compares_as_data():
    ds = DelayedScaling(history_len=16, margin=1)
    ds.observe(5.0)
    r = Recipe(name="mine", input=QuantSpec("e4m3", scaling=ds), weight="e4m3")
    assert r.input.scaling == ds.cfg and isinstance(r.input.scaling, DelayedScalingConfig)
    back = Recipe.from_toml(r.to_toml())
    assert back == r and hash(back) == hash(r)
    assert (
        r.with_override("dgrad", "weight", QuantSpec("e5m2", scaling=ds))
        .dgrad.overrides[0][1]
        .scaling
        == ds.cfg
    )
    for name in EXPECTED:  # dataclass equality and hashing, no serialisation involved
        p = get_recipe(name)
        assert Recipe.from_json(p.to_json()) == p and hash(Recipe.from_json(p.to_json())) == hash(p)


# sha256[:16] of each preset's fingerprint before save_for_backward's default changed (run
# directories resume on the fingerprint). te-delayed-hopper is left out: its accumulator model
# is being changed on purpose.
PRESET_FINGERPRINTS = {
    "bf16": "eb27dc2bcbcac15d",
    "deepseek-v3": "824765465c5b8045",
    "fp16-amp": "bc3d30ebd232293a",
    "fp32": "d514ac1651d3e08e",
    "hif8-current": "d58126ec0bd7e773",
    "hif8-delayed": "169c58b34aa2ac5c",
    "mxfp8": "86fffb55113c6585",
    "nvfp4": "269a370df028ee6b",
    "te-current": "4ae7ca2ff421cf26",
    "te-delayed": "4a58486ca4a539b7",
}


def test_save_for_backward_defaults_to_high_precision_and_presets_keep_theirs():
    assert Recipe().save_for_backward == "high_precision"  # TE / torchao behaviour
    assert Recipe.from_dict({"name": "x"}).save_for_backward == "high_precision"
    hp = {"mxfp8", "nvfp4", *EXPECTED[EXPECTED.index("nvfp4") :]}
    for name in EXPECTED:
        want = "high_precision" if name in hp else "quantized"
        assert get_recipe(name).save_for_backward == want, name
    for name, digest in PRESET_FINGERPRINTS.items():
        fp = get_recipe(name).fingerprint().encode()
        assert hashlib.sha256(fp).hexdigest()[:16] == digest, name
