"""FP8 primary weights: the recipe key ``param_storage = "fp8"``.

Transformer Engine's ``fp8_model_init`` and Megatron-LM's ``--fp8-param-gather`` keep the weight
of each FP8 Linear as FP8 codes plus scales instead of a BF16/FP32 tensor: the forward reads the
codes directly, and the optimizer writes new codes after each step from its master copy (or, with
no master, from the updated dequantized value). Here the parameter holds exactly what those codes
represent: its value is ``decode(codes) * scale_inv`` per block of the layer's fprop weight spec,
and `fp8lab.optim.AdamW` (``param_specs``) re-quantizes it after every step.

Relation to the FSDP2 FP8 all-gather (`fp8lab.distributed.fsdp`): that all-gather quantizes each
rank's weight shard under the same fprop weight spec every step and sends the uint8 codes plus
scales. With FP8 storage the codes already exist, so a real system sends the stored codes as they
are (TE's FSDP2 path with ``fp8_model_init``); on one rank they are the codes `fp8_codes` returns,
and since the stored value lies on the spec's grid, quantizing it again (as the all-gather or the
Linear's forward does) gives the same codes: the scale is recomputed from an amax that is itself
on the grid, so at most its last bit changes.

Assumptions: a delayed-scaled weight spec is stored with current (per-tensor max) scaling of the
same format and granularity (TE PR 1544 added FP8 primary weights for current scaling; the
delayed path's scale would come from the module's amax history, which the optimizer does not
see). The high-precision initial value is kept on the parameter (``_fp8lab_hp_init``) for the
optimizer's ``param_master_init = "high_precision"`` path (TE PR 1121's
``preserve_high_precision_init_val``); the optimizer reads it once, at its first step.
"""

from __future__ import annotations

import torch

from fp8lab.formats import encode, get_format
from fp8lab.optim.adamw import HP_INIT_ATTR, requantize
from fp8lab.qtensor import QuantSpec, quantize

__all__ = ["fp8_codes", "fp8_param_specs", "storage_spec", "store_fp8_params_"]


def storage_spec(spec: QuantSpec | None, where: str = "weight") -> QuantSpec:
    """The spec FP8 storage of a weight quantized under ``spec`` uses: ``spec`` itself, or with
    current scaling in place of delayed scaling (module doc). ValueError naming ``where`` when
    ``spec`` is None (an fp32 weight) or its format has no 8-bit codes."""
    if spec is None:
        raise ValueError(f"param_storage = 'fp8': {where} is not quantized (fp32), no codes")
    fmt = get_format(spec.format)
    if fmt.bits > 8:
        raise ValueError(
            f"param_storage = 'fp8': {where} uses {fmt.name} ({fmt.bits} bits), which has no "
            "8-bit codes"
        )
    return spec.replace(scaling="max") if spec.is_delayed else spec


def fp8_param_specs(model: torch.nn.Module) -> dict[torch.nn.Parameter, QuantSpec]:
    """Weight parameter -> storage spec of every converted `fp8lab.nn.Linear` in ``model`` whose
    recipe sets ``param_storage = "fp8"`` and quantizes its weight (a layer a ``[[layer]]`` rule
    keeps in fp32 stays high precision)."""
    from fp8lab.nn.linear import Linear

    out: dict[torch.nn.Parameter, QuantSpec] = {}
    for name, m in model.named_modules():
        rec = getattr(m, "recipe", None)
        if not isinstance(m, Linear) or rec is None or rec.param_storage != "fp8":
            continue
        spec = rec.spec("fprop", "weight")
        if spec is not None:
            out[m.weight] = storage_spec(spec, f"layer {name!r} weight")
    return out


@torch.no_grad()
def store_fp8_params_(model: torch.nn.Module) -> dict[torch.nn.Parameter, QuantSpec]:
    """Replace each FP8-stored weight (`fp8_param_specs`) by its FP8 value in place, keeping the
    high-precision value on the parameter for the optimizer's master initialisation; returns the
    specs (for `fp8lab.optim.AdamW`'s ``param_specs``)."""
    specs = fp8_param_specs(model)
    for p, spec in specs.items():
        setattr(p, HP_INIT_ATTR, p.detach().to(torch.float32).clone())
        p.copy_(requantize(p, spec))
    return specs


def fp8_codes(p: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored form of an FP8 parameter: (uint8 codes shaped like ``p``, float32 dequantization
    scales per block), as `fp8lab.distributed.fsdp`'s all-gather sends them on one rank."""
    q = quantize(p.detach().to(torch.float32), spec)
    return encode(q.values, spec.format), q.scales
