"""A batch of zero rows through a converted Linear under every preset, forward and backward: the
output and the input gradient are empty, the weight and bias gradients are zeros (a sum over no
tokens), and the layer keeps working on the next, non-empty batch."""

from __future__ import annotations

import pytest
import torch

from fp8lab.nn import Linear
from fp8lab.recipe import recipes


@pytest.mark.parametrize("name", recipes())
@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 256)])
def test_zero_tokens_forward_backward(name, shape):
    torch.manual_seed(0)
    lin = Linear(256, 128, recipe=name)
    x = torch.randn(shape, requires_grad=True)
    y = lin(x)
    assert y.shape == (*shape[:-1], 128)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert lin.weight.grad.shape == lin.weight.shape and not lin.weight.grad.any()
    assert not lin.bias.grad.any()
    x2 = torch.randn(32, 256)  # the next batch is not empty: the state survived
    y2 = lin(x2)
    y2.sum().backward()
    assert torch.isfinite(y2).all() and lin.weight.grad.any()
