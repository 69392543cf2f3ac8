"""Mixture of experts in the cost model: the grouped GEMMs' shapes and the token all-to-alls.

A `fp8lab.nn.GroupedLinear` expert runs its three GEMMs on the tokens routed to it, padded to
the recipe's alignment (`fp8lab.nn.grouped.group_alignment`): `expert_rows` prices routing as
uniform (``tokens * top_k / n_experts`` rows per expert, rounded up, then padded), so the padding
rows are priced as the kernels run them. `wire_traffic` gives the bytes one MoE layer's
dispatch and combine put on the wire per step, in the ``[moe] dispatch`` format
(`fp8lab.nn.moe.wire_bytes`): forward dispatch and the combine's backward in that format, the
combine's forward and the dispatch's backward in BF16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fp8lab.nn.grouped import group_alignment
from fp8lab.nn.moe import wire_bytes
from fp8lab.recipe import Recipe

__all__ = ["expert_rows", "wire_traffic"]


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


def rows_of(
    name: str, tokens: int, experts: Mapping[str, tuple[int, int]] | None, recipe: Recipe
) -> int:
    """The rows the Linear ``name`` runs on: ``tokens``, or its expert share (`expert_rows`)
    when ``experts`` maps it to ``(n_experts, top_k)``."""
    if experts is None or name not in experts:
        return tokens
    n, k = experts[name]
    return expert_rows(tokens, n, k, recipe)
