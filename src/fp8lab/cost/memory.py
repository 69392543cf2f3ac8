"""The memory a recipe's training step would need on real hardware, in bytes (a model, not a
measurement: the simulation itself computes in fp32).

Three parts, each ``{"weights", "optimizer", "activations", "total"}``:

* weights: the master weights (``recipe.master_weights``) plus the low-precision working copy of
  each quantized Linear weight (elements + block scales; a bf16 copy for a high-precision
  recipe other than fp32);
* optimizer: AdamW's two moments (``recipe.optimizer_state``; fp8 adds one fp32 scale per 128
  values);
* activations: what autograd keeps for backward.

:func:`simulated_memory` prices the lab's built-in GPT from its configuration, activations
included; :func:`model_memory` prices any built model, whose activations are known only as far
as its quantized Linears and logits go (a lower bound). ``fp8lab compare`` reports both
(``details[recipe]["memory_bytes"]``).
"""

from __future__ import annotations

import math
from typing import Any

from fp8lab.cost.shapes import _in_out

__all__ = ["model_memory", "simulated_memory"]

#: bytes of one element of a high-precision tensor / of an optimizer state
_HP_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "e4m3": 1, "e5m2": 1}


def _spec_bytes(spec: Any, n_rows: int, n_cols: int) -> float:
    """Bytes of one quantized [n_rows, n_cols] tensor: elements + per-block scales."""
    from fp8lab.formats import get_format

    elem = get_format(spec.format).bits / 8
    bm, bk = spec.block
    bm = n_rows if bm == -1 else bm
    bk = n_cols if bk == -1 else bk
    blocks = math.ceil(n_rows / bm) * math.ceil(n_cols / bk)
    scaling = spec.scaling if isinstance(spec.scaling, str) else ""
    scale_bytes = 1 if scaling.startswith(("mx", "nvfp4")) else 4  # E8M0 / E4M3 vs fp32 scales
    return n_rows * n_cols * elem + blocks * scale_bytes


def _recipe_terms(recipe: Any) -> tuple[int, str, str, Any, Any, str]:
    """(activation bytes per element, master weights, optimizer state, input spec, weight spec,
    save_for_backward) of a recipe; None is fp32 training."""
    if recipe is None:
        return 4, "fp32", "fp32", None, None, "hp"
    hp = {getattr(recipe, g).high_precision for g in ("fprop", "dgrad", "wgrad")}
    act = _HP_BYTES["fp32" if hp == {"fp32"} else "bf16"]
    return (act, recipe.master_weights, recipe.optimizer_state, recipe.input, recipe.weight,
            recipe.save_for_backward)  # fmt: skip


def _weight_copy(wspec: Any, act: int, out_f: int, in_f: int) -> float:
    """The working copy of one Linear weight: quantized, bf16 (a non-fp32 recipe) or none."""
    if wspec is not None:
        return _spec_bytes(wspec, out_f, in_f)
    return out_f * in_f * act if act != 4 else 0


def _saved_input(inp: Any, save: str, act: int, n_tokens: int, width: int) -> float:
    """A quantized Linear's input as autograd keeps it: quantized under
    ``save_for_backward = "quantized"``, else in the recipe's high precision."""
    if inp is not None and save == "quantized":
        return _spec_bytes(inp, n_tokens, width)
    return n_tokens * width * act


def _optimizer(n_params: int, state: str) -> float:
    out = 2 * n_params * _STATE_BYTES[state]
    if _STATE_BYTES[state] == 1:  # one fp32 scale per 128 values of each moment
        out += 2 * math.ceil(n_params / 128) * 4
    return out


def _parts(weights: float, optimizer: float, activations: float) -> dict[str, float]:
    total = weights + optimizer + activations
    return {"weights": weights, "optimizer": optimizer, "activations": activations, "total": total}


def simulated_memory(model_cfg: Any, batch_size: int, recipe: Any) -> dict[str, float]:
    """Bytes the recipe (None: fp32) would need on real hardware for one training step of the
    lab's GPT (``model_cfg``: its ``GPTConfig``, read for ``d_model``, ``d_ff``, ``n_layer``,
    ``n_head``, ``vocab_size`` and ``block_size``) on ``batch_size`` sequences.

    activations: per layer, the input of every quantized Linear in the format it is saved in
    (``save_for_backward``), everything else (norm inputs, q/k/v, attention probabilities,
    SwiGLU branches, head input and logits) at 4 bytes for fp32 and 2 otherwise.
    """
    c = model_cfg
    d, f, L, V, T = c.d_model, c.d_ff, c.n_layer, c.vocab_size, c.block_size
    N = batch_size * T  # tokens per step
    linears = {"qkv": (3 * d, d), "proj": (d, d), "gate": (f, d), "up": (f, d), "down": (d, f)}
    n_params = V * d + T * d + L * (2 * d + sum(o * i for o, i in linears.values())) + d + V * d
    act, master, state, inp, wspec, save = _recipe_terms(recipe)
    weights = n_params * _HP_BYTES[master]
    weights += sum(L * _weight_copy(wspec, act, o, i) for o, i in linears.values())
    linear_inputs = {"qkv": d, "proj": d, "gate/up": d, "down": f}
    saved = sum(_saved_input(inp, save, act, N, w) for w in linear_inputs.values())
    other = N * (2 * d + 4 * d + 3 * f) + batch_size * c.n_head * T * T  # per layer
    activations = L * (saved + other * act) + N * (2 * d * act + V * 4)
    return _parts(weights, _optimizer(n_params, state), activations)


def model_memory(
    model: Any, vocab_size: int, batch_size: int, block_size: int, recipe: Any
) -> dict[str, float]:
    """:func:`simulated_memory` for a user's model (any architecture), from the built model:
    weights and optimizer as there (every parameter, shared ones once, plus the low-precision
    copy of each Linear ``convert`` would quantize); activations only as far as they are known
    without the architecture, so a lower bound: the input of every such Linear
    (``save_for_backward``) and the fp32 logits."""
    from fp8lab.nn import select_linears

    N = batch_size * block_size
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    act, master, state, inp, wspec, save = _recipe_terms(recipe)
    weights = n_params * _HP_BYTES[master]
    saved = 0.0
    for name in select_linears(model):
        in_f, out_f = _in_out(model.get_submodule(name))
        weights += _weight_copy(wspec, act, out_f, in_f)
        saved += _saved_input(inp, save, act, N, in_f)
    activations = saved + N * vocab_size * 4
    return _parts(weights, _optimizer(n_params, state), activations)
