"""Functional entry points of `fp8lab.nn` (the names earlier versions exported from here).

`linear` runs one layer's three GEMMs under a plan (`fp8lab.nn.linear`); `attention_matmul`
(`fp8lab.nn.attention`); the operand buffer cache (`fp8lab.qtensor.quantizer`):
`clear_buffer_cache` drops the free buffers, `buffer_cache_limit` reads or sets the limit.
`operand` and `dense` remain as deprecated aliases of `fp8lab.nn.operand.prepare` and
`Operand.dense`.
"""

from __future__ import annotations

import warnings

import torch

from fp8lab.nn.attention import attention_matmul
from fp8lab.nn.linear import linear, prepare, round_high_precision
from fp8lab.nn.plan import LinearPlan, build_plan
from fp8lab.qtensor import QTensor
from fp8lab.qtensor.quantizer import buffer_cache_limit, clear_buffer_cache

__all__ = [
    "LinearPlan",
    "attention_matmul",
    "buffer_cache_limit",
    "build_plan",
    "clear_buffer_cache",
    "dense",
    "linear",
    "operand",
    "round_high_precision",
]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"fp8lab.nn.functional.{old} is deprecated; use {new}", DeprecationWarning,
                  stacklevel=3)  # fmt: skip


def operand(
    x: torch.Tensor,
    plan: LinearPlan,
    gemm: str,
    role: str,
    scratch: bool = False,
    held: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, QTensor | None]:
    """Deprecated: ``fp8lab.nn.operand.prepare(x, plan.<gemm>[role], held)``. Returns the old
    pair: ``(tensor, None)`` for an unquantized operand, ``(None, QTensor)`` for a quantized one
    (``x`` in its natural layout; ``scratch`` is ignored)."""
    _deprecated("operand", "fp8lab.nn.operand.prepare")
    used = prepare(x, getattr(plan, gemm)[role], held).used
    return (None, used) if isinstance(used, QTensor) else (used, None)


def dense(a: torch.Tensor | None, q: QTensor | None) -> torch.Tensor:
    """Deprecated: ``Operand.dense()``. The float32 tensor of an ``operand`` pair."""
    _deprecated("dense", "fp8lab.nn.operand.Operand.dense")
    return a if q is None else q.dequantize()
