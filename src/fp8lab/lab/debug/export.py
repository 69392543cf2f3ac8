"""The debugger's fix where users apply it: Megatron-LM and Transformer Engine's debug tool.

Beside ``fix.toml`` (fp8lab's own per-layer recipe file) the verdict writes:

- ``fix.megatron.yaml``: a file for Megatron-LM's ``--te-precision-config-file`` as
  ``megatron/core/quantization/quant_config.py`` reads it: ``configs`` (name -> a
  ``TEQuantizationParams`` payload: ``transformer_engine_config_type`` and a
  ``training_recipe`` of ``TEQuantizationRecipe`` fields, ``megatron/core/extensions/
  transformer_engine.py``) and ordered ``matchers`` (``type: glob``, an ``fnmatch`` pattern on
  the module path, ``config``, ``enabled``; the first that matches wins, a module no matcher
  matches keeps the run's global recipe). Patterns name Megatron-Core GPT modules
  (``decoder.layers.<i>.self_attention.linear_qkv`` / ``linear_proj``,
  ``decoder.layers.<i>.mlp.linear_fc1`` / ``linear_fc2``), mapped from the lab's and Hugging
  Face's names by :data:`MEGATRON_NAMES` (docs/debug.md has the table).
- ``fix.te.yaml``: a config for Transformer Engine's precision debug tools (nvdlfw-inspect;
  :data:`TE_VERSION`'s features ``DisableFP8GEMM``, ``DisableFP8Layer``, ``PerTensorScaling``),
  one section per change, its layers selected by ``layer_name_regex_pattern`` on the user's own
  module names (as TE names its layers from ``name=...`` or the module path).

Neither format has fp8lab's cell (one operand of one GEMM of one layer): a fix is written as
the nearest coarser fix that keeps the remedy's effect, with a ``#`` comment saying so, or left
out with a comment and a note (:attr:`Export.notes`, which the report shows). The mapping:

=========================== =============================== ====================================
remedy                      Megatron (per module)           TE debug features (per layer)
=========================== =============================== ====================================
high-precision-cells / role module in BF16 (no FP8/FP4)     ``DisableFP8GEMM`` on those GEMMs
last-blocks-high-precision  modules in BF16                 ``DisableFP8Layer``
current-scaling             ``tensorwise`` (current)        ``PerTensorScaling`` (those GEMMs,
                                                            that tensor)
shorter-history             ``tensorwise`` (no delayed      ``PerTensorScaling`` (current: a
                            scaling per module)             history of one step)
finer-granularity           ``blockwise`` or ``mxfp8``      ``DisableFP8GEMM`` (no finer scaling
                                                            feature)
e5m2-gradients              ``fp8_format: hybrid``          ``DisableFP8GEMM`` on dgrad, wgrad
dynamic-loss-scaling,       left out (not a per-module      left out (not a TE debug feature)
norm-weights-, attention-   setting: the note says which
high-precision              Megatron flag does it)
=========================== =============================== ====================================
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8lab.recipe import GEMM_OPERANDS, GEMMS, ROLES, Recipe

MEGATRON_FILE = "fix.megatron.yaml"
TE_FILE = "fix.te.yaml"
#: the Transformer Engine release whose debug features ``fix.te.yaml`` uses (its user guide,
#: debug/3_api_features, lists DisableFP8GEMM, DisableFP8Layer and PerTensorScaling)
TE_VERSION = "2.4"
#: TE's tensor names in its debug features, by fp8lab role
TE_TENSORS = {"input": "activation", "weight": "weight", "grad_output": "gradient"}

#: (regex on a layer name, Megatron-Core GPT module path with ``{i}`` the block): the lab GPT,
#: Hugging Face Llama-style (Llama, Mistral, Qwen2 ...) and GPT-2 names
MEGATRON_NAMES: tuple[tuple[str, str], ...] = (
    (r"blocks\.(\d+)\.attn\.qkv", "decoder.layers.{i}.self_attention.linear_qkv"),
    (r"blocks\.(\d+)\.attn\.proj", "decoder.layers.{i}.self_attention.linear_proj"),
    (r"blocks\.(\d+)\.mlp\.(?:gate|up)", "decoder.layers.{i}.mlp.linear_fc1"),
    (r"blocks\.(\d+)\.mlp\.down", "decoder.layers.{i}.mlp.linear_fc2"),
    (r"layers\.(\d+)\.self_attn\.[qkv]_proj", "decoder.layers.{i}.self_attention.linear_qkv"),
    (r"layers\.(\d+)\.self_attn\.o_proj", "decoder.layers.{i}.self_attention.linear_proj"),
    (r"layers\.(\d+)\.mlp\.(?:gate|up)_proj", "decoder.layers.{i}.mlp.linear_fc1"),
    (r"layers\.(\d+)\.mlp\.down_proj", "decoder.layers.{i}.mlp.linear_fc2"),
    (r"h\.(\d+)\.attn\.c_attn", "decoder.layers.{i}.self_attention.linear_qkv"),
    (r"h\.(\d+)\.attn\.c_proj", "decoder.layers.{i}.self_attention.linear_proj"),
    (r"h\.(\d+)\.mlp\.c_fc", "decoder.layers.{i}.mlp.linear_fc1"),
    (r"h\.(\d+)\.mlp\.c_proj", "decoder.layers.{i}.mlp.linear_fc2"),
)

#: remedies that are not a per-layer setting, and what to do instead in each system
_GLOBAL = {
    "dynamic-loss-scaling": (
        "dynamic loss scaling: Megatron-LM scales the loss dynamically under --fp16 unless "
        "--loss-scale fixes it (drop --loss-scale; --initial-loss-scale sets the start)",
        "dynamic loss scaling is the training loop's (e.g. torch.amp.GradScaler), not a TE "
        "debug feature"),
    "norm-weights-high-precision": (
        "norm weights in high precision: Megatron-Core's TE norms keep their parameters in "
        "the parameter dtype; nothing to set per module",
        "norm weights in high precision: TE's norms are not quantized by its recipes"),
    "attention-high-precision": (
        "attention in high precision: drop --fp8-dot-product-attention "
        "(and --fp8-multi-head-attention)",
        "attention in high precision: unset NVTE_FP8_DPA / fp8_dpa in the recipe"),
}  # fmt: skip


@dataclass
class Export:
    """The two files' text and the notes on what they could not express."""

    megatron: str
    te: str
    notes: list[str] = field(default_factory=list)


def megatron_module(layer: str) -> str | None:
    """The Megatron-Core GPT module path of a lab or Hugging Face layer name (None: unknown)."""
    for pat, path in MEGATRON_NAMES:
        m = re.search(rf"(?:^|\.){pat}$", layer)
        if m is not None:
            return path.format(i=m.group(1))
    return None


# ----------------------------------------------------------------------------- per layer
def _hp_gemms(r: Recipe) -> list[str]:
    """The GEMMs of a layer's recipe with any operand in high precision (none quantized
    counts too)."""
    out = []
    for g in GEMMS:
        cfg = r.gemm(g)
        ops = [role for role, _ in GEMM_OPERANDS[g]]
        if cfg.high_precision is not None or any(x in dict(cfg.high_precision_roles) for x in ops) \
                or all(r.spec(g, x) is None for x in ops):  # fmt: skip
            out.append(g)
    return out


def _megatron_recipe(r: Recipe) -> tuple[dict[str, Any], list[str]]:
    """A ``TEQuantizationRecipe`` payload for a layer running ``r``, and its comments."""
    notes: list[str] = []
    if _hp_gemms(r):
        if len(_hp_gemms(r)) < 3:
            notes.append(f"{'/'.join(_hp_gemms(r))} in high precision: a Megatron module has "
                         "one recipe, so the whole module runs BF16 (coarser)")  # fmt: skip
        return {"fp8_quantization_recipe": None, "fp4_quantization_recipe": None}, notes
    specs = [s for s in (r.input, r.weight, r.grad_output) if s is not None]
    fmts = {s.format for s in specs}
    if fmts <= {"e2m1"}:
        return {"fp4_quantization_recipe": "nvfp4"}, notes
    grans = {s.granularity if isinstance(s.granularity, str) else tuple(s.block) for s in specs}
    if any(g in ("mx", "mx_col") for g in grans):
        kind = "mxfp8"
    elif any(isinstance(g, tuple) and g != (-1, -1) for g in grans):
        kind = "blockwise"
    else:
        kind = "tensorwise"
        if any(not isinstance(s.scaling, str) for s in specs):
            notes.append("delayed scaling is out of scope of Megatron's per-module config: "
                         "current (tensorwise) scaling instead")  # fmt: skip
    fmt = "hybrid" if r.grad_output is not None and r.grad_output.format == "e5m2" else "e4m3"
    return {"fp8_quantization_recipe": kind, "fp8_format": fmt}, notes


def _is_bf16(payload: dict[str, Any]) -> bool:
    return payload.get("fp8_quantization_recipe") is None and not payload.get(
        "fp4_quantization_recipe"
    )


def _te_features(r: Recipe, base: Recipe, remedy: str) -> tuple[dict[str, Any], list[str]]:
    """TE debug features turning a layer running ``base`` into one running ``r``."""
    hp = [g for g in _hp_gemms(r) if g not in _hp_gemms(base)]
    if remedy == "last-blocks-high-precision" or len(hp) == 3:
        return {"DisableFP8Layer": {"enabled": True}}, []
    if hp:
        notes = []
        if remedy == "high-precision-cells":
            notes.append("TE disables FP8 for a whole GEMM (both operands): coarser than one "
                         "operand in high precision")  # fmt: skip
        return {"DisableFP8GEMM": {"enabled": True, "gemms": hp}}, notes
    changed = [x for x in ROLES if getattr(r, x) != getattr(base, x)]
    if remedy in ("current-scaling", "shorter-history") and changed:
        gemms = [g for g in GEMMS if any(x in dict(GEMM_OPERANDS[g]) for x in changed)]
        notes = ([] if remedy == "current-scaling" else
                 ["TE's debug features have no amax history length: per-tensor current scaling "
                  "(a history of one step) instead"])  # fmt: skip
        return {"PerTensorScaling": {"enabled": True, "gemms": gemms,
                                     "tensors": [TE_TENSORS[x] for x in changed]}}, notes  # fmt: skip
    gemms = [g for g in GEMMS if any(x in dict(GEMM_OPERANDS[g]) for x in changed)] or list(GEMMS)
    return {"DisableFP8GEMM": {"enabled": True, "gemms": gemms}}, [
        f"{remedy}: no TE debug feature changes a tensor's format or scaling blocks; those "
        "GEMMs in high precision instead (coarser)"]  # fmt: skip


# ----------------------------------------------------------------------------- the files
def export_fix(remedy_name: str, remedy: Recipe, recipe: Recipe, layers: Sequence[str],
               prefix: str = "", note: str = "") -> Export:  # fmt: skip
    """Both files for the remedy ``remedy_name`` (its variant ``remedy``, lab layer names) of
    ``recipe`` on the converted ``layers``; ``prefix``: the lab's prefix of the user's names
    (`fp8lab.lab.debug.names.lab_prefix`). ``note``: the header comment."""
    head = "".join(f"# {ln}\n" for ln in note.splitlines() if ln)
    if remedy_name in _GLOBAL:
        mg, te = _GLOBAL[remedy_name]
        return Export(
            megatron=head + f"# {mg}\n# nothing per module to set\nconfigs: {{}}\nmatchers: {{}}\n",
            te=head + f"# {te}\n# no TE debug feature to enable\n",
            notes=[f"fix.megatron.yaml: {mg}", f"fix.te.yaml: {te}"],
        )
    changed = [x for x in layers
               if remedy.for_layer(x).fingerprint() != recipe.for_layer(x).fingerprint()]  # fmt: skip
    notes: list[str] = []
    return Export(
        megatron=head + _megatron_text(remedy, changed, notes),
        te=head + _te_text(remedy_name, remedy, recipe, changed, prefix, notes),
        notes=notes,
    )


def _megatron_text(remedy: Recipe, changed: Sequence[str], notes: list[str]) -> str:
    by_module: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {}
    for x in changed:
        path = megatron_module(x)
        if path is None:
            notes.append(f"fix.megatron.yaml: {x} has no Megatron-Core GPT module in the name "
                         "table (docs/debug.md); left out")  # fmt: skip
            continue
        payload, why = _megatron_recipe(remedy.for_layer(x))
        if path not in by_module:
            by_module[path] = (payload, list(why), [x])
            continue
        old, old_why, srcs = by_module[path]
        if old != payload:  # fused in Megatron (q/k/v, gate/up): the safer one, BF16 if either
            why = [*why, f"{path} fuses {', '.join(srcs)} and {x}, which the fix treats "
                   "differently: the higher precision of the two"]  # fmt: skip
            payload = payload if _is_bf16(payload) else old
        by_module[path] = (payload, old_why + [w for w in why if w not in old_why], [*srcs, x])
    configs: dict[str, dict[str, Any]] = {}
    lines = ["configs:"]
    matchers = ["matchers:"]
    for i, (path, (payload, why, srcs)) in enumerate(by_module.items()):
        key = next((k for k, v in configs.items() if v == payload), None)
        if key is None:
            key = f"fix{len(configs)}"
            configs[key] = payload
        matchers += [f"  # {path} <- {', '.join(srcs)}"]
        matchers += [f"  # {w}" for w in dict.fromkeys(why)]
        matchers += [f"  m{i}:", f"    config: {key}", "    type: glob",
                     f'    pattern: "*{path}"', "    enabled: true"]  # fmt: skip
        notes += [f"fix.megatron.yaml {path}: {w}" for w in dict.fromkeys(why)]
    for key, payload in configs.items():
        lines += [f"  {key}:", "    transformer_engine_config_type: TEQuantizationParams",
                  "    training_recipe:"]  # fmt: skip
        lines += [f"      {k}: {_yaml(v)}" for k, v in payload.items()]
    if not configs:
        lines = ["configs: {}"]
        matchers = ["matchers: {}"]
    return "\n".join(lines + matchers) + "\n"


def _te_text(remedy_name: str, remedy: Recipe, recipe: Recipe, changed: Sequence[str],
             prefix: str, notes: list[str]) -> str:  # fmt: skip
    groups: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {}
    for x in changed:
        feats, why = _te_features(remedy.for_layer(x), recipe.for_layer(x), remedy_name)
        key = repr(feats)
        user = x[len(prefix) :] if prefix and x.startswith(prefix) else x
        g = groups.setdefault(key, (feats, [], []))
        g[1].append(user)
        g[2].extend(w for w in why if w not in g[2])
    lines = [f"# Transformer Engine {TE_VERSION} precision debug tools (nvdlfw-inspect); layers "
             "by their names in your model"]  # fmt: skip
    for i, (feats, names, why) in enumerate(groups.values()):
        pattern = "^(?:" + "|".join(re.escape(n) for n in names) + ")$"
        lines += [f"# {w}" for w in why]
        lines += [f"fp8lab_fix_{i}:", "  enabled: true", "  layers:",
                  f"    layer_name_regex_pattern: {_yaml(pattern)}",
                  "  transformer_engine:"]  # fmt: skip
        for name, params in feats.items():
            lines.append(f"    {name}:")
            lines += [f"      {k}: {_yaml(v)}" for k, v in params.items()]
        notes += [f"fix.te.yaml: {w}" for w in why]
    return "\n".join(lines) + "\n"


def _yaml(v: Any) -> str:
    """A YAML scalar or flow list (strings single-quoted: no escapes to get wrong)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    return "'" + str(v).replace("'", "''") + "'"


def write_exports(out: Path, export: Export, stem: str = "fix") -> dict[str, str]:
    """Write both files into ``out`` (``STEM.megatron.yaml``, ``STEM.te.yaml``: the debugger's
    :data:`MEGATRON_FILE` and :data:`TE_FILE`, `fp8lab advise`'s ``advise.*``);
    ``{"megatron": path, "te": path}``."""
    paths = {"megatron": out / MEGATRON_FILE.replace("fix", stem, 1),
             "te": out / TE_FILE.replace("fix", stem, 1)}  # fmt: skip
    paths["megatron"].write_text(export.megatron)
    paths["te"].write_text(export.te)
    return {k: str(v) for k, v in paths.items()}
