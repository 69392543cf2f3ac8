"""Whole-file checks of a recipe against the layers it is applied to (one path for every caller).

`Recipe.load` already refuses an unreadable, empty or mistyped file (every error names the file,
table and key). What only the model can tell is checked here, the same way for ``fp8lab
compare``, ``debug``, ``cost`` and `fp8lab.nn.convert`:

* `check_layer_rules`: every ``[[layer]]`` rule must match at least one converted layer;
* `check_shapes`: each quantized GEMM operand must tile its blocks along K (the reduced axis) and N
  (the output axis); a blockwise GPU kernel (DeepGEMM, Transformer Engine's blockwise and MXFP8
  GEMMs) requires whole blocks, so a shape that does not tile is refused rather than priced.

Errors are `RecipeFileError` (a ValueError) naming the file (`Recipe.path`) or, for a recipe
built in Python, its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fp8lab.recipe.config import BACKWARD_OPERANDS, GEMM_OPERANDS, GEMMS, RecipeFileError

__all__ = ["check_layer_rules", "check_shapes", "origin"]


def origin(recipe: Any) -> str:
    """``recipe file 'PATH'`` for a recipe read from a file, else ``recipe 'NAME'``."""
    path = getattr(recipe, "path", "")
    return f"recipe file {path!r}" if path else f"recipe {recipe.name!r}"


def check_layer_rules(recipe: Any, names: Sequence[str]) -> None:
    """Raise naming the file when a ``[[layer]]`` rule of ``recipe`` matches none of ``names``
    (the qualified names of the converted layers)."""
    names = list(names)
    for i, rule in enumerate(recipe.layers, 1):
        if not any(rule.matches(n) for n in names):
            raise RecipeFileError(
                f"{origin(recipe)}: [[layer]] {i} match {list(rule.match)} matches no "
                f"converted Linear layer; converted: {names}"
            )


def _operand_shape(role: str, tokens: int, k_in: int, n_out: int) -> tuple[int, int]:
    """A role's tensor in its natural layout: input [tokens, in], weight [out, in],
    grad_output [tokens, out]."""
    return {
        "input": (tokens, k_in),
        "weight": (n_out, k_in),
        "grad_output": (tokens, n_out),
    }[role]


def _dequantized(rec: Any, gemm: str, role: str) -> bool:
    """Whether (gemm, role) takes the earlier GEMM's quantized copy dequantized (``operand_source
    = "saved_dequantized"`` with such a copy made): it quantizes nothing of its own."""
    earlier = BACKWARD_OPERANDS[gemm].get(role)
    return (
        earlier is not None
        and rec.gemm(gemm).source(role) == "saved_dequantized"
        and rec.gemm(earlier).high_precision is None
        and rec.spec(earlier, role) is not None
    )


def check_shapes(recipe: Any, linears: Iterable[tuple[str, int, int]], tokens: int) -> None:
    """Raise naming the file, layer, GEMM, operand and dimension when a quantized operand of
    ``recipe`` does not tile its block shape on the Linears ``(name, in, out)`` with ``tokens``
    rows (each layer under its own ``[[layer]]`` rules)."""
    problems: list[str] = []
    for name, k_in, n_out in linears:
        rec = recipe.for_layer(name)
        for g in GEMMS:
            for role, reduced_first in GEMM_OPERANDS[g]:
                if rec.precision(g, role) is not None or _dequantized(rec, g, role):
                    continue
                spec = rec.spec(g, role)
                if spec is None:
                    continue
                rows, cols = _operand_shape(role, tokens, k_in, n_out)
                bm, bk = spec.block
                if reduced_first:  # the GEMM uses the transposed blocks (re-tiling)
                    bm, bk = bk, bm
                for size, b, axis in ((rows, bm, "rows"), (cols, bk, "columns")):
                    if b != -1 and size % b:
                        problems.append(
                            f"layer {name!r} {g} {role} [{rows}, {cols}]: {size} {axis} are "
                            f"not a multiple of the block {b}"
                        )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise RecipeFileError(
            f"{origin(recipe)}: GEMM shapes that do not tile the recipe's blocks: "
            + "; ".join(problems[:3])
            + more
        )
