"""`BufferPool`: buffers keyed by (shape, device, dtype), allocated on the operand's device.

A pool keyed by shape alone handed a CPU buffer to a CUDA operand (issue 32, part 3); ``meta``
stands in for the second device here.
"""

from __future__ import annotations

import pytest
import torch

from fp8lab.qtensor.quantizer import BufferPool

META = torch.device("meta")
CPU = torch.device("cpu")


def test_allocates_on_the_requested_device_and_dtype() -> None:
    pool, held = BufferPool(), []
    a = pool.take((2, 3), held, META)
    b = pool.take((2, 3), held, CPU, torch.bfloat16)
    c = pool.take((2, 3), held, CPU)
    assert (a.device, a.dtype, a.shape) == (META, torch.float32, (2, 3))
    assert (b.device, b.dtype) == (CPU, torch.bfloat16)
    assert (c.device, c.dtype) == (CPU, torch.float32)
    assert held == [a, b, c]


def test_a_buffer_is_reused_only_for_its_own_device_and_dtype() -> None:
    pool, held = BufferPool(), []
    cpu32 = pool.take((4,), held, CPU)
    meta32 = pool.take((4,), held, META)
    cpu16 = pool.take((4,), held, CPU, torch.bfloat16)
    pool.give(held)
    assert held == []
    assert pool.free_bytes == 4 * 4 + 4 * 4 + 2 * 4  # each by its own element size
    again = []
    assert pool.take((4,), again, META) is meta32
    assert pool.take((4,), again, CPU, torch.bfloat16) is cpu16
    assert pool.take((4,), again, CPU) is cpu32
    fresh = pool.take((4,), again, META)  # the only meta buffer is held: a new one
    assert fresh.is_meta and fresh is not meta32
    assert pool.free_bytes == 0


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_pool_never_hands_another_devices_buffer(device: str) -> None:
    """The failure the device key fixes: a CPU buffer returned, then asked for on meta."""
    pool, held = BufferPool(), []
    other = "cpu" if device == "meta" else "meta"
    pool.take((8, 8), held, torch.device(other))
    pool.give(held)
    buf = pool.take((8, 8), held, torch.device(device))
    assert buf.device.type == device


def test_limit_counts_bytes_of_every_dtype() -> None:
    pool, held = BufferPool(max_bytes=12), []
    pool.take((3,), held, CPU)  # 12 bytes: kept
    pool.take((3,), held, CPU, torch.bfloat16)  # 6 bytes more: over the limit, dropped
    pool.give(held)
    assert pool.free_bytes == 12
    assert sum(len(v) for v in pool.free.values()) == 1
