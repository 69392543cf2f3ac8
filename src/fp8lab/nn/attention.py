"""`attention_matmul`: attention's two matmuls (``q kᵀ`` and ``p v``) under a recipe, each
operand quantized statelessly; `route_hf_attention`: a converted ``transformers`` model's
attention through `fp8lab.nn.DotProductAttention` (TE's FP8 attention) when the recipe asks."""

from __future__ import annotations

import torch

from fp8lab.nn.context import active_recipe
from fp8lab.qtensor import QuantSpec, quantize
from fp8lab.recipe import Recipe

__all__ = ["HF_ATTENTION", "attention_matmul", "hf_attention_dpas", "route_hf_attention"]


def _stateless(spec: QuantSpec | None) -> QuantSpec | None:
    # attention operands are fresh every call: delayed specs fall back to current scaling
    if spec is not None and spec.is_delayed:
        return spec.replace(scaling="max")
    return spec


class _AttentionMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, fwd_spec, bwd_spec):  # type: ignore[override]
        qa = a if fwd_spec is None else quantize(a, fwd_spec).dequantize()
        qb = b if fwd_spec is None else quantize(b, fwd_spec).dequantize()
        ctx.save_for_backward(qa, qb)
        ctx.bwd_spec = bwd_spec
        return torch.matmul(qa, qb)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        qa, qb = ctx.saved_tensors
        if ctx.bwd_spec is not None:
            g = quantize(g.contiguous(), ctx.bwd_spec).dequantize()
        da = torch.matmul(g, qb.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        db = torch.matmul(qa.transpose(-1, -2), g) if ctx.needs_input_grad[1] else None
        return da, db, None, None


@torch.compiler.disable
def attention_matmul(
    a: torch.Tensor, b: torch.Tensor, recipe: Recipe | None = None
) -> torch.Tensor:
    """``a @ b`` for attention's two matmuls (``q kᵀ`` and ``p v``), quantized when the recipe
    says so (``recipe.attention``, off by default like TE's ``fp8_dpa``).

    ``recipe=None`` uses the innermost :func:`fp8lab.nn.autocast` recipe (no autocast: plain
    matmul). Operands use the recipe's ``input`` spec and the incoming gradient its
    ``grad_output`` spec, each quantized as a ``[..., last dim]`` tensor with current scaling
    (delayed specs fall back to current scaling: attention operands keep no state). Float32
    operands; the result is float32 ``[..., M, N]`` for ``a [..., M, K]``, ``b [..., K, N]``.
    """
    if recipe is None:
        recipe = active_recipe()
    if recipe is None or not recipe.attention:
        return torch.matmul(a, b)
    return _AttentionMatmul.apply(
        a.contiguous(),
        b.contiguous(),
        _stateless(recipe.input),
        _stateless(recipe.grad_output),
    )


# =========================================================================== transformers models
#: the attention implementation name `route_hf_attention` registers with transformers
HF_ATTENTION = "fp8lab_dpa"
_NAME, _DPA = "_fp8lab_name", "_fp8lab_dpa"  # attributes of a routed attention module


def _wants_attention(recipe: Recipe) -> bool:
    """Whether ``recipe`` or one of its ``[[layer]]`` rules turns FP8 attention on."""
    return recipe.attention or any("attention" in r.changes for r in recipe.layers)


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):  # type: ignore[no-untyped-def]  # fmt: skip
    """transformers' attention interface: ``query [B, H, T, D]``, ``key/value [B, Hkv, S, D]``,
    a bool mask from transformers' ``sdpa_mask`` (True = attend) or None (causal) -> ``([B, T,
    H, D], None)``. The layer's FP8 attention when its recipe asks, else transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fp8lab.nn.linear import Linear

    own = next((m.recipe for m in module.children() if isinstance(m, Linear)), None)
    recipe = active_recipe(own)
    name = module.__dict__.get(_NAME, "")
    if recipe is not None and recipe.layers:
        recipe = recipe.for_layer(f"{name}.q_proj")
    if recipe is None or not recipe.attention or recipe.input is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)  # fmt: skip
    dpa = _dpa_of(module)
    dpa.softmax_scale = scaling
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    if is_causal is not None:
        causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else None
    out = dpa(query, key, value, is_causal=causal, attn_mask=mask, recipe=recipe)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _dpa_of(module: torch.nn.Module) -> torch.nn.Module:
    """The `fp8lab.nn.DotProductAttention` of a routed attention module, made on first use
    (named ``<module>.dpa``). Kept outside the module tree: the model's state dict, which the
    unconverted architecture loads, stays as it was; its delayed-scaling state travels in
    `fp8lab.nn.save_fp8_state`'s file instead (`hf_attention_dpas`)."""
    from fp8lab.nn.dpa import DotProductAttention

    dpa = module.__dict__.get(_DPA)
    if dpa is None:
        name = module.__dict__.get(_NAME, "")
        dpa = module.__dict__[_DPA] = DotProductAttention(name=f"{name}.dpa")
    return dpa


def hf_attention_dpas(model: torch.nn.Module, create: bool = False) -> dict[str, torch.nn.Module]:
    """``{"<attention module>.dpa": DotProductAttention}`` of a model that
    `route_hf_attention` routed: those that ran (``create=False``), or one per routed attention
    module, made now when missing (``create=True``, to load saved state before the first
    forward). Empty for a model never routed."""
    out = {}
    for m in model.modules():
        name = m.__dict__.get(_NAME)
        if name is not None and (create or _DPA in m.__dict__):
            out[f"{name}.dpa"] = _dpa_of(m)
    return out


def route_hf_attention(model: torch.nn.Module, recipe: Recipe) -> bool:
    """Make a converted ``transformers`` model's attention layers run
    `fp8lab.nn.DotProductAttention` when ``recipe`` (or a ``[[layer]]`` rule) sets ``attention``:
    registers :data:`HF_ATTENTION` (with transformers' SDPA mask) and selects it in the model's
    config. Layers whose recipe does not ask run transformers' SDPA. Returns whether it routed
    (False for models without a transformers config, or recipes without FP8 attention)."""
    config = getattr(model, "config", None)
    if (
        config is None
        or not hasattr(config, "_attn_implementation")
        or not _wants_attention(recipe)
    ):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Attention"):  # LlamaAttention, Qwen2Attention, ...
            m.__dict__[_NAME] = name
    for sub in (config, *(getattr(config, k) for k in ("text_config",) if hasattr(config, k))):
        sub._attn_implementation = HF_ATTENTION
    return True
