"""L3: PyTorch integration — train any model under a simulated low-precision recipe.

Two lines, as with Transformer Engine or torchao::

    fp8lab.nn.convert(model, "te-delayed")         # swap nn.Linear -> fp8lab.nn.Linear in place
    with fp8lab.autocast():                        # optional: micro-batch amax accumulation
        loss = model(x).loss

* :class:`Linear` — drop-in ``torch.nn.Linear`` (same init, same ``weight``/``bias`` keys plus
  scaling state) running fprop / dgrad / wgrad under a :class:`fp8lab.Recipe`.
* :func:`convert` — selects Linear layers by name (globs, ``re.Pattern``); by default keeps
  embeddings, the output head (:data:`DEFAULT_EXCLUDE` names, a Linear tied to an embedding, the
  last Linear) in high precision. :func:`select_linears` previews the choice, :func:`converted`
  lists converted layers.
* :func:`autocast` — ``with autocast(recipe):`` overrides the recipe of converted modules in the
  block (a different recipe keeps its own delayed-scaling state, not saved in the state_dict).
* :func:`attention_matmul` — ``q @ kᵀ`` and ``p @ v`` for a model's attention: quantized when the
  recipe sets ``attention=True`` (off by default, like TE's fp8_dpa), plain matmul otherwise.

Operand collection (for per-layer, per-GEMM, per-role statistics every k steps)::

    with fp8lab.nn.collect_operands(model) as ops:       # enter it only on the steps you sample
        loss = model(x); loss.backward()
    for (layer, gemm, role), rec in ops.items():
        rec["high_precision"]  # the fp32 operand before quantization (natural layout)
        rec["used"]            # the operand the GEMM consumed (dequantized / rounded)

``collect_operands(model, fn=f)`` stores ``f(high_precision, used)`` instead of the tensors (e.g.
a dict of statistics from `fp8lab.stats`), so nothing large is kept. Keys use the names given by
:func:`convert` (qualified module names); ``gemm`` in ``fprop``/``dgrad``/``wgrad``, ``role`` in
``input``/``weight``/``grad_output``. The hook costs nothing when no collection is active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fp8lab.nn.convert import (
    DEFAULT_EXCLUDE,
    active_recipe,
    autocast,
    convert,
    converted,
    select_linears,
)
from fp8lab.nn.functional import COLLECTORS, attention_matmul
from fp8lab.nn.modules import Linear

__all__ = [
    "DEFAULT_EXCLUDE",
    "Linear",
    "OperandRecord",
    "active_recipe",
    "attention_matmul",
    "autocast",
    "collect_operands",
    "convert",
    "converted",
    "select_linears",
]

OperandKey = tuple[str, str, str]


class OperandRecord(dict):
    """``{(layer, gemm, role): record}`` filled by :func:`collect_operands` (last call wins)."""

    def layers(self) -> list[str]:
        return sorted({k[0] for k in self})


@contextlib.contextmanager
def collect_operands(
    model: torch.nn.Module | None = None,
    *,
    fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
) -> Iterator[OperandRecord]:
    """Record the operands of every converted Linear's GEMMs while the block runs.

    ``model``: restrict to its converted layers (unnamed ones are named after their qualified
    module name). ``fn(high_precision, used)``: store its result instead of
    ``{"high_precision": ..., "used": ...}`` (detached tensors, not copies).
    """
    record = OperandRecord()
    allowed: set[str] | None = None
    if model is not None:
        allowed = set()
        for n, m in model.named_modules():
            if isinstance(m, Linear):
                if m.name is None:
                    m.name = n
                allowed.add(m.name)

    def collect(name: str, gemm: str, role: str, hp: torch.Tensor, used: Any) -> None:
        if allowed is not None and name not in allowed:
            return
        hp = hp.detach()
        used = used.detach() if isinstance(used, torch.Tensor) else used
        record[(name, gemm, role)] = (
            fn(hp, used) if fn is not None else {"high_precision": hp, "used": used}
        )

    COLLECTORS.active.append(collect)
    try:
        yield record
    finally:
        COLLECTORS.active.remove(collect)
