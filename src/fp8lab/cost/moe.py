"""Mixture of experts in the cost model: the grouped GEMMs' shapes and the token all-to-alls.

A `fp8lab.nn.GroupedLinear` expert runs its three GEMMs on the tokens routed to it, padded to
the recipe's alignment (`fp8lab.nn.grouped.group_alignment`): `expert_rows` prices routing as
uniform (``tokens * top_k / n_experts`` rows per expert, rounded up, then padded), so the padding
rows are priced as the kernels run them. `wire_traffic` gives the bytes one MoE layer's
dispatch and combine put on the wire per step, in the ``[moe] dispatch`` format
(`fp8lab.nn.moe.wire_bytes`): forward dispatch and the combine's backward in that format, the
combine's forward and the dispatch's backward in BF16. `dispatch_passes` gives the memory passes
of the wire format's quantize and dequantize (priced by `fp8lab.cost.model.price_linears` on the
MoE blocks `moe_blocks` finds among a model's Linears).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from fp8lab.nn.grouped import group_alignment
from fp8lab.nn.moe import wire_bytes
from fp8lab.recipe import Recipe

__all__ = ["dispatch_passes", "expert_rows", "moe_blocks", "wire_traffic"]


def expert_rows(tokens: int, n_experts: int, top_k: int, recipe: Recipe | None) -> int:
    """Rows one expert's GEMMs run on under uniform routing, padding included."""
    align = group_alignment(recipe)
    routed = math.ceil(tokens * top_k / n_experts)
    return math.ceil(routed / align) * align


def wire_traffic(tokens: int, d_model: int, top_k: int, dispatch: str) -> dict[str, Any]:
    """Bytes one MoE layer sends per training step: ``{"dispatch": .., "combine": ..,
    "dispatch_backward": .., "combine_backward": .., "total": ..}`` for ``tokens * top_k``
    routed rows of ``d_model`` (each all-to-all's bytes as sent; how many cross a link depends on
    the expert-parallel layout and is not modelled)."""
    rows = tokens * top_k
    d: dict[str, Any] = {
        "dispatch": wire_bytes(rows, d_model, dispatch),
        "combine": wire_bytes(rows, d_model, "bf16"),
        "dispatch_backward": wire_bytes(rows, d_model, "bf16"),
        "combine_backward": wire_bytes(rows, d_model, dispatch),
    }
    d["total"] = sum(d.values())
    return d


#: the expert Linears of one MoE block: ``PREFIX.gate.experts.E`` (and up, down)
_EXPERT = re.compile(r"^(?P<block>.+)\.(?P<part>gate|up|down)\.experts\.\d+$")


def moe_blocks(
    linears: list[tuple[str, int, int]], experts: Mapping[str, tuple[int, int]] | None
) -> dict[str, tuple[int, int]]:
    """``{block: (d_model, top_k)}`` of the MoE blocks among ``linears`` (their expert Linears
    named ``BLOCK.gate|up|down.experts.E`` in ``experts``): ``d_model`` is the in-features of
    the block's ``up`` (or ``gate``) experts, the width of the tokens dispatched."""
    out: dict[str, tuple[int, int]] = {}
    for name, i, _ in linears:
        m = _EXPERT.match(name)
        if experts is None or name not in experts or m is None or m.group("part") == "down":
            continue
        out.setdefault(m.group("block"), (i, experts[name][1]))
    return out


def dispatch_passes(tokens: int, d_model: int, top_k: int, dispatch: str) -> list[dict[str, Any]]:
    """The memory passes of one MoE block's wire format per training step, as fp8lab simulates
    it (`fp8lab.nn.moe`: quantize before the all-to-all, dequantize after): the ``tokens *
    top_k`` routed rows of width ``d_model`` quantized from bf16 (read 2 B per element, write
    `fp8lab.nn.moe.wire_bytes`) and dequantized on arrival (the reverse), for the forward
    dispatch and for the combine's backward (the expert outputs' gradients). None for BF16
    (nothing converted). ``[{"pass", "step", "read", "written"}]`` in bytes."""
    if dispatch == "bf16":
        return []
    rows = tokens * top_k
    hp, wire = 2 * rows * d_model, wire_bytes(rows, d_model, dispatch)
    return [
        {"pass": "dispatch_quantize", "step": "fprop", "read": hp, "written": wire},
        {"pass": "dispatch_dequantize", "step": "fprop", "read": wire, "written": hp},
        {"pass": "combine_grad_quantize", "step": "dgrad", "read": hp, "written": wire},
        {"pass": "combine_grad_dequantize", "step": "dgrad", "read": wire, "written": hp},
    ]


def rows_of(
    name: str, tokens: int, experts: Mapping[str, tuple[int, int]] | None, recipe: Recipe
) -> int:
    """The rows the Linear ``name`` runs on: ``tokens``, or its expert share (`expert_rows`)
    when ``experts`` maps it to ``(n_experts, top_k)``."""
    if experts is None or name not in experts:
        return tokens
    n, k = experts[name]
    return expert_rows(tokens, n, k, recipe)
