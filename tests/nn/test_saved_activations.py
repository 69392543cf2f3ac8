"""fp8lab.nn.saved_activations: nonlinearity inputs saved for backward in FP8 (COAT)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8lab.nn.saved_activations import save_quantized
from fp8lab.nn.smooth_swiglu import smooth_scales

ml_dtypes = pytest.importorskip("ml_dtypes")


def _saved_reference(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with one current scale (448 / amax) per 1 x 16 group of the last axis, written here."""
    a = x.detach().numpy().astype(np.float32).reshape(-1, 16)
    amax = np.abs(a).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, np.float32(448.0) / np.where(amax > 0, amax, 1), 1).astype(
        np.float32
    )
    q = (a * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy((q * (np.float32(1) / scale)).reshape(x.shape))


@pytest.mark.parametrize("fn", [F.gelu, F.silu])
def test_forward_exact_backward_at_the_saved_fp8_input(fn):
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(6, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (6, 1), generator=g))
    ).requires_grad_()
    y = save_quantized(fn, (x,))
    assert torch.equal(y, fn(x.detach()))  # the forward output is the high-precision one
    gy = torch.randn(6, 64, generator=g)
    (gx,) = torch.autograd.grad(y, x, gy)
    xr = _saved_reference(x).requires_grad_()
    (ref,) = torch.autograd.grad(fn(xr), xr, gy)
    assert torch.allclose(gx, ref, rtol=1e-6, atol=1e-7)  # derivative evaluated at Q(x)
    (exact,) = torch.autograd.grad(fn(x), x, gy)
    assert not torch.equal(gx, exact)


def test_norm_with_parameters_and_two_quantized_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g, requires_grad=True)
    w = torch.randn(32, generator=g, requires_grad=True)
    y = save_quantized(lambda x, w: F.layer_norm(x, (32,), w), (x,), (w,))
    y.sum().backward()
    xr = _saved_reference(x).requires_grad_()
    wr = w.detach().clone().requires_grad_()
    F.layer_norm(xr, (32,), wr).sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
    a, b = (torch.randn(4, 32, generator=g, requires_grad=True) for _ in range(2))
    save_quantized(lambda a, b: F.silu(a) * b, (a, b)).sum().backward()
    ar, br = (_saved_reference(t).requires_grad_() for t in (a, b))
    (F.silu(ar) * br).sum().backward()
    assert torch.allclose(a.grad, ar.grad, rtol=1e-6, atol=1e-7)
    assert torch.allclose(b.grad, br.grad, rtol=1e-6, atol=1e-7)


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def test_smooth_swiglu_saves_the_products_inputs_in_fp8(threads):
    """SmoothSwiGLU under ``save_activations = "quantized"``: the forward is the high-precision
    one bit for bit; the backward evaluates silu's derivative and the product at the saved
    FP8 gate and up outputs (the gradient written out here by hand)."""
    import fp8lab
    from fp8lab.nn import SmoothSwiGLU

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = SmoothSwiGLU(32, 48)  # plain Linears: only the saved inputs are quantized
    x = torch.randn(5, 32, requires_grad=True)
    gy = torch.randn(5, 32)
    rec = fp8lab.get_recipe("te-current")
    with fp8lab.nn.autocast(rec):
        y0 = m(x)
    (dx0,) = torch.autograd.grad(y0, x, gy)
    with fp8lab.nn.autocast(rec.replace(save_activations="quantized")):
        y = m(x)
    (dx,) = torch.autograd.grad(y, x, gy)
    assert torch.equal(y, y0)
    with torch.no_grad():
        wg, wu, wd = m.gate.weight, m.up.weight, m.down.weight
        g, u = x @ wg.T, x @ wu.T
        s = smooth_scales(F.silu(g) * u)
        dh = (gy @ (wd / s)) * s  # through the folded down projection
        gq, uq = _saved_reference(g), _saved_reference(u)
        ref = (dh * _silu_grad(gq) * uq) @ wg + (dh * F.silu(gq)) @ wu
    assert torch.allclose(dx, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(dx, dx0, rtol=1e-5, atol=1e-6)  # the exact gradient is another


def test_moe_experts_save_the_products_inputs_in_fp8(threads):
    """The MoE experts' SwiGLU saves its inputs like the dense MLP's: forward unchanged, the
    gradients of the gate and up outputs evaluated at their saved FP8 values (written out)."""
    import fp8lab
    from fp8lab.nn import MoE

    torch.set_num_threads(1)
    torch.manual_seed(1)
    moe = MoE(32, 32, 4, 2)  # plain experts: only the saved inputs are quantized
    x = torch.randn(6, 32)
    rec = fp8lab.get_recipe("te-current")
    seen: dict[str, torch.Tensor] = {}

    def keep(key):
        def hook(m, args, out=None):
            t = args[0] if out is None else out
            t.retain_grad()
            seen[key] = t

        return hook

    hooks = [moe.gate.register_forward_hook(keep("g")), moe.up.register_forward_hook(keep("u")),
             moe.down.register_forward_pre_hook(keep("h"))]  # fmt: skip
    with fp8lab.nn.autocast(rec):
        y0 = moe(x)
    y0.sum().backward()
    dg0 = seen["g"].grad
    with fp8lab.nn.autocast(rec.replace(save_activations="quantized")):
        y = moe(x)
    y.sum().backward()
    for h in hooks:
        h.remove()
    assert torch.equal(y, y0)
    g, u, dh = seen["g"].detach(), seen["u"].detach(), seen["h"].grad
    gq, uq = _saved_reference(g), _saved_reference(u)
    assert torch.allclose(seen["g"].grad, dh * _silu_grad(gq) * uq, rtol=1e-5, atol=1e-7)
    assert torch.allclose(seen["u"].grad, dh * F.silu(gq), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(seen["g"].grad, dg0, rtol=1e-5, atol=1e-7)
