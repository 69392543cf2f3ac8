"""Deprecated module path: the operand plumbing lives in `fp8lab.nn.linear` (``COLLECTORS`` is a
deprecated alias of `fp8lab.nn.on_operand`)."""

from fp8lab.nn.linear import (
    COLLECTORS,
    Operand,
    from_forward,
    gemm,
    keep_for_backward,
    prepare,
    round_high_precision,
)

__all__ = [
    "COLLECTORS",
    "Operand",
    "from_forward",
    "gemm",
    "keep_for_backward",
    "prepare",
    "round_high_precision",
]
