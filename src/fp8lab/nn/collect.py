"""`collect_operands`: the operands of every converted Linear's GEMMs, recorded on demand.

::

    with fp8lab.nn.collect_operands(model) as ops:       # enter it only on the steps you sample
        loss = model(x); loss.backward()
    for (layer, gemm, role), rec in ops.items():
        rec["high_precision"]  # the fp32 operand before quantization (natural layout)
        rec["used"]            # the operand the GEMM consumed (dequantized / rounded)

It registers an operand observer (`fp8lab.nn.on_operand`), which costs nothing when none is active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fp8lab.nn.linear import Linear, on_operand
from fp8lab.qtensor import QTensor

__all__ = ["OperandRecord", "collect_operands"]

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
    ``{"high_precision": ..., "used": ...}`` (detached tensors, not copies). Keys are
    ``(layer, gemm, role)``: ``gemm`` in ``fprop``/``dgrad``/``wgrad``, ``role`` in
    ``input``/``weight``/``grad_output``.
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
        used = used.dequantize() if isinstance(used, QTensor) else used.detach()
        record[(name, gemm, role)] = (
            fn(hp, used) if fn is not None else {"high_precision": hp, "used": used}
        )

    with on_operand(collect):
        yield record
