"""Quantized tensors: `QuantSpec`, `QTensor`, `quantize`, `fake_quant`, `retile`.

Quantization follows Transformer Engine: for every scale block, a rule turns the block amax into
a quantization multiplier ``scale`` and the elements become ``values = cast(x * scale)``
(``cast`` = `fp8lab.cast`, round-to-nearest-even and saturating by default). `QTensor.scales`
stores the **dequantization multipliers** ``scale_inv = 1/scale`` (TE's ``scale_inv``), so
``dequantize() = values * scales`` (times the FP32 tensor scale for NVFP4's second level).

amax is ``max |x|`` over the block with NaN ignored (TE's ``fmaxf`` reductions); NaN elements stay
NaN through the cast. See `fp8lab.scaling.rules` for what each rule does with an amax of 0, inf or
NaN, and `fp8lab.scaling.granularity` for block shapes and ragged edges.

Modules: `spec` (QuantSpec), `tensor` (QTensor), `quantizer` (Quantizer: one operand's
quantization and its state; the output-buffer pool), `quantize` (quantize, fake_quant),
`retile` (retile, retile_counts), `kernels` (numba amax and cast kernels), `transforms`
(`rht16`, `hadamard_transform`: block Hadamard transforms before quantizing), `nvfp4` (NVFP4's
per-row second level and "4 over 6"). The fused scale-rule
kernels live beside the rules in `fp8lab.scaling.rule_kernels`.
"""

from __future__ import annotations

import torch  # noqa: F401  (kept as an attribute: tests reach torch through fp8lab.qtensor)

from fp8lab.qtensor.kernels import _block_amax_fast  # noqa: F401  (used by tests/scaling)
from fp8lab.qtensor.quantize import fake_quant, quantize
from fp8lab.qtensor.quantizer import Quantizer
from fp8lab.qtensor.retile import retile, retile_counts
from fp8lab.qtensor.spec import QuantSpec
from fp8lab.qtensor.tensor import QTensor
from fp8lab.qtensor.transforms import hadamard_transform, rht16

__all__ = [
    "QTensor",
    "QuantSpec",
    "Quantizer",
    "fake_quant",
    "hadamard_transform",
    "quantize",
    "retile",
    "retile_counts",
    "rht16",
]
