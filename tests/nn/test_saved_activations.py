"""fp8lab.nn.saved_activations: nonlinearity inputs saved for backward in FP8 (COAT)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8lab.nn.saved_activations import save_quantized

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
