"""The pool of float32 operand buffers shared by every converted Linear.

A fresh 32 MB tensor costs more than the quantization pass that fills it (page faults on first
touch: ~21 ms vs ~6 ms on the development machine), so operand buffers (quantized values, their
dequantized copy, bf16-rounded operands) come from here. A forward's buffers are held by the
autograd context and returned at the end of its backward (or at the end of the forward when no
backward will run); backward's own buffers are returned when it ends. Buffers never leave the
autograd Function (outputs and gradients are fresh tensors), and the pool is bypassed while
operands are being collected, since the collector keeps them.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["POOL", "BufferPool", "buffer_cache_limit", "clear_buffer_cache"]


class BufferPool:
    """Free float32 buffers by shape, reused across calls and modules; at most ``max_bytes`` of
    free buffers are retained."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.free_bytes = 0
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, ...], held: list[torch.Tensor]) -> torch.Tensor:
        """A float32 buffer of ``shape`` (contents undefined), appended to ``held``."""
        with self.lock:
            lst = self.free.get(shape)
            buf = lst.pop() if lst else None
            if buf is not None:
                self.free_bytes -= 4 * buf.numel()
        if buf is None:
            buf = torch.empty(shape, dtype=torch.float32)
        held.append(buf)
        return buf

    def give(self, held: list[torch.Tensor]) -> None:
        """Return every buffer of ``held`` (their users are dead) and empty the list."""
        with self.lock:
            for buf in held:
                nbytes = 4 * buf.numel()
                if self.free_bytes + nbytes > self.max_bytes:
                    continue
                self.free.setdefault(tuple(buf.shape), []).append(buf)
                self.free_bytes += nbytes
        held.clear()

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.free_bytes = 0


POOL = BufferPool()


def clear_buffer_cache() -> None:
    """Drop the free operand buffers kept by `fp8lab.nn` (see `buffer_cache_limit`)."""
    POOL.clear()


def buffer_cache_limit(max_bytes: int | None = None) -> int:
    """The limit (bytes) on free operand buffers kept for reuse; set it when ``max_bytes`` is
    given (0 disables reuse). Returns the limit in force. Default 1 GiB."""
    if max_bytes is not None:
        if int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        POOL.max_bytes = int(max_bytes)
        if POOL.free_bytes > POOL.max_bytes:
            POOL.clear()
    return POOL.max_bytes
