"""The Linear layers of a model as shapes to price: ``[(name, in_features, out_features)]``.

`linear_shapes(model)` takes the layers `fp8lab.nn.convert` would swap (the same selection,
`fp8lab.nn.select_linears`: embeddings, a tied head and the last Linear stay high precision by
default), so a model is priced as the lab trains it. `repeated_block` folds the Linears of a
stack of identical blocks (``blocks.0.attn.qkv``, ``blocks.1.attn.qkv``, ...) into one block
(``blocks.*.attn.qkv``) and its count, for per-layer tables. `other_parameters` counts the
parameters outside those Linears' weights (embeddings, norms, biases, the head), whose gradients
are communicated too.

The model is built by the caller (the CLI resolves ``--model`` factories through the lab): this
module only reads a built ``torch.nn.Module``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["block_name", "expert_routing", "linear_shapes", "other_parameters", "repeated_block"]

#: one Linear to price: (qualified name, in_features, out_features)
Shape = tuple[str, int, int]


def _in_out(layer: Any) -> tuple[int, int]:
    out_f, in_f = (int(s) for s in layer.weight.shape)
    # transformers' Conv1D (GPT-2 family) stores its weight transposed, [in, out]
    if type(layer).__name__ == "Conv1D":
        in_f, out_f = out_f, in_f
    return in_f, out_f


def linear_shapes(
    model: Any, include: Any = None, exclude: Any = None, *, default_exclude: bool = True
) -> list[Shape]:
    """``[(name, in_features, out_features)]`` of the Linears ``convert(model, recipe, include,
    exclude)`` would quantize, in registration order. ValueError if there is none."""
    from fp8lab.nn import select_linears

    names = select_linears(model, include, exclude, default_exclude=default_exclude)
    if not names:
        raise ValueError("the model has no Linear layer to quantize (nothing to price)")
    return [(n, *_in_out(model.get_submodule(n))) for n in names]


def expert_routing(model: Any) -> dict[str, tuple[int, int]]:
    """``{name: (n_experts, top_k)}`` of every expert Linear of the model's `fp8lab.nn.MoE`
    blocks (the ``linears`` a cost model prices on their share of the tokens)."""
    from fp8lab.nn import MoE

    out: dict[str, tuple[int, int]] = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            n, k = m.router.n_experts, m.router.top_k
            for part in ("gate", "up", "down"):
                for e in range(n):
                    out[f"{name}.{part}.experts.{e}"] = (n, k)
    return out


def other_parameters(model: Any, linears: list[Shape]) -> int:
    """Elements of every parameter of ``model`` except the weights of ``linears`` (shared
    parameters counted once)."""
    skip = {id(model.get_submodule(n).weight) for n, _, _ in linears}
    seen: dict[int, int] = {}
    for p in model.parameters():
        if id(p) not in skip:
            seen[id(p)] = p.numel()
    return sum(seen.values())


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def block_name(name: str) -> str:
    """``name`` with its first integer path component replaced by ``*`` (``layers.3.mlp.up`` ->
    ``layers.*.mlp.up``: the name `repeated_block` gives it); ``name`` itself without one."""
    m = _INDEX.search(name)
    return name if m is None else name[: m.start()] + "*" + name[m.end() :]


def repeated_block(linears: list[Shape]) -> tuple[list[Shape], int]:
    """(one block, number of blocks) when ``linears`` are ``L >= 2`` identical blocks: names that
    differ only in their first integer path component (``layers.3.mlp.up``), every block holding
    the same names with the same shapes in the same order. The block's names carry ``*`` for the
    index. Otherwise ``(linears, 1)``."""
    blocks: dict[str, list[Shape]] = {}
    for name, i, o in linears:
        m = _INDEX.search(name)
        if m is None:
            return list(linears), 1
        key = name[: m.start()] + "*" + name[m.end() :]
        blocks.setdefault(m.group(), []).append((key, i, o))
    groups = list(blocks.values())
    if len(groups) < 2 or any(g != groups[0] for g in groups[1:]):
        return list(linears), 1
    # the blocks must also come one after another, as a stack does
    if [s for g in groups for s in g] != [
        (n[: m.start()] + "*" + n[m.end() :], i, o)
        for n, i, o in linears
        for m in [_INDEX.search(n)]
        if m is not None
    ]:
        return list(linears), 1
    return groups[0], len(groups)
