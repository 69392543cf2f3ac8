"""fix.megatron.yaml and fix.te.yaml against schemas written from the two projects' code and
documentation (no GPU, no Megatron, no TE):

- Megatron-LM ``megatron/core/quantization/quant_config.py`` (``RecipeConfig.from_config_dict``:
  ``configs`` and ordered ``matchers`` of ``type: glob`` with ``pattern``, ``config``,
  ``enabled``; ``GlobMatcher``: ``fnmatch`` on the module path, the first match wins) and
  ``megatron/core/extensions/transformer_engine.py`` (``TEQuantizationParams.parse_from_config``:
  ``transformer_engine_config_type: TEQuantizationParams``, ``training_recipe`` and optionally
  ``evaluation_recipe``, nothing else; ``TEQuantizationRecipe`` fields; delayed scaling refused;
  FP8 and FP4 exclusive; ``fp8_format`` e4m3 | hybrid);
- Transformer Engine's debug config (user guide, debug/2_config_file_structure and
  3_api_features, release 2.4): sections with ``enabled``, ``layers`` (``layer_name_regex_pattern``
  or ``layer_types``) and a ``transformer_engine`` namespace of features with their parameters.
"""

from __future__ import annotations

import fnmatch
import re

import pytest

from fp8lab.lab.debug.export import export_fix, megatron_module
from fp8lab.lab.debug.variants import (
    all_hp,
    cells_hp,
    current_scaling,
    dynamic_loss_scaling,
    finer_granularity,
    per_layer,
    shorter_history,
)
from fp8lab.recipe import get_recipe

yaml = pytest.importorskip("yaml")

LAYERS = [f"blocks.{i}.{m}" for i in range(3)
          for m in ("attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down")]  # fmt: skip

# ----------------------------------------------------------------------------- schemas
RECIPE_FIELDS = {"fp8_quantization_recipe", "fp4_quantization_recipe", "custom_recipe_factory",
                 "fp8_format", "override_quantized_autocast", "override_nonquantized_autocast",
                 "tp_only_amax_red"}  # fmt: skip
FP8_RECIPES = {"tensorwise", "blockwise", "mxfp8", "custom"}  # Fp8Recipe minus delayed
TE_FEATURES = {
    "DisableFP8GEMM": {"enabled", "gemms"},
    "DisableFP8Layer": {"enabled"},
    "PerTensorScaling": {"enabled", "gemms", "tensors"},
}
GEMMS = {"fprop", "dgrad", "wgrad"}
TENSORS = {"activation", "gradient", "weight"}


def megatron_config(text: str) -> dict:
    d = yaml.safe_load(text)
    assert set(d) <= {"configs", "matchers"}
    configs, matchers = d.get("configs") or {}, d.get("matchers") or {}
    for payload in configs.values():
        assert payload["transformer_engine_config_type"] == "TEQuantizationParams"
        assert set(payload) in ({"transformer_engine_config_type", "training_recipe"},
                                {"transformer_engine_config_type", "training_recipe",
                                 "evaluation_recipe"})  # fmt: skip
        rec = payload["training_recipe"]
        assert set(rec) <= RECIPE_FIELDS
        fp8, fp4 = rec.get("fp8_quantization_recipe"), rec.get("fp4_quantization_recipe")
        assert fp8 is None or fp8 in FP8_RECIPES
        assert fp4 is None or fp4 in {"nvfp4", "custom"}
        assert fp8 is None or fp4 is None
        assert rec.get("fp8_format", "e4m3") in {"e4m3", "hybrid"}
    for m in matchers.values():
        assert set(m) == {"config", "type", "pattern", "enabled"}
        assert m["type"] == "glob" and isinstance(m["pattern"], str)
        assert m["config"] in configs and isinstance(m["enabled"], bool)
    return d


def megatron_match(d: dict, module_path: str) -> dict | None:
    """quant_config.RecipeConfig.match: the first enabled glob matcher's payload."""
    for m in (d.get("matchers") or {}).values():
        if m["enabled"] and fnmatch.fnmatch(module_path, m["pattern"]):
            return d["configs"][m["config"]]["training_recipe"]
    return None


def te_config(text: str) -> dict:
    d = yaml.safe_load(text) or {}
    for sec in d.values():
        assert set(sec) == {"enabled", "layers", "transformer_engine"}
        assert isinstance(sec["enabled"], bool)
        assert set(sec["layers"]) <= {"layer_name_regex_pattern", "layer_types"}
        re.compile(sec["layers"]["layer_name_regex_pattern"])
        for name, params in sec["transformer_engine"].items():
            assert set(params) <= TE_FEATURES[name], name
            assert set(params.get("gemms", [])) <= GEMMS
            assert set(params.get("tensors", [])) <= TENSORS
    return d


def te_match(d: dict, layer: str) -> dict | None:
    """The features of the section whose regex matches ``layer`` (one at most)."""
    hits = [s["transformer_engine"] for s in d.values()
            if re.search(s["layers"]["layer_name_regex_pattern"], layer)]  # fmt: skip
    assert len(hits) <= 1  # a layer belongs to one section
    return hits[0] if hits else None


# ----------------------------------------------------------------------------- tests
def test_megatron_names_for_lab_llama_and_gpt2():
    assert megatron_module("blocks.3.attn.qkv") == "decoder.layers.3.self_attention.linear_qkv"
    assert megatron_module("blocks.3.mlp.up") == "decoder.layers.3.mlp.linear_fc1"
    assert megatron_module("model.model.layers.12.self_attn.k_proj") == \
        "decoder.layers.12.self_attention.linear_qkv"  # fmt: skip
    assert megatron_module("model.layers.0.mlp.down_proj") == "decoder.layers.0.mlp.linear_fc2"
    assert megatron_module("model.transformer.h.2.attn.c_proj") == \
        "decoder.layers.2.self_attention.linear_proj"  # fmt: skip
    assert megatron_module("model.encoder.conv") is None


def test_high_precision_cell_is_a_bf16_module_and_a_disabled_gemm():
    r = get_recipe("te-delayed")
    fix = cells_hp(r, {"blocks.1.attn.proj": [("dgrad", "grad_output")]}, "bf16", "fix")
    ex = export_fix("high-precision-cells", fix, r, LAYERS, note="fix\nline two")
    d = megatron_config(ex.megatron)
    assert megatron_match(d, "decoder.layers.1.self_attention.linear_proj") == {
        "fp8_quantization_recipe": None,
        "fp4_quantization_recipe": None,
    }
    assert megatron_match(d, "decoder.layers.11.self_attention.linear_proj") is None
    assert megatron_match(d, "decoder.layers.1.self_attention.linear_qkv") is None
    assert "# " in ex.megatron and any("coarser" in n for n in ex.notes)
    t = te_config(ex.te)
    assert te_match(t, "blocks.1.attn.proj") == {"DisableFP8GEMM": {"enabled": True,
                                                                     "gemms": ["dgrad"]}}  # fmt: skip
    assert te_match(t, "blocks.1.attn.qkv") is None and te_match(t, "xblocks.1.attn.proj") is None


def test_current_scaling_and_shorter_history_are_tensorwise_and_per_tensor_scaling():
    r = get_recipe("te-delayed")
    layers = ["blocks.0.mlp.down", "blocks.2.mlp.down"]
    for name, fn in (("current-scaling", lambda x: current_scaling(x, ("input",))),
                     ("shorter-history", lambda x: shorter_history(x, ("input",), 16))):  # fmt: skip
        fix = per_layer(r, layers, fn, "fix")
        ex = export_fix(name, fix, r, LAYERS)
        d = megatron_config(ex.megatron)
        for i in (0, 2):
            assert megatron_match(d, f"decoder.layers.{i}.mlp.linear_fc2") == {
                "fp8_quantization_recipe": "tensorwise",
                "fp8_format": "hybrid",
            }
        assert megatron_match(d, "decoder.layers.1.mlp.linear_fc2") is None
        t = te_config(ex.te)
        want = {"PerTensorScaling": {"enabled": True, "gemms": ["fprop", "wgrad"],
                                     "tensors": ["activation"]}}  # fmt: skip
        assert te_match(t, "blocks.2.mlp.down") == want
        assert te_match(t, "blocks.1.mlp.down") is None
    assert any("history" in n for n in ex.notes)  # shorter-history: the nearest TE can do


def test_fused_gate_up_take_the_higher_precision_and_say_so():
    r = get_recipe("te-current")
    fix = per_layer(r, ["blocks.0.mlp.gate"], lambda x: all_hp(x, "bf16"), "fix")
    fix = per_layer(fix, ["blocks.0.mlp.up"], lambda x: finer_granularity(x, ("input",)), "fix")
    ex = export_fix("high-precision-role", fix, r, LAYERS)
    d = megatron_config(ex.megatron)
    assert megatron_match(d, "decoder.layers.0.mlp.linear_fc1") == {
        "fp8_quantization_recipe": None,
        "fp4_quantization_recipe": None,
    }
    assert "fuses" in ex.megatron
    te_config(ex.te)


def test_last_blocks_of_nvfp4_are_bf16_and_disabled_layers_in_user_names():
    r = get_recipe("nvfp4")
    tail = [x for x in LAYERS if x.startswith("blocks.2.")]
    lab = [f"model.{x}" for x in LAYERS]
    fix = per_layer(r, [f"model.{x}" for x in tail], lambda x: all_hp(x, "bf16"), "fix")
    ex = export_fix("last-blocks-high-precision", fix, r, lab, prefix="model.")
    d = megatron_config(ex.megatron)
    for x in tail:
        assert megatron_match(d, "module." + megatron_module(x)) == {
            "fp8_quantization_recipe": None,
            "fp4_quantization_recipe": None,
        }
    assert megatron_match(d, "decoder.layers.1.mlp.linear_fc1") is None
    t = te_config(ex.te)
    assert te_match(t, "blocks.2.mlp.gate") == {"DisableFP8Layer": {"enabled": True}}
    assert (
        te_match(t, "blocks.1.mlp.gate") is None and te_match(t, "model.blocks.2.mlp.gate") is None
    )


def test_global_remedies_write_valid_empty_files_and_a_note():
    r = get_recipe("fp16-amp").replace(loss_scaling="static", loss_scale=1.0)
    ex = export_fix("dynamic-loss-scaling", dynamic_loss_scaling(r), r, LAYERS)
    d = megatron_config(ex.megatron)
    assert d == {"configs": {}, "matchers": {}}
    assert te_config(ex.te) == {}
    assert any("--loss-scale" in n for n in ex.notes)
