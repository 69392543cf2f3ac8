"""fp8lab.optim: per-moment state precision, COAT's moment expansion, MS-AMP's scaled FP16
master weights, FP8-stored parameters (master none / init paths) -- against references written
here from the sources' documented algorithms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.optim import AdamW
from fp8lab.optim._storage import store_, store_expanded_

ml_dtypes = pytest.importorskip("ml_dtypes")


def _e4m3(a: np.ndarray) -> np.ndarray:
    """Round float64 ``a`` to E4M3 (saturating at 448) through ml_dtypes, back to float64."""
    return np.clip(a, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _coat_reference(x: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """COAT's expand -> quantize -> dequantize -> inverse (NVlabs/COAT
    fp8_adamw_expand_cuda_kernel.cu), in float64: (stored values, k per block)."""
    out, ks = np.empty_like(x), []
    for s in range(0, x.size, block):
        b = x[s : s + block]
        a = np.abs(b)
        mx = a.max() + 1e-30
        mn = (a[a > 0].min() if (a > 0).any() else mx - 1e-30) + 1e-30
        ratio = mx / mn
        k = (
            math.floor(math.log2(448.0 * 448.0 / 2) / math.log2(ratio) * 16) / 16
            if ratio > 1
            else 1.0
        )
        k = max(k, 1 / 16)
        g = math.sqrt(mx) * math.sqrt(mn)
        y = np.sign(b) * (a / g) ** k
        deq = np.abs(y).max() / 448.0
        yq = _e4m3(y / deq) * deq
        out[s : s + block] = np.sign(yq) * np.abs(yq) ** (1 / k) * g
        ks.append(k)
    return out, np.array(ks)


def _moments(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """m- and v-like values with COAT's typical per-group dynamic ranges (README: ~1e3 for the
    first moment, ~1e1 for the second): log-uniform magnitudes, random signs for m."""
    g = torch.Generator().manual_seed(seed)
    m = torch.exp2(torch.rand(n, generator=g) * 10 - 20) * torch.randn(n, generator=g).sign()
    v = torch.exp2(torch.rand(n, generator=g) * 3.3 - 30)
    return m, v


def test_expansion_matches_coat_reference_and_reduces_error():
    for x in _moments(1024):
        got = store_expanded_(torch.empty_like(x), x, "e4m3").double().numpy()
        ref, ks = _coat_reference(x.double().numpy())
        assert (ks > 1).all()  # moments use a fraction of E4M3's range: expansion stretches them
        # float32 powers vs float64: equal up to a few float32 ulps except where y sits on an
        # E4M3 rounding boundary (one grid step apart then)
        close = np.isclose(got, ref, rtol=1e-5, atol=0)
        assert close.mean() > 0.99
        assert np.allclose(got, ref, rtol=0.2, atol=0)
        plain = store_(torch.empty_like(x), x, "e4m3").double().numpy()
        xd = x.double().numpy()
        err_exp = np.mean(((got - xd) / xd) ** 2)
        err_plain = np.mean(((plain - xd) / xd) ** 2)
        assert err_exp < err_plain  # the point of the expansion


def test_expansion_keeps_zeros_and_refuses_non_fp8():
    x = torch.tensor([0.0, 1e-4, -2e-3, 0.0, 5e-2])
    got = store_expanded_(torch.empty_like(x), x, "e4m3")
    assert got[0] == 0 and got[3] == 0 and torch.equal(torch.sign(got), torch.sign(x))
    with pytest.raises(ValueError, match="FP8"):
        store_expanded_(torch.empty_like(x), x, "bf16")


def test_scaled_fp16_master_is_msamp_grid():
    # MS-AMP compute_scaling_factor (margin 0): s = 2^floor(log2(65504 / amax)), q = fp16(w s)
    w = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 3e-6
    got = store_(torch.empty_like(w), w, "fp16", scaled=True)
    amax = float(w.abs().max())
    s = 2.0 ** math.floor(math.log2(65504.0 / amax))
    ref = (w.double().numpy() * s).astype(np.float16).astype(np.float64) / s
    assert np.array_equal(got.double().numpy(), ref)
    plain = store_(torch.empty_like(w), w, "fp16")  # unscaled: subnormal, most bits lost
    assert (got - w).abs().max() < (plain - w).abs().max() / 4


def _step(opt, params, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()


def test_from_recipe_maps_per_moment_dtypes_and_expansion():
    rec = fp8lab.get_recipe("te-current").replace(
        exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16", moment_expansion=True
    )
    p = torch.nn.Parameter(torch.randn(4, 64))
    opt = AdamW.from_recipe([p], rec, lr=1e-2)
    assert opt.state_formats == ("e4m3", "bf16") and opt.moment_expansion
    _step(opt, [p])
    v = opt.state[p]["exp_avg_sq"]
    assert torch.equal(v, v.to(torch.bfloat16).float())  # second moment on the bf16 grid
    with pytest.raises(ValueError, match="moment_expansion"):
        AdamW([p], state_precision="bf16", moment_expansion=True)


def test_moment_expansion_is_checked_on_load():
    p = torch.nn.Parameter(torch.randn(8, 16))
    a = AdamW([p], state_precision="fp8", moment_expansion=True)
    _step(a, [p])
    b = AdamW([p], state_precision="fp8")
    with pytest.raises(ValueError, match="moment_expansion"):
        b.load_state_dict(a.state_dict())


def test_fp8_params_master_paths():
    from fp8lab.optim.adamw import HP_INIT_ATTR, requantize

    spec = fp8lab.QuantSpec("e4m3", granularity="tensor", scaling="max")
    w0 = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)) * 0.05
    p_hp, p_f8, p_none = (torch.nn.Parameter(requantize(w0, spec)) for _ in range(3))
    for p in (p_hp, p_f8, p_none):
        setattr(p, HP_INIT_ATTR, w0.clone())
    opt_hp = AdamW([p_hp], lr=1e-3, param_specs={p_hp: spec})
    opt_f8 = AdamW([p_f8], lr=1e-3, param_specs={p_f8: spec}, master_init="from_fp8")
    opt_none = AdamW([p_none], lr=1e-3, param_format="none", param_specs={p_none: spec})
    for opt, p in ((opt_hp, p_hp), (opt_f8, p_f8), (opt_none, p_none)):
        _step(opt, [p])
    # TE PR 1121's two paths: the master starts at the high-precision value or at the FP8 one
    ref_hp = w0 * (1 - 1e-3 * 1e-2)
    ref_f8 = requantize(w0, spec) * (1 - 1e-3 * 1e-2)
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 1e-2
    upd = 1e-3 * g / (g.abs() + 1e-8)  # AdamW's first step: lr * sign(g) (up to eps)
    assert torch.allclose(opt_hp.state[p_hp]["master"], ref_hp - upd, atol=1e-7)
    assert torch.allclose(opt_f8.state[p_f8]["master"], ref_f8 - upd, atol=1e-7)
    assert not torch.equal(opt_hp.state[p_hp]["master"], opt_f8.state[p_f8]["master"])
    # the parameters hold the re-quantized master; "none" keeps no master at all
    assert torch.equal(p_hp.data, requantize(opt_hp.state[p_hp]["master"], spec))
    assert "master" not in opt_none.state[p_none]
    # no master: the same update applied to the FP8 value, re-quantized
    assert torch.equal(p_none.data, requantize(opt_f8.state[p_f8]["master"], spec))
