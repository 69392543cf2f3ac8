"""`MoEConfig`: the options of a mixture-of-experts block (a recipe's ``[moe]`` table).

``dispatch`` is the wire format of the token all-to-alls of expert parallelism: what the routed
tokens are quantized to before the dispatch (forward) and what the gradients of the expert
outputs are quantized to before the combine's backward, both simulated as a
quantize-dequantize (`fp8lab.nn.moe`, docs/moe.md). The combine's forward and the dispatch's
backward stay BF16 in every format, as DeepSeek-V3 (arXiv 2412.19437, section 3.3.2) and
torchao's expert-parallel functions (``torchao/prototype/moe_training/ep/README.md``) do.

* ``"bf16"`` (the default): tokens rounded to BF16, 2 bytes per element.
* ``"fp8"``: E4M3 with one FP32 scale per 1x128 tile of the hidden dimension (DeepSeek-V3's
  FP8 dispatch: the same fine-grained 1x128 quantization as its activations), 1 byte per element
  plus 4 bytes per tile.
* ``"mxfp8"``: E4M3 in 1x32 MX blocks with E8M0 scales (torchao's MXFP8 ``a2a_dispatch``,
  ``triton_to_mxfp8_dim0``), 1 byte per element plus 1 byte per block.

A recipe whose ``[moe]`` is all defaults has no ``moe`` key in its plain data, so every earlier
fingerprint stays as it was. ``[moe]`` is a whole-model key (not allowed in ``[[layer]]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fp8lab._keys import check_choice
from fp8lab.recipe.config import OptionTable

__all__ = ["MOE_DISPATCH", "MoEConfig"]

#: the wire formats of ``[moe] dispatch``
MOE_DISPATCH = ("bf16", "fp8", "mxfp8")


@dataclass(frozen=True)
class MoEConfig(OptionTable):
    """Mixture-of-experts options (see the module docstring). Frozen, hashable plain data."""

    TABLE: ClassVar[str] = "moe"

    dispatch: str = "bf16"

    def __post_init__(self) -> None:
        check_choice(self.dispatch, MOE_DISPATCH, "moe.dispatch")
