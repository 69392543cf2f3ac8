"""Deprecated module path: the operand buffer pool lives beside the quantizers that fill it,
`fp8lab.qtensor.quantizer` (`POOL`, `BufferPool`, `clear_buffer_cache`, `buffer_cache_limit`).

A forward's buffers are held by the autograd context and returned at the end of its backward (or
at the end of the forward when no backward will run); backward's own buffers are returned when it
ends. Buffers never leave the autograd Function (outputs and gradients are fresh tensors), and
the pool is bypassed while operands are observed, since observers may keep them.
"""

from fp8lab.qtensor.quantizer import POOL, BufferPool, buffer_cache_limit, clear_buffer_cache

__all__ = ["POOL", "BufferPool", "buffer_cache_limit", "clear_buffer_cache"]
