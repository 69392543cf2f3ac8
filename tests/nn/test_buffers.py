"""nn's operand buffer cache: reusing buffers never changes a result, never leaks into outputs,
and survives several forwards held at once (micro-batches) and forwards without backward."""

import copy

import pytest
import torch

from fp8lab.nn import Linear
from fp8lab.nn import functional as F8
from fp8lab.qtensor.quantizer import POOL
from fp8lab.recipe import get_recipe

RECIPES = ["te-current", "deepseek-v3-fp32", "deepseek-v3", "mxfp8", "bf16", "te-delayed"]


def _recipe(name):
    if name == "deepseek-v3-fp32":
        return get_recipe("deepseek-v3").with_accumulator("fp32")
    return get_recipe(name)


def _steps(mod, xs, dy):
    outs = []
    for x in xs:
        x = x.detach().clone().requires_grad_()
        mod.zero_grad(set_to_none=True)
        y = mod(x)
        y.backward(dy)
        outs.append((y.detach(), x.grad, mod.weight.grad, mod.bias.grad))
    return outs


@pytest.fixture
def no_cache():
    old = F8.buffer_cache_limit()
    F8.buffer_cache_limit(0)
    yield
    F8.buffer_cache_limit(old)


def _data(seed=0, t=160, i=256, o=192):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, i, generator=g) * (1 + 10 * k) for k in range(3)]
    return xs, torch.randn(t, o, generator=g)


def _bits_equal(a, b):
    return torch.equal(torch.nan_to_num(a).view(torch.int32), torch.nan_to_num(b).view(torch.int32))


@pytest.mark.parametrize("name", RECIPES)
def test_cached_buffers_give_the_same_bits_as_fresh_ones(name, request):
    xs, dy = _data()
    torch.manual_seed(1)
    base = torch.nn.Linear(256, 192)
    cached = _steps(Linear.from_linear(copy.deepcopy(base), _recipe(name)), xs, dy)
    assert POOL.free_bytes > 0  # buffers were returned for reuse
    request.getfixturevalue("no_cache")
    assert POOL.free_bytes == 0
    fresh = _steps(Linear.from_linear(copy.deepcopy(base), _recipe(name)), xs, dy)
    assert POOL.free_bytes == 0  # limit 0: nothing retained
    for a, b in zip(cached, fresh, strict=True):
        assert all(_bits_equal(u, v) for u, v in zip(a, b, strict=True)), name


@pytest.mark.parametrize("name", ["deepseek-v3-fp32", "te-current", "mxfp8", "bf16"])
def test_micro_batches_held_at_once(name):
    # two forwards keep their operands alive together before either backward runs
    xs, dy = _data(seed=2)
    torch.manual_seed(3)
    base = torch.nn.Linear(256, 192)
    ref = _steps(Linear.from_linear(copy.deepcopy(base), _recipe(name)), xs[:2], dy)
    mod = Linear.from_linear(copy.deepcopy(base), _recipe(name))
    x0, x1 = (x.detach().clone().requires_grad_() for x in xs[:2])
    y0, y1 = mod(x0), mod(x1)
    y1.backward(dy)
    dw1 = mod.weight.grad.clone()
    mod.zero_grad(set_to_none=True)
    y0.backward(dy)
    assert torch.equal(y0, ref[0][0]) and torch.equal(y1, ref[1][0])
    assert torch.equal(x0.grad, ref[0][1]) and torch.equal(x1.grad, ref[1][1])
    assert torch.equal(mod.weight.grad, ref[0][2]) and torch.equal(dw1, ref[1][2])


def test_outputs_never_alias_cached_buffers():
    xs, dy = _data(seed=4)
    mod = Linear(256, 192, recipe=_recipe("deepseek-v3-fp32"))
    with torch.no_grad():
        y0 = mod(xs[0])
        keep = y0.clone()
        assert POOL.free_bytes > 0  # no backward will run: buffers returned at once
        for x in xs[1:]:
            mod(x)
    assert torch.equal(y0, keep)
    x = xs[0].clone().requires_grad_()
    y = mod(x)
    y.backward(dy)
    grads = (x.grad.clone(), mod.weight.grad.clone())
    _steps(mod, xs[1:], dy * 3)
    assert torch.equal(x.grad, grads[0]) and torch.equal(y, keep)


def test_buffer_cache_limit_and_clear():
    old = F8.buffer_cache_limit()
    try:
        assert F8.buffer_cache_limit(1 << 20) == 1 << 20
        with pytest.raises(ValueError, match="max_bytes"):
            F8.buffer_cache_limit(-1)
        xs, dy = _data(seed=5, t=8, i=32, o=16)
        _steps(Linear(32, 16, recipe="te-current"), xs, dy)
        assert 0 < POOL.free_bytes <= 1 << 20
        F8.clear_buffer_cache()
        assert POOL.free_bytes == 0
    finally:
        F8.buffer_cache_limit(old)
