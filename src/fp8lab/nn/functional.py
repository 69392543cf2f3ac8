"""Functional entry points of `fp8lab.nn` (the names earlier versions exported from here).

`linear` runs one layer's three GEMMs under a plan (`fp8lab.nn.function`); `attention_matmul`
(`fp8lab.nn.attention`); the operand buffer cache (`fp8lab.nn.buffers`):
`clear_buffer_cache` drops the free buffers, `buffer_cache_limit` reads or sets the limit.
"""

from fp8lab.nn.attention import attention_matmul
from fp8lab.nn.buffers import buffer_cache_limit, clear_buffer_cache
from fp8lab.nn.function import linear
from fp8lab.nn.operand import round_high_precision
from fp8lab.nn.plan import LinearPlan, build_plan

__all__ = [
    "LinearPlan",
    "attention_matmul",
    "buffer_cache_limit",
    "build_plan",
    "clear_buffer_cache",
    "linear",
    "round_high_precision",
]
