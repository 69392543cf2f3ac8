"""Functional entry points of `fp8lab.nn` (the names earlier versions exported from here).

`linear` runs one layer's three GEMMs under a plan (`fp8lab.nn.linear`); `attention_matmul`
(`fp8lab.nn.attention`); the operand buffer cache (`fp8lab.qtensor.quantizer`):
`clear_buffer_cache` drops the free buffers, `buffer_cache_limit` reads or sets the limit.
"""

from __future__ import annotations

from fp8lab.nn.attention import attention_matmul
from fp8lab.nn.linear import linear, round_high_precision
from fp8lab.nn.plan import LinearPlan, build_plan
from fp8lab.qtensor.quantizer import buffer_cache_limit, clear_buffer_cache

__all__ = [
    "LinearPlan",
    "attention_matmul",
    "buffer_cache_limit",
    "build_plan",
    "clear_buffer_cache",
    "linear",
    "round_high_precision",
]
