"""fp8lab.nn.Linear follows ``.to(device)`` with its delayed-scaling state (issue 24).

The state (scale, amax history, step, ...) is plain tensors outside the module's buffers, so the
module moves it itself (`Linear._apply`): to another device yes, to another dtype never. On a
machine without CUDA the move is tested with the ``meta`` device; the CUDA round trip runs only
where CUDA is available.
"""

from __future__ import annotations

import pytest
import torch

from fp8lab.nn import Linear, autocast
from fp8lab.recipe import get_recipe


def _trained(recipe: str = "te-delayed") -> Linear:
    torch.manual_seed(0)
    lin = Linear(32, 16, recipe=recipe)
    x = torch.randn(8, 32, requires_grad=True)
    lin(x).square().sum().backward()
    return lin


def _state_tensors(lin: Linear) -> list[torch.Tensor]:
    states = [lin._state, *lin._other_states.values()]
    return [t for st in states for ds in st.by_key.values() for t in ds.state.tensors().values()]


def test_scaling_state_follows_the_module_device() -> None:
    lin = _trained()
    with autocast(get_recipe("hif8-delayed")):  # a second recipe's state (autocast override)
        lin(torch.randn(4, 32))
    assert lin._other_states
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    assert _state_tensors(lin) and all(t.device.type == "cpu" for t in _state_tensors(lin))
    lin.to("meta")
    assert lin.weight.is_meta
    assert all(t.is_meta for t in _state_tensors(lin))
    lin.to_empty(device="cpu")  # back on the CPU (values undefined): the state follows
    assert all(t.device.type == "cpu" for t in _state_tensors(lin))
    lin.load_state_dict(before)
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_scaling_state_keeps_its_dtype() -> None:
    lin = _trained()
    dtypes = [t.dtype for t in _state_tensors(lin)]
    lin.to(torch.float64)
    assert lin.weight.dtype == torch.float64
    assert [t.dtype for t in _state_tensors(lin)] == dtypes  # float32 scales by design


def test_moved_state_is_the_one_the_plan_uses() -> None:
    """After a move the module keeps training with the moved state (the plan's quantizers hold
    the DelayedScaling objects, not their tensors)."""
    ref, moved = _trained(), _trained()
    moved.to("cpu")  # same device: nothing to move, tensors kept
    moved.to("meta").to_empty(device="cpu")
    moved.load_state_dict(ref.state_dict())
    x = torch.randn(8, 32)
    assert torch.equal(ref(x), moved(x))
    for a, b in zip(_state_tensors(ref), _state_tensors(moved), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_bit_identical() -> None:  # pragma: no cover - CUDA only
    ref, lin = _trained(), _trained()
    lin.cuda()
    assert all(t.is_cuda for t in _state_tensors(lin))
    x = torch.randn(8, 32)
    y_gpu = lin(x.cuda()).cpu()
    assert torch.equal(ref(x), y_gpu)
    lin.cpu()
    for a, b in zip(_state_tensors(ref), _state_tensors(lin), strict=True):
        assert torch.equal(a, b)
