"""`DPAConfig`: the options of FP8 dot-product attention (a recipe's ``[dpa]`` table).

The recipe's bool ``attention`` says whether attention runs in FP8 (Transformer Engine's
``fp8_dpa``); ``[dpa]`` says how (`fp8lab.nn.DotProductAttention`, docs/attention.md). All
defaults reproduce TE with ``NVTE_DPA_FP8_RECIPE`` unset, so a recipe whose ``[dpa]`` is all
defaults has no ``dpa`` key in its plain data (every earlier fingerprint stays as it was).

Fields (TE names in parentheses; ``transformer_engine/pytorch/attention/dot_product_attention/
dot_product_attention.py``):

* ``scaling`` (``NVTE_DPA_FP8_RECIPE``): ``"auto"`` follows the recipe's roles as TE follows the
  autocast recipe (delayed roles -> ``"delayed"``, MX blocks -> ``"mxfp8"``, anything else ->
  ``"current"``); ``"delayed"`` (all six quantizers delayed), ``"current"`` (QKV, O, dO, dQKV
  current; S and dP delayed, as TE does), ``"mxfp8"`` (QKV, O, dO, dQKV in 1x32 MX blocks; S
  and dP are handled inside TE's fused kernel and are modelled here with per-tensor current
  scaling: an assumption, docs/attention.md).
* ``fp8_mha``: the attention output O (and, under current scaling, dQKV) leaves in FP8.
* ``amax_history_len``, ``amax_compute_algo`` (``NVTE_DPA_FP8DS_AMAX_HISTLEN``,
  ``NVTE_DPA_FP8DS_AMAX_ALGO``; TE's defaults 1 and ``most_recent``): the delayed scaling of
  the states attention makes itself (S and dP under ``"current"``; every state under
  ``"delayed"`` when the recipe's roles have no delayed scaling to reuse).
* ``path``: ``"te"`` (TE's fused FP8 attention, forward and backward) or ``"fa"`` (the
  forward-only FlashAttention-3 style path: P cast to E4M3 with the fixed offset
  ``2**p_prescale_log2`` and no other scale, the row sums and logsumexp kept exact; its
  backward runs in high precision).
* ``p_prescale_log2``: ``8`` (FlashAttention-3's FP8 forward, arXiv 2407.08608) or ``0`` (no
  offset: the flaw flashinfer PR 5020 fixes). Only the ``"fa"`` path reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fp8lab._keys import check_choice
from fp8lab.recipe.config import OptionTable
from fp8lab.scaling.delayed import ALGORITHMS

__all__ = ["DPA_PATHS", "DPA_PRESCALES", "DPA_SCALINGS", "DPAConfig"]

DPA_SCALINGS = ("auto", "delayed", "current", "mxfp8")
DPA_PATHS = ("te", "fa")
DPA_PRESCALES = (0, 8)


@dataclass(frozen=True)
class DPAConfig(OptionTable):
    """FP8 attention options (see the module docstring). Frozen, hashable plain data."""

    TABLE: ClassVar[str] = "dpa"

    scaling: str = "auto"
    fp8_mha: bool = False
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    path: str = "te"
    p_prescale_log2: int = 8

    def __post_init__(self) -> None:
        check_choice(self.scaling, DPA_SCALINGS, "dpa.scaling")
        check_choice(self.path, DPA_PATHS, "dpa.path")
        check_choice(self.amax_compute_algo, ALGORITHMS, "dpa.amax_compute_algo")
        if not isinstance(self.fp8_mha, bool):
            raise TypeError(f"dpa.fp8_mha must be a bool, got {self.fp8_mha!r}")
        for name in ("amax_history_len", "p_prescale_log2"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"dpa.{name} must be an integer, got {v!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"dpa.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.p_prescale_log2 not in DPA_PRESCALES:
            raise ValueError(
                f"dpa.p_prescale_log2 must be 8 (FlashAttention-3's offset) or 0 (none), "
                f"got {self.p_prescale_log2!r}"
            )
