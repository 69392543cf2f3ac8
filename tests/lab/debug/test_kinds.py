"""The debugger's vocabulary beyond one operand (`fp8lab.lab.debug.kinds`), the new remedies
(`fp8lab.lab.debug.remedies`) and the gallery scenarios' expectations
(`fp8lab.lab.debug.scenarios`): no training."""

from __future__ import annotations

import pytest

from fp8lab.lab.debug import kinds
from fp8lab.lab.debug.remedies import REMEDIES, remedy_variants
from fp8lab.lab.debug.scenarios import GALLERY, SCENARIOS, check_verdict, plant, resolve_expect
from fp8lab.lab.debug.variants import attention_hp, dynamic_loss_scaling, shorter_history
from fp8lab.lab.train import LabConfig
from fp8lab.recipe import get_recipe
from fp8lab.scaling.delayed import DelayedScalingConfig

LAYERS = [f"blocks.{i}.{m}" for i in range(3)
          for m in ("attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down")]  # fmt: skip


def _rec(step, layer, role, amax, gemm="fprop"):
    return {"step": step, "layer": layer, "gemm": gemm, "role": role, "amax": amax}


def test_vocabulary_names():
    assert kinds.CULPRIT_KINDS == ("operand", "norm_weight", "attention", "loss_scale")
    assert kinds.ATTENTION_TENSORS == ("Q", "K", "V", "S", "dP")
    for r in ("dynamic-loss-scaling", "shorter-history", "norm-weights-high-precision",
              "attention-high-precision", "last-blocks-high-precision"):  # fmt: skip
        assert r in REMEDIES
    # the remedies the debugger had keep their order (ties between equal costs)
    assert REMEDIES[:5] == ("current-scaling", "finer-granularity", "e5m2-gradients",
                            "high-precision-cells", "high-precision-role")  # fmt: skip


def test_amax_fell_is_a_gradual_fall_not_a_spike():
    fall = [_rec(s, "a", "input", a) for s, a in [(10, 8.0), (20, 6.0), (30, 3.0), (40, 1.0)]]
    spike = [_rec(s, "b", "input", a) for s, a in [(10, 1.0), (20, 100.0), (30, 1.0), (40, 1.0)]]
    flat = [_rec(s, "c", "input", 1.0) for s in (10, 20, 30)]
    recs = fall + spike + flat + [_rec(10, "a", "weight", 50.0)]
    assert kinds.amax_fell(recs, "input", ["a", "b", "c"]) == ["a"]
    # the largest over the GEMMs of a step counts
    recs2 = [*fall, _rec(40, "a", "input", 9.0, gemm="wgrad")]
    assert kinds.amax_fell(recs2, "input", ["a"]) == []


def test_grown_layers_largest_first_within_half_the_log_growth():
    recs = []
    for layer, (a0, a1) in {"blocks.0.mlp.down": (1.0, 100.0), "blocks.1.mlp.down": (1.0, 20.0),
                            "blocks.2.mlp.down": (1.0, 2.0), "blocks.0.attn.proj": (1.0, 1e4)}.items():  # fmt: skip
        recs += [_rec(10, layer, "input", a0), _rec(90, layer, "input", a1)]
    # log growths 4.6, 3.0, 0.69 against the largest mlp.down's 4.6: half is 2.3
    assert kinds.grown_layers(recs, "input", "mlp.down") == ["blocks.0.mlp.down",
                                                             "blocks.1.mlp.down"]  # fmt: skip
    assert kinds.grown_layers([], "input") == []


def test_attention_tensor_is_the_worst_quantized_at_the_last_step():
    recs = [{**_rec(10, "blocks.0.attn.dpa", "S", 1.0, gemm="dpa"), "underflow_pct": 90.0},
            {**_rec(20, "blocks.0.attn.dpa", "S", 1.0, gemm="dpa"), "underflow_pct": 5.0},
            {**_rec(20, "blocks.1.attn.dpa", "K", 1.0, gemm="dpa"), "saturation_pct": 7.0},
            {**_rec(20, "blocks.1.attn.dpa", "O", 1.0, gemm="dpa"), "underflow_pct": 99.0},
            {**_rec(20, "blocks.1.mlp.up", "input", 1.0), "underflow_pct": 99.0}]  # fmt: skip
    assert kinds.attention_tensor(recs) == "K"
    assert kinds.attention_tensor(recs[-1:]) is None


def test_block_index_and_last_blocks():
    assert kinds.block_index("model.model.layers.11.mlp.up_proj") == 11
    assert kinds.block_index("lm_head") is None
    assert kinds.last_blocks(LAYERS, ["blocks.1.mlp.up", "blocks.2.mlp.down"]) == LAYERS[5:]
    assert kinds.last_blocks(LAYERS, ["blocks.0.mlp.up"]) == []


def test_kind_probes_follow_the_recipe():
    assert kinds.kind_probes(get_recipe("te-delayed")) == {}
    r = get_recipe("mxfp8").replace(norm_weights="quantized", attention=True)
    probes = kinds.kind_probes(r)
    assert set(probes) == {"norm_weight", "attention"}
    assert probes["norm_weight"].norm_weights == "high_precision"
    assert (
        probes["attention"].attention is False and probes["attention"].norm_weights == "quantized"
    )
    s = get_recipe("fp16-amp").replace(loss_scaling="static", loss_scale=1.0)
    d = kinds.kind_probes(s)["loss_scale"]
    assert (d.loss_scaling, d.loss_scale) == ("dynamic", 2.0**16)
    assert dynamic_loss_scaling(d) is d and attention_hp(s) is s


def test_shorter_history_only_on_delayed_specs():
    r = get_recipe("te-delayed")
    v = shorter_history(r, ("input",), 16)
    assert isinstance(v.input.scaling, DelayedScalingConfig) and v.input.scaling.history_len == 16
    assert v.grad_output == r.grad_output
    c = get_recipe("te-current")
    assert shorter_history(c, ("input",), 16).fingerprint() == c.fingerprint()


def test_remedy_variants_offer_shorter_history_where_amax_fell_and_last_blocks_for_fp4():
    r = get_recipe("te-delayed")
    layers = ["blocks.2.mlp.down"]
    assert "shorter-history" not in remedy_variants(r, "input", "fprop", layers, "bf16")
    got = remedy_variants(r, "input", "fprop", layers, "bf16", fell=layers, all_layers=LAYERS)
    assert "shorter-history" in got and "last-blocks-high-precision" not in got
    assert got["shorter-history"].for_layer(layers[0]).input.scaling.history_len == 16
    assert got["shorter-history"].for_layer("blocks.1.mlp.down").input.scaling.history_len == 1024
    n = get_recipe("nvfp4")
    got = remedy_variants(n, "grad_output", "wgrad", ["blocks.1.mlp.up", "blocks.2.mlp.down"],
                          "bf16", all_layers=LAYERS)  # fmt: skip
    tail = got["last-blocks-high-precision"]
    assert tail.for_layer("blocks.1.attn.qkv").gemm("fprop").high_precision_roles
    assert tail.for_layer("blocks.0.attn.qkv").fingerprint() == n.for_layer("x").fingerprint()


def _result(culprit, best=None):
    return {"culprit": culprit, "details": {"best_remedy": best}}


def test_check_verdict():
    exp = {"kind": "loss_scale", "layers": [], "remedy": "dynamic-loss-scaling"}
    ok = _result({"kind": "loss_scale", "role": None, "gemm": None, "layers": []},
                 "dynamic-loss-scaling")  # fmt: skip
    assert check_verdict(exp, ok)["right"]
    wrong = _result({"role": "grad_output", "gemm": "wgrad", "layers": ["a"]}, "current-scaling")
    v = check_verdict(exp, wrong)
    assert not v["right"] and len(v["why"]) == 3
    op = {"role": "input", "gemm": "fprop", "layers": ["x", "y"]}
    assert check_verdict(op, _result({"role": "input", "gemm": "fprop", "layers": ["x", "z"]}))[
        "right"
    ]  # one extra: allowed
    assert not check_verdict(op, _result({"role": "input", "gemm": "fprop",
                                          "layers": ["y", "z", "w"]}))["right"]  # fmt: skip
    both = {"remedy": ("shorter-history", "current-scaling")}
    assert check_verdict(both, _result({"role": "input", "gemm": "fprop", "layers": []},
                                       "current-scaling"))["right"]  # fmt: skip
    assert not check_verdict(exp, {"culprit": None})["right"]


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_scenarios_plant_without_training(tmp_path, name):
    assert name in SCENARIOS
    cfg = LabConfig().with_overrides(["model.n_layer=2", "model.d_model=128", "model.d_ff=256"])
    recipe, cfg2, expect = plant(name, cfg)
    assert "fixed" in expect and expect.get("kind", "operand") in kinds.CULPRIT_KINDS
    plain = resolve_expect(expect, tmp_path)  # no records: a computed list is empty
    assert "fixed" not in plain and isinstance(plain.get("layers", []), list | str)
    if name == "mx-layernorm-affine":
        assert cfg2.model.norm == "layernorm" and recipe.norm_weights == "quantized"
        assert plain["layers"] == ["blocks.0.attn_norm", "blocks.0.mlp_norm",
                                   "blocks.1.attn_norm", "blocks.1.mlp_norm"]  # fmt: skip
    if name == "nvfp4-all-layers":
        assert plain["layers"] and all(x.startswith("blocks.1.") for x in plain["layers"])
    if name == "fp16-loss-scale":
        assert recipe.loss_scaling == "static" and plain["layers"] == []
