"""PyTorch integration — train any model under a simulated low-precision recipe.

Two lines, as with Transformer Engine or torchao::

    fp8lab.nn.convert(model, "te-delayed")         # swap nn.Linear -> fp8lab.nn.Linear in place
    with fp8lab.autocast():                        # optional: micro-batch amax accumulation
        loss = model(x).loss

* :class:`Linear` — drop-in ``torch.nn.Linear`` (same init, same ``weight``/``bias`` keys plus
  scaling state) running fprop / dgrad / wgrad under a :class:`fp8lab.Recipe`. Works under
  ``torch.autocast`` (input cast to the autocast dtype before quantization, output in it, as in
  Transformer Engine) and ``torch.compile`` (the layer is a graph break: it runs eagerly).
* :func:`convert` — selects Linear layers by name (globs, ``re.Pattern``); by default keeps
  embeddings, the output head (:data:`DEFAULT_EXCLUDE` names, a Linear tied to an embedding, the
  last Linear) in high precision; never claims ``MultiheadAttention.out_proj`` (warns) and turns
  off ``nn.TransformerEncoderLayer``'s fused eval path where it would skip converted layers.
  :func:`select_linears` previews the choice, :func:`converted` lists converted layers,
  :func:`unconvert` swaps them back to ``torch.nn.Linear``. A recipe with ``[[layer]]`` rules
  (`fp8lab.recipe.LayerRule`) gives each layer its own settings; :func:`layer_settings` reports
  which layer got which.
* :func:`autocast` — ``with autocast(recipe):`` overrides the recipe of converted modules in the
  block (a different recipe keeps its own delayed-scaling state, not saved in the state_dict);
  :func:`active_recipe` is the recipe in force.
* :func:`attention_matmul` — ``q @ kᵀ`` and ``p @ v`` for a model's attention: quantized when the
  recipe sets ``attention=True`` (off by default, like TE's fp8_dpa), plain matmul otherwise.
* :class:`DotProductAttention` — attention with Transformer Engine's FP8 quantization points (Q,
  K, V, S, O, dO, dP, dQKV) when the recipe sets ``attention=True``, its options in the recipe's
  ``[dpa]`` table (delayed, current or MXFP8 scaling; the forward-only FlashAttention-3 style
  path with its 2^8 offset of P); plain fp32 attention otherwise (docs/attention.md).
* :class:`SmoothSwiGLU` — SwiGLU with per-channel smoothing before the quantized down
  projection (Fishman et al., arXiv 2409.12517; the lab's ``--set model.mlp=smooth_swiglu``).
* :class:`GroupedLinear` — the expert weights of a mixture-of-experts layer: one `Linear` per
  expert over jagged token groups, each group padded to the recipe's alignment as the grouped
  GEMM kernels pad it; :class:`MoE` — an fp32 top-k router, token dispatch in the recipe's
  ``[moe] dispatch`` wire format and SwiGLU experts (docs/moe.md).
* :func:`collect_operands` — per-layer, per-GEMM, per-role operands on the steps you sample.

* :func:`on_operand` — ``handle = on_operand(fn)``: ``fn(layer, gemm, role, source, used)`` for
  every GEMM operand until ``handle.remove()``; the one hook point of observe, guard, cost and
  :func:`collect_operands`.
* :func:`delayed_states` — every delayed-scaling state a model's modules own, by name.
* :func:`save_fp8_state` / :func:`load_fp8_state` — the converted layers' FP8 state as its own
  safetensors file (a ``transformers`` model's ``save_pretrained`` writes it beside the weights
  as :data:`FP8_STATE_FILE`, which ``convert`` after ``from_pretrained`` restores).
* :func:`save_debug_checkpoint` — what ``fp8lab debug --from-checkpoint`` needs from the user's
  own loop (weights, optimizer state, FP8 state, step, RNG); :func:`read_debug_checkpoint`.

Layout: ``linear.py`` (the module, its autograd Function with the three GEMMs, the operand
plumbing) -> `fp8lab.qtensor.Quantizer` (one per operand) -> `fp8lab.gemm.matmul`. Beside it:
``plan.py`` (the recipe resolved once into quantizers and reuse decisions), ``state.py`` (a
module's delayed-scaling states), ``context.py`` (autocast), ``attention.py``, ``collect.py``,
``convert.py``, ``dpa.py`` (`DotProductAttention`), ``grouped.py`` and ``moe.py`` (mixture
of experts, on top of `Linear`).
"""

from fp8lab.nn.attention import attention_matmul
from fp8lab.nn.collect import OperandRecord, collect_operands
from fp8lab.nn.context import active_recipe, autocast
from fp8lab.nn.convert import (
    DEFAULT_EXCLUDE,
    convert,
    converted,
    layer_settings,
    resolve_blocks,
    select_linears,
    unconvert,
)
from fp8lab.nn.debug_checkpoint import read_debug_checkpoint, save_debug_checkpoint
from fp8lab.nn.dpa import DotProductAttention
from fp8lab.nn.fp8_state import FP8_STATE_FILE, load_fp8_state, save_fp8_state
from fp8lab.nn.grouped import GroupedLinear
from fp8lab.nn.linear import GatheredWeight, Linear, OperandHandle, on_operand
from fp8lab.nn.moe import MoE
from fp8lab.nn.smooth_swiglu import SmoothSwiGLU
from fp8lab.nn.state import delayed_states

__all__ = [
    "DEFAULT_EXCLUDE",
    "FP8_STATE_FILE",
    "DotProductAttention",
    "GatheredWeight",
    "GroupedLinear",
    "Linear",
    "MoE",
    "OperandHandle",
    "OperandRecord",
    "SmoothSwiGLU",
    "active_recipe",
    "attention_matmul",
    "autocast",
    "collect_operands",
    "convert",
    "converted",
    "delayed_states",
    "layer_settings",
    "load_fp8_state",
    "on_operand",
    "read_debug_checkpoint",
    "resolve_blocks",
    "save_debug_checkpoint",
    "save_fp8_state",
    "select_linears",
    "unconvert",
]
