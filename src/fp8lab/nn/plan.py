"""`LinearPlan`: a recipe resolved once for one module, every per-call decision precomputed.

For each GEMM (``fprop`` y = x·Wᵀ, ``dgrad`` dx = dy·W, ``wgrad`` dW = (xᵀ·dy)ᵀ) and each of its
two operands an `OperandPlan`: its `fp8lab.qtensor.Quantizer` (the spec, transposed when the GEMM
reduces the operand along its first axis — re-tiling: ``1x128`` -> ``128x1`` — and, for delayed
scaling, the module's `DelayedScaling` of that role), or the GEMM's high-precision rounding, and
how the backward obtains the operand from the forward's (`Reuse`):

* ``SAME``: the earlier GEMM's operand serves as is (the same rounding, fp32 as is, or the same
  quantization: per-tensor x for fprop and wgrad, W for fprop and dgrad, dy for dgrad and wgrad);
* ``RETILE``: ``save_for_backward="quantized"`` and only the blocks differ: re-tile the earlier
  quantized tensor (DeepSeek-V3, arXiv 2412.19437 §3.3: dequantize, re-quantize into new tiles);
* ``SOURCE``: keep the fp32 tensor and prepare it afresh (``save_for_backward="high_precision"``).

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
from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe

__all__ = ["GemmPlan", "LinearPlan", "OperandPlan", "Reuse", "build_plan"]

#: (earlier GEMM, later GEMM, role): the operand a backward GEMM may take from an earlier one
CHAINS = (
    ("fprop", "dgrad", "weight"),
    ("fprop", "wgrad", "input"),
    ("dgrad", "wgrad", "grad_output"),
)


class Reuse(enum.Enum):
    """How a later GEMM obtains its operand from the earlier GEMM's (see the module doc)."""

    SAME = "same"
    RETILE = "retile"
    SOURCE = "source"


@dataclass(frozen=True)
class OperandPlan:
    """One operand of one GEMM: ``quantizer`` (GEMM orientation, owning the module's delayed
    state of the role; None: not quantized) and its pure ``spec``, or the ``high_precision``
    rounding of the GEMM or of this (GEMM, role) cell (``"fp32"``/``"bf16"``/``"fp16"``; None:
    quantized or fp32 as is). ``reuse``: how it comes from the earlier GEMM of the same role
    (None for the first use). ``retile_source``: a later GEMM re-tiles this operand's quantized
    values, so its dequantized copy is written while quantizing. ``layer``: the module's name
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


def _reuse(recipe: Recipe, specs: dict, nominal: dict, src: str, dst: str, role: str) -> Reuse:
    hp_src, hp_dst = recipe.precision(src, role), recipe.precision(dst, role)
    s_src, s_dst = specs[(src, role)], specs[(dst, role)]
    quantized_src = hp_src is None and s_src is not None
    if hp_src is not None and nominal[(src, role)] is not None and hp_dst is None and s_dst:
        # a high-precision cell: the later GEMM gets what it would get without the switch,
        # from the cell's nominal quantization (its shadow)
        if nominal[(src, role)] == s_dst:
            return Reuse.SAME
        return Reuse.RETILE if recipe.save_for_backward == "quantized" else Reuse.SOURCE
    if hp_dst is not None:
        return Reuse.SAME if hp_src == hp_dst else Reuse.SOURCE
    if s_dst is None:
        return Reuse.SAME if hp_src is None and s_src is None else Reuse.SOURCE
    if quantized_src and s_src == s_dst:
        return Reuse.SAME
    if recipe.save_for_backward == "quantized" and quantized_src:
        return Reuse.RETILE
    return Reuse.SOURCE


def build_plan(recipe: Recipe, state: ScalingState, name: str | None = None) -> LinearPlan:
    """Resolve ``recipe`` for a module whose delayed-scaling objects are ``state``."""
    cells = [(g, r) for g in GEMMS for r, _ in GEMM_OPERANDS[g]]
    specs = {(g, r): _cell(recipe, g, r) for g, r in cells}
    nominal = {(g, r): _cell(recipe, g, r, nominal=True) for g, r in cells}
    reuse = {
        (dst, role): _reuse(recipe, specs, nominal, src, dst, role) for src, dst, role in CHAINS
    }
    retile_sources = {
        (src, role) for src, dst, role in CHAINS if reuse[(dst, role)] is Reuse.RETILE
    }
    # a high-precision cell whose later (quantized) GEMM takes its nominal quantization
    shadows = {
        (src, role): nominal[(src, role)]
        for src, dst, role in CHAINS
        if reuse[(dst, role)] in (Reuse.RETILE, Reuse.SAME)
        and specs[(src, role)] is None
        and nominal[(src, role)] is not None
        and specs[(dst, role)] is not None
        and recipe.precision(dst, role) is None
    }
    made: dict[_Cell, Quantizer] = {}
    gemms = {}
    for g in GEMMS:
        cfg = recipe.gemm(g)
        ops = tuple(
            OperandPlan(
                gemm=g,
                role=role,
                spec=None if specs[(g, role)] is None else specs[(g, role)].spec,
                high_precision=recipe.precision(g, role),
                first_axis=first_axis,
                fp32_accumulate=cfg.accumulator.kind == "fp32",
                reuse=reuse.get((g, role)),
                retile_source=(g, role) in retile_sources,
                layer=name,
                shadow=None if (g, role) not in shadows else shadows[(g, role)].spec,
                quantizer=_quantizer(specs[(g, role)], state, made),
                shadow_quantizer=_quantizer(shadows.get((g, role)), state, made),
            )
            for role, first_axis in GEMM_OPERANDS[g]
        )
        gemms[g] = GemmPlan(g, _resolved(cfg.accumulator, ops), ops)  # type: ignore[arg-type]
    return LinearPlan(recipe=recipe, name=name, **gemms)


def _resolved(acc: Accumulator, ops: tuple[OperandPlan, ...]) -> Accumulator:
    """The accumulator resolved for the GEMM's operand formats (a GPU name picks its row) when
    both operands are quantized (the only case that runs it); else as given."""
    if all(op.quantizer is not None and op.high_precision is None for op in ops):
        return acc.resolve(ops[0].spec.format, ops[1].spec.format)  # type: ignore[union-attr]
    return acc
