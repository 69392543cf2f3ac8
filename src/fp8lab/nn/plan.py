"""`LinearPlan`: a recipe resolved once for one module, every per-call decision precomputed.

For each GEMM (``fprop`` y = x·Wᵀ, ``dgrad`` dx = dy·W, ``wgrad`` dW = (xᵀ·dy)ᵀ) and each of its
two operands an `OperandPlan`: its `fp8lab.qtensor.Quantizer` (the spec, transposed when the GEMM
reduces the operand along its first axis — re-tiling: ``1x128`` -> ``128x1`` — and, for delayed
scaling, the module's `DelayedScaling` of that role), or the GEMM's high-precision rounding, and
how the backward obtains the operand from the forward's (`Reuse`):

* ``SAME``: the earlier GEMM's operand serves as is (the same rounding, fp32 as is, or the same
  quantization — equal spec and delayed state: per-tensor x for fprop and wgrad, W for fprop and
  dgrad, dy for dgrad and wgrad; 128x128 and 16x16 weight blocks, which transpose to themselves);
* ``RETILE``: re-quantize the earlier GEMM's saved quantized copy into this GEMM's blocks (its
  dequantized values, quantized again: DeepSeek-V3, arXiv 2412.19437 §3.3.3 and §3.5.2);
* ``SOURCE``: quantize (or round) the high-precision tensor afresh (TE's quantizers make the
  column-wise copy from the high-precision tensor; dy is live in the backward);
* ``DEQUANTIZE``: the earlier GEMM's saved quantized copy, dequantized, used as is: the GEMM
  multiplies it in fp32 (`OperandPlan.high_precision` ``"fp32"``); in a GEMM run in high
  precision, rounded to that precision (TE's ``backward_override="dequantized"``: the copy
  dequantized to bf16).

Which one is decided by construction from `fp8lab.recipe.GemmConfig.operand_source` of the later
GEMM (`source_of`): ``auto`` is the source system's choice (docs/recipes.md): dy and W are live
in high precision in every system, so their later copies come from them (shared when they
quantize alike); x comes from the saved quantized copy under ``save_for_backward="quantized"``
when only the blocks differ (DeepSeek-V3's re-tiled activations), else from the high-precision
tensor (TE: the column-wise copy made in the same pass as the row-wise one).

A single (GEMM, role) cell in high precision (`fp8lab.recipe.GemmConfig.high_precision_roles`)
changes only that operand: where a later GEMM re-tiles the earlier operand's quantized values,
the earlier operand is still quantized under its nominal spec (its ``shadow``) for that GEMM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fp8lab.gemm import Accumulator
from fp8lab.nn.state import ScalingState, state_key
from fp8lab.qtensor import Quantizer, QuantSpec
from fp8lab.recipe import BACKWARD_OPERANDS, GEMM_OPERANDS, GEMMS, Recipe

__all__ = ["GemmPlan", "LinearPlan", "OperandPlan", "Reuse", "build_plan", "source_of"]

#: (earlier GEMM, later GEMM, role): the operand a backward GEMM may take from an earlier one
CHAINS = tuple(
    (src, dst, role) for dst, roles in BACKWARD_OPERANDS.items() for role, src in roles.items()
)


class Reuse(enum.Enum):
    """How a later GEMM obtains its operand from the earlier GEMM's (see the module doc)."""

    SAME = "same"
    RETILE = "retile"
    SOURCE = "source"
    DEQUANTIZE = "dequantize"


@dataclass(frozen=True)
class OperandPlan:
    """One operand of one GEMM: ``quantizer`` (GEMM orientation, owning the module's delayed
    state of the role; None: not quantized) and its pure ``spec``, or the ``high_precision``
    rounding of the GEMM or of this (GEMM, role) cell (``"fp32"``/``"bf16"``/``"fp16"``; None:
    quantized or fp32 as is; ``"fp32"`` with ``Reuse.DEQUANTIZE``: the saved copy's dequantized
    values, multiplied in fp32). ``reuse``: how it comes from the earlier GEMM of the same role
    (None for the first use). ``retile_source``: a later GEMM re-tiles or dequantizes this
    operand's quantized values, so its dequantized copy is written while quantizing. ``layer``: the module's name
    (operand observers). ``shadow``: for a high-precision cell whose later GEMM re-tiles it, the
    spec it would have been quantized under (quantized as well, for that GEMM only, by
    ``shadow_quantizer``)."""

    gemm: str
    role: str
    spec: QuantSpec | None
    high_precision: str | None
    first_axis: bool
    fp32_accumulate: bool
    reuse: Reuse | None
    retile_source: bool
    layer: str | None
    shadow: QuantSpec | None = None
    quantizer: Quantizer | None = None
    shadow_quantizer: Quantizer | None = None

    @property
    def quantized(self) -> bool:
        return self.high_precision is None and self.spec is not None

    def wants_dense(self, shape: tuple[int, ...]) -> bool:
        """Will the dequantized operand be needed: re-tiling's input, or an fp32-accumulated GEMM
        whose scales vary along K (it runs on the dequantized operands)."""
        if self.retile_source:
            return True
        q = self.quantizer
        if not self.fp32_accumulate or len(shape) != 2 or q is None:
            return False
        return q.varies_along((shape[0], shape[1]), 0 if self.first_axis else 1)


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM: its accumulator and its two operands by role."""

    name: str
    accumulator: Accumulator
    operands: tuple[OperandPlan, OperandPlan]

    def __getitem__(self, role: str) -> OperandPlan:
        for op in self.operands:
            if op.role == role:
                return op
        raise KeyError(f"{role!r} is not an operand of {self.name}")


@dataclass(frozen=True)
class LinearPlan:
    """A recipe resolved for one module and one `ScalingState`: the three GEMMs."""

    recipe: Recipe
    name: str | None
    fprop: GemmPlan
    dgrad: GemmPlan
    wgrad: GemmPlan


@dataclass(frozen=True)
class _Cell:
    """What quantizes (gemm, role): the spec in the GEMM's orientation and, for delayed scaling,
    the state key (two cells quantize alike only if both are equal)."""

    spec: QuantSpec
    key: str | None


def _cell(recipe: Recipe, gemm: str, role: str, nominal: bool = False) -> _Cell | None:
    """The quantization of (gemm, role), None when in high precision; ``nominal``: ignoring a
    high-precision cell (a whole high-precision GEMM still gives None)."""
    hp = recipe.gemm(gemm).high_precision if nominal else recipe.precision(gemm, role)
    s = None if hp else recipe.spec(gemm, role)
    if s is None:
        return None
    if dict(GEMM_OPERANDS[gemm])[role]:
        s = s.transposed()
    return _Cell(s, state_key(recipe, gemm, role) if s.is_delayed else None)


def _quantizer(cell: _Cell | None, state: ScalingState, made: dict) -> Quantizer | None:
    """One quantizer per distinct cell (cells that quantize alike share one)."""
    if cell is None:
        return None
    if cell not in made:
        made[cell] = Quantizer(cell.spec, None if cell.key is None else state.by_key[cell.key])
    return made[cell]


def source_of(recipe: Recipe, later: str, role: str, saved: QuantSpec, target: QuantSpec) -> str:
    """Where the backward GEMM ``later`` takes ``role``: its `GemmConfig.operand_source`, or for
    ``auto`` the source system's choice (docs/recipes.md), given the earlier GEMM's quantized
    copy ``saved`` and this GEMM's ``target`` spec (both in their GEMM orientation).

    ``auto``: dy (live in the backward) and W (the master weight) come from the high-precision
    tensor in every system; x comes from the saved quantized copy when ``save_for_backward`` is
    ``"quantized"`` and only the blocks differ (DeepSeek-V3 caches its activations in 1x128
    tiles and re-tiles them into 128x1), else from the high-precision tensor (Transformer
    Engine's quantizers make the column-wise copy in the same pass as the row-wise one)."""
    choice = recipe.gemm(later).source(role)
    if choice != "auto":
        return choice
    if (
        role == "input"
        and recipe.save_for_backward == "quantized"
        and saved.replace(granularity=target.granularity) == target
    ):
        return "saved_quantized"
    return "high_precision"


def _reuse(recipe: Recipe, specs: dict, nominal: dict, src: str, dst: str, role: str) -> Reuse:
    hp_src, hp_dst = recipe.precision(src, role), recipe.precision(dst, role)
    s_src, s_dst = specs[(src, role)], specs[(dst, role)]
    if hp_dst is not None and s_src is not None and _dequantized_source(recipe, dst, role):
        return Reuse.DEQUANTIZE  # TE's backward_override="dequantized": the saved copy, rounded
    if hp_dst is not None:  # the later GEMM rounds the high-precision tensor
        return Reuse.SAME if hp_src == hp_dst else Reuse.SOURCE
    if s_dst is None:  # fp32 as is
        return Reuse.SAME if hp_src is None and s_src is None else Reuse.SOURCE
    # the quantized copy the earlier GEMM made: its own, or a high-precision cell's nominal one
    # (its shadow: the later GEMM gets what it would get without the switch)
    saved = s_src if hp_src is None else nominal[(src, role)]
    if saved is None:  # nothing quantized to share, re-tile or dequantize
        return Reuse.SOURCE
    choice = source_of(recipe, dst, role, saved.spec, s_dst.spec)
    if choice == "saved_dequantized":
        return Reuse.DEQUANTIZE
    if saved == s_dst:  # one quantization serves both GEMMs (same spec and delayed state)
        return Reuse.SAME
    return Reuse.RETILE if choice == "saved_quantized" else Reuse.SOURCE


def _dequantized_source(recipe: Recipe, gemm: str, role: str) -> bool:
    return recipe.gemm(gemm).source(role) == "saved_dequantized"


def build_plan(recipe: Recipe, state: ScalingState, name: str | None = None) -> LinearPlan:
    """Resolve ``recipe`` for a module whose delayed-scaling objects are ``state``."""
    cells = [(g, r) for g in GEMMS for r, _ in GEMM_OPERANDS[g]]
    specs = {(g, r): _cell(recipe, g, r) for g, r in cells}
    nominal = {(g, r): _cell(recipe, g, r, nominal=True) for g, r in cells}
    reuse = {
        (dst, role): _reuse(recipe, specs, nominal, src, dst, role) for src, dst, role in CHAINS
    }
    from_saved = (Reuse.RETILE, Reuse.DEQUANTIZE)
    retile_sources = {(src, role) for src, dst, role in CHAINS if reuse[(dst, role)] in from_saved}
    # a high-precision cell whose later (quantized) GEMM takes its nominal quantization
    shadows = {
        (src, role): nominal[(src, role)]
        for src, dst, role in CHAINS
        if reuse[(dst, role)] in (*from_saved, Reuse.SAME)
        and specs[(src, role)] is None
        and nominal[(src, role)] is not None
        and specs[(dst, role)] is not None
        and recipe.precision(dst, role) is None
    }
    made: dict[_Cell, Quantizer] = {}
    gemms = {}
    for g in GEMMS:
        cfg = recipe.gemm(g)
        ops = []
        for role, first_axis in GEMM_OPERANDS[g]:
            cell = specs[(g, role)]
            hp = recipe.precision(g, role)
            if reuse.get((g, role)) is Reuse.DEQUANTIZE:  # the saved copy's values, rounded
                cell, hp = None, hp or "fp32"  # to the GEMM's precision (fp32: as they are)
            ops.append(
                OperandPlan(
                    gemm=g,
                    role=role,
                    spec=None if cell is None else cell.spec,
                    high_precision=hp,
                    first_axis=first_axis,
                    fp32_accumulate=cfg.accumulator.kind == "fp32",
                    reuse=reuse.get((g, role)),
                    retile_source=(g, role) in retile_sources,
                    layer=name,
                    shadow=None if (g, role) not in shadows else shadows[(g, role)].spec,
                    quantizer=_quantizer(cell, state, made),
                    shadow_quantizer=_quantizer(shadows.get((g, role)), state, made),
                )
            )
        ops = tuple(ops)
        gemms[g] = GemmPlan(g, _resolved(cfg.accumulator, ops), ops)  # type: ignore[arg-type]
    return LinearPlan(recipe=recipe, name=name, **gemms)


def _resolved(acc: Accumulator, ops: tuple[OperandPlan, ...]) -> Accumulator:
    """The accumulator resolved for the GEMM's operand formats (a GPU name picks its row) when
    both operands are quantized (the only case that runs it); else as given."""
    if all(op.quantizer is not None and op.high_precision is None for op in ops):
        return acc.resolve(ops[0].spec.format, ops[1].spec.format)  # type: ignore[union-attr]
    return acc
