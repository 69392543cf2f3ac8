"""L3 mixed-precision optimizer pieces.

- :class:`AdamW`: fp32 master weights; moments stored in fp32, bf16, fp16 or block-scaled fp8
  (emulated by exact rounding of fp32 values), per moment, optionally through COAT's dynamic
  range expansion; MS-AMP's scaled FP16 masters, no master, FP8-stored parameters
  (``param_specs``); optional clipping; non-finite gradients skip the step and are counted
  (``skipped_steps``), so weights never become NaN.
- :class:`LossScaler`: static or dynamic loss scaling (2^16, x2 every 2000 good steps, x0.5 on
  overflow, optional hysteresis), ``torch.amp.GradScaler``-like API.
- :func:`grad_norm`, :func:`clip_grad_norm_`, :func:`grads_finite`, :func:`unscale_and_clip`.
"""

from fp8lab.optim._storage import STORAGE_PRECISIONS
from fp8lab.optim.adamw import AdamW
from fp8lab.optim.clip import clip_grad_norm_, grad_norm, grads_finite, unscale_and_clip
from fp8lab.optim.loss_scaler import LossScaler

__all__ = [
    "STORAGE_PRECISIONS",
    "AdamW",
    "LossScaler",
    "clip_grad_norm_",
    "grad_norm",
    "grads_finite",
    "unscale_and_clip",
]
