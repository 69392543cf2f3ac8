"""fp8lab.nn.SmoothSwiGLU: the same function as SwiGLU in exact arithmetic, per-channel powers of
two that bring each channel's max into [0.5, 1), and, quantized per tensor, an outlier channel
no longer flushes the other channels of the down projection's input."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8lab.nn import Linear, SmoothSwiGLU, convert
from fp8lab.nn.smooth_swiglu import smooth_scales
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe import Recipe


def test_scales_are_powers_of_two_bringing_each_channel_max_into_half_one():
    h = torch.tensor([[3.0, -0.2, 0.0, 1e-30], [-5.0, 0.1, 0.0, 2e-30]])
    s = smooth_scales(h)
    # independent: 2^-ceil(log2(amax)) when amax is not a power of two, else 2^-(log2+1)
    for i, amax in enumerate([5.0, 0.2, 0.0, 2e-30]):
        want = 1.0 if amax == 0 else 2.0 ** -(math.floor(math.log2(amax)) + 1)
        assert s[i].item() == want
    scaled = (h * s).abs().amax(0)
    assert torch.all((scaled[[0, 1, 3]] >= 0.5) & (scaled[[0, 1, 3]] < 1))


def test_same_function_as_swiglu_in_fp32_and_same_gradients():
    torch.manual_seed(0)
    m = SmoothSwiGLU(16, 32)
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = m(x)
    ref = F.linear(F.silu(x @ m.gate.weight.T) * (x @ m.up.weight.T), m.down.weight)
    # powers of two rescale exactly; only the summation order may differ
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    g = m.down.weight.grad.clone()
    m.zero_grad()
    ref2 = F.linear(F.silu(m.gate(x)) * m.up(x), m.down.weight)
    ref2.sum().backward()
    torch.testing.assert_close(g, m.down.weight.grad, rtol=1e-5, atol=1e-6)


def test_quantized_down_input_keeps_the_small_channels_that_swiglu_flushes():
    """Per-tensor E4M3 with a fixed scale of 1 on the down projection's input: a channel at
    1e4 next to channels at 1e-4 (below E4M3's smallest subnormal 2^-9) flushes those in plain
    SwiGLU; Smooth-SwiGLU scales each channel into [0.5, 1) first, so they survive."""
    torch.manual_seed(1)
    m = SmoothSwiGLU(8, 8)
    with torch.no_grad():
        m.gate.weight.copy_(torch.eye(8) * 10)  # silu(10 x) ~ 10 x for x > 0
        m.up.weight.copy_(torch.eye(8))
        m.down.weight.copy_(torch.eye(8))
    x = torch.full((4, 8), 3e-3)
    x[:, 0] = 30.0  # channel 0: h ~ 300 * 30 = 9e3; the others: h ~ 1e-4
    # the input alone quantized: the weight carries s^-1 in high precision here
    recipe = Recipe(name="e4m3-fixed-input", input=QuantSpec("e4m3", scaling=1.0))
    convert(m, recipe, default_exclude=False)
    assert isinstance(m.down, Linear)
    y = m(x)
    assert torch.all(y[:, 1:] != 0)
    with torch.no_grad():  # plain SwiGLU under the same recipe: the small channels flush
        plain_q = m.down(F.silu(m.gate(x)) * m.up(x))
    assert torch.all(plain_q[:, 1:] == 0)
    plain = F.linear(F.silu(m.gate(x)) * m.up(x), m.down.weight)  # unquantized reference
    torch.testing.assert_close(y[:, 1:], plain[:, 1:], rtol=0.07, atol=0)
