"""The memory a recipe's training step would need on real hardware, in bytes (a model, not a
measurement: the simulation itself computes in fp32).

Three parts, each ``{"weights", "optimizer", "activations", "total"}``:

* weights: the master weights (``recipe.master_weights``: 4 bytes for fp32, 2 for bf16, fp16
  and MS-AMP's scaled fp16, which adds one fp32 scale per parameter tensor; 0 for ``"none"``) plus the
  low-precision working copy of each quantized Linear weight (elements + block scales; a bf16
  copy for a high-precision recipe other than fp32). Under ``param_storage = "fp8"`` that FP8
  copy *is* the parameter; the parameters not stored in FP8 keep 4 bytes when there is no
  master;
* optimizer: AdamW's two moments (``recipe.moment_dtypes``; fp8 adds one fp32 scale per 128
  values, and COAT's ``moment_expansion`` two more fp32 values per group: its exponent k and
  centre g);
* activations: what autograd keeps for backward (``save_activations = "quantized"``: the
  inputs of the block norms, the q/k norms, the final norm and the SwiGLU activation at 1 byte
  plus one fp32 scale per 16 values).

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
#: bytes of one master-weight element per ``master_weights`` value
_MASTER_BYTES = {**_HP_BYTES, "fp16-scaled": 2, "none": 0}
#: bytes of the one scale per parameter tensor of MS-AMP O2's scaled fp16 master (fp32)
_MASTER_SCALE_BYTES = {"fp16-scaled": 4}
#: bytes per element of a nonlinearity's input saved in FP8 (1 x 16 groups, fp32 scales)
_SAVED_FP8_BYTES = 1 + 4 / 16


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


def _recipe_terms(recipe: Any) -> tuple[int, str, Any, Any, Any, str]:
    """(activation bytes per element, master weights, the recipe itself (None: fp32), input
    spec, weight spec, save_for_backward) of a recipe; None is fp32 training."""
    if recipe is None:
        return 4, "fp32", None, None, None, "hp"
    hp = {getattr(recipe, g).high_precision for g in ("fprop", "dgrad", "wgrad")}
    act = _HP_BYTES["fp32" if hp == {"fp32"} else "bf16"]
    return (act, recipe.master_weights, recipe, recipe.input, recipe.weight,
            recipe.save_for_backward)  # fmt: skip


def _weights(
    n_params: int, n_tensors: int, linear_elems: int, copies: float, master: str, recipe: Any
) -> float:
    """Master weights of ``n_params`` parameters in ``n_tensors`` tensors (each with its own
    scale under ``"fp16-scaled"``) plus the working ``copies`` of the quantized Linear weights
    (``linear_elems`` elements): under FP8 storage the copies are the parameters and the
    others, without a master, are fp32."""
    scales = n_tensors * _MASTER_SCALE_BYTES.get(master, 0)
    if recipe is None or recipe.param_storage != "fp8":
        return n_params * _MASTER_BYTES[master] + scales + copies
    other = _MASTER_BYTES[master] if master != "none" else 4
    return (
        linear_elems * _MASTER_BYTES[master] + (n_params - linear_elems) * other + scales + copies
    )


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


def _optimizer(n_params: int, recipe: Any) -> float:
    """AdamW's moments of ``recipe`` (None: fp32) for ``n_params`` parameters."""
    dtypes = ("fp32", "fp32") if recipe is None else recipe.moment_dtypes
    expand = recipe is not None and recipe.moment_expansion
    out = 0.0
    for state in dtypes:
        out += n_params * _STATE_BYTES[state]
        if _STATE_BYTES[state] == 1:  # one fp32 scale per 128 values (+ COAT's k and g)
            out += math.ceil(n_params / 128) * 4 * (3 if expand else 1)
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
    n_tensors = 2 + L * (2 + len(linears)) + 2  # embeddings, per layer norms and Linears, head
    act, master, state, inp, wspec, save = _recipe_terms(recipe)
    copies = sum(L * _weight_copy(wspec, act, o, i) for o, i in linears.values())
    linear_elems = L * sum(o * i for o, i in linears.values()) if wspec is not None else 0
    weights = _weights(n_params, n_tensors, linear_elems, copies, master, recipe)
    linear_inputs = {"qkv": d, "proj": d, "gate/up": d, "down": f}
    saved = sum(_saved_input(inp, save, act, N, w) for w in linear_inputs.values())
    # the inputs of the two norms and of SwiGLU's activation (gate and up outputs) per layer, and
    # of the q/k norms (each head's queries and keys) where the model has them
    nonlinear = N * (2 * d + 2 * f + (2 * d if getattr(c, "qk_norm", False) else 0))
    nl_bytes = (
        _SAVED_FP8_BYTES if state is not None and state.save_activations == "quantized" else act
    )
    other = N * (4 * d + f) + batch_size * c.n_head * T * T  # per layer
    # after the blocks: the final norm's input (a nonlinearity's), the head's input, fp32 logits
    tail = N * (d * nl_bytes + d * act + V * 4)
    activations = L * (saved + other * act + nonlinear * nl_bytes) + tail
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
    params = {id(p): p for p in model.parameters()}.values()  # shared ones once
    n_params, n_tensors = sum(p.numel() for p in params), len(params)
    act, master, state, inp, wspec, save = _recipe_terms(recipe)
    copies = saved = 0.0
    linear_elems = 0
    for name in select_linears(model):
        in_f, out_f = _in_out(model.get_submodule(name))
        copies += _weight_copy(wspec, act, out_f, in_f)
        linear_elems += in_f * out_f if wspec is not None else 0
        saved += _saved_input(inp, save, act, N, in_f)
    weights = _weights(n_params, n_tensors, linear_elems, copies, master, state)
    activations = saved + N * vocab_size * 4
    return _parts(weights, _optimizer(n_params, state), activations)
