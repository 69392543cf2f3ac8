"""`fp8lab.nn.on_operand`: the one hook point of operand observers."""

import pytest
import torch

from fp8lab.nn import Linear, on_operand
from fp8lab.qtensor import QTensor


def _step(layer: Linear) -> None:
    layer(torch.randn(8, 32, requires_grad=True)).sum().backward()


def test_observer_sees_every_operand_until_removed() -> None:
    layer = Linear(32, 16, recipe="te-delayed", name="fc")
    seen = []
    handle = on_operand(lambda *a: seen.append(a))
    _step(layer)
    cells = {(a[0], a[1], a[2]) for a in seen}
    assert cells == {
        ("fc", g, r)
        for g, roles in (
            ("fprop", ("input", "weight")),
            ("dgrad", ("grad_output", "weight")),
            ("wgrad", ("grad_output", "input")),
        )
        for r in roles
    }
    assert all(isinstance(a[4], QTensor) for a in seen)  # quantized: the QTensor itself
    handle.remove()
    handle.remove()  # idempotent
    seen.clear()
    _step(layer)
    assert seen == []


def test_handle_is_a_context_manager_and_observers_are_per_thread() -> None:
    layer = Linear(32, 16, recipe="te-current")
    seen = []
    with on_operand(lambda *a: seen.append(a[1])):
        _step(layer)
    n = len(seen)
    assert n == 6
    _step(layer)
    assert len(seen) == n


def test_on_operand_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        on_operand(42)  # type: ignore[arg-type]
