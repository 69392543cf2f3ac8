"""``rht_gemms = "wgrad"`` (TE's NVFP4 random Hadamard transform on the wgrad operands): fprop and
dgrad are bit-identical to the recipe without it, and the wgrad GEMM equals the untransformed
product ``dyᵀ x`` within a bound derived from the operands' errors.

The bound. Along the token axis each run of 16 tokens of x and of dy is multiplied by the BF16
matrix ``M`` (`fp8lab.qtensor.transforms.hadamard_matrix`): entries ``±1/4``, so ``M Mᵀ = I``
exactly and, with exact arithmetic, ``(x M)ᵀ``-style products cancel: ``Σ_t a_t b_t = Σ_t dy_t
x_t`` for ``a = M``-transformed dy and ``b = M``-transformed x (computed here in float64). The
GEMM multiplies the quantized transformed operands ``Ã = a + δa`` and ``B̃ = b + δb`` (``δ``: the
BF16 roundings and the FP4 quantization, whatever their size), so for every entry ``(i, j)``

    |Ãᵢᵀ B̃ⱼ - dyᵢᵀ xⱼ| <= ‖δaᵢ‖‖bⱼ‖ + ‖aᵢ‖‖δbⱼ‖ + ‖δaᵢ‖‖δbⱼ‖ + 1.01 T u Σ_t |Ã_ti B̃_tj|

(Cauchy-Schwarz over the T tokens, plus the FP32 accumulation of T products, ``u = 2**-24``).
The check can fail: pairing the transformed dy with an untransformed x breaks the bound by far.
"""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.nn import Linear, on_operand
from fp8lab.qtensor.transforms import hadamard_matrix

T, IN, OUT = 64, 48, 32


def _run(rec, x, dy, seed: int = 0):
    torch.manual_seed(seed)
    mod = Linear(IN, OUT, recipe=rec, name="lin")
    torch.manual_seed(seed + 1)  # the same stochastic-rounding draws under both recipes
    seen: dict = {}
    xx = x.clone().requires_grad_()
    with on_operand(lambda layer, g, r, src, used: seen.__setitem__((g, r), (src, used))):
        y = mod(xx)
        y.backward(dy)
    return y.detach(), xx.grad, mod.weight.grad, seen


def _along_tokens(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``v`` [T, C] with every run of 16 tokens of each column times ``m`` (float64)."""
    t, c = v.shape
    return (v.double().T.reshape(c, t // 16, 16) @ m).reshape(c, t).T


def test_rht_on_wgrad_leaves_fprop_and_dgrad_and_cancels_in_wgrad():
    m = hadamard_matrix(16).double()
    assert torch.equal(m @ m.T, torch.eye(16, dtype=torch.float64))  # orthogonal, exactly
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, IN, generator=g) * 2.0
    x[5, 7] = 40.0  # an outlier: what the transform spreads over its 16-token block
    dy = torch.randn(T, OUT, generator=g) * 1e-3
    rht = fp8lab.get_recipe("nvfp4-te")
    plain = rht.replace(rht_gemms="none")
    y1, dx1, dw1, seen = _run(rht, x, dy)
    y0, dx0, dw0, seen0 = _run(plain, x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)  # fprop and dgrad untouched
    assert not torch.equal(dw1, dw0)  # the wgrad operands did change
    qa, qb = seen[("wgrad", "grad_output")][1], seen[("wgrad", "input")][1]
    assert qa.spec.rht and qb.spec.rht and not seen0[("wgrad", "input")][1].spec.rht
    a, b = _along_tokens(dy, m), _along_tokens(x, m)
    ta, tb = qa.dequantize().double(), qb.dequantize().double()
    da, db = ta - a, tb - b
    exact = dy.double().T @ x.double()  # [OUT, IN]
    na, nb, nda, ndb = a.norm(dim=0), b.norm(dim=0), da.norm(dim=0), db.norm(dim=0)
    bound = nda[:, None] * nb[None, :] + na[:, None] * ndb[None, :] + nda[:, None] * ndb[None, :]
    bound += 1.01 * T * 2.0**-24 * (ta.abs().T @ tb.abs())
    err = (dw1.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # the errors are the quantization's: FP4 with 1x16 blocks, a few tens of percent at most
    assert float(nda.norm() / na.norm()) < 0.25 and float(ndb.norm() / nb.norm()) < 0.25
    # pairing the transformed dy with an untransformed x does not cancel
    wrong = (ta.T @ x.double() - exact).abs()
    assert bool((wrong > bound).any())


def test_rht_needs_tokens_in_whole_16_blocks():
    mod = Linear(IN, OUT, recipe="nvfp4-te")
    x = torch.randn(24, IN, requires_grad=True)
    with pytest.raises(ValueError, match="16"):
        mod(x).sum().backward()
