"""fp8lab.optim: AdamW with master weights and low-precision states, LossScaler, clipping."""

import copy
import math

import pytest
import torch

import fp8lab
from fp8lab.optim import AdamW, LossScaler, clip_grad_norm_, grad_norm, grads_finite
from fp8lab.optim._storage import round_to, store_


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train(model, opt, steps=5, seed=1, scaler=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


# ---------------------------------------------------------------------- storage rounding
def test_round_to_bf16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    x = torch.randn(4096) * 10.0 ** torch.randint(-20, 20, (4096,)).float()
    ref = x.numpy().astype(ml_dtypes.bfloat16).astype(np.float32)
    assert torch.equal(round_to(x, "bf16"), torch.from_numpy(ref))


def test_store_fp8_block_scaled_is_on_grid_and_blockwise():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    torch.manual_seed(0)
    # two blocks of very different magnitude: per-block scaling must keep both accurate
    v = torch.cat([torch.randn(128) * 1e-6, torch.randn(128) * 1e3])
    st = torch.empty_like(v)
    store_(st, v, "e4m3", block=128)
    for b in range(2):
        blk, got = v[b * 128 : (b + 1) * 128], st[b * 128 : (b + 1) * 128]
        rel = ((got - blk).abs() / blk.abs().max()).max()
        assert rel <= 2.0**-4  # half an E4M3 ulp at the top binade, relative to amax
        # values are exactly (power-of-two scale) x (E4M3 grid point)
        scale = 2.0 ** math.floor(math.log2(448.0 / float(blk.abs().max())))
        scaled = (got * scale).numpy()
        assert np.array_equal(scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), scaled)
        assert float(blk.abs().max()) * scale <= 448.0


# ---------------------------------------------------------------------- AdamW
def test_adamw_fp32_equals_torch_adamw_bitwise():
    m1, m2 = _model(), _model()
    o1 = AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    _train(m1, o1)
    _train(m2, o2)
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prec", ["bf16", "fp8", ("fp8", "bf16")])
def test_adamw_low_precision_states_are_rounded_and_close(prec):
    m1, m2 = _model(), _model()
    o1 = AdamW(m1.parameters(), lr=1e-3, state_precision=prec)
    o2 = AdamW(m2.parameters(), lr=1e-3)
    _train(m1, o1)
    _train(m2, o2)
    fm, _ = o1.state_formats
    p = next(iter(m1.parameters()))
    m = o1.state[p]["exp_avg"]
    if fm == "bf16":
        assert torch.equal(m, round_to(m, "bf16"))
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(m1.parameters(), m2.parameters(), strict=True)
    )
    assert 0 < diff < 1e-3  # different from fp32 states, but only by rounding


def test_adamw_master_weights_for_bf16_params():
    m = _model()
    o = AdamW(m.parameters(), lr=1e-4, param_format="bf16")
    p0 = [p.detach().clone() for p in m.parameters()]
    _train(m, o, steps=3)
    for p, q in zip(m.parameters(), p0, strict=True):
        master = o.master_weight(p)
        assert master is not p and master.dtype == torch.float32
        assert torch.equal(p, round_to(master, "bf16"))
        assert not torch.equal(master, q)
    # a real bf16 parameter keeps an fp32 master
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    o2 = AdamW([w], lr=1e-5, weight_decay=0.0)
    for _ in range(3):
        w.grad = torch.ones_like(w)
        o2.step()
    master = o2.master_weight(w)
    assert master.dtype == torch.float32
    # 3 steps of 1e-5 are below the bf16 spacing at 1.0 (2^-7): only the master moves
    assert float(master[0]) < 1.0 and float(w.detach()[0]) == 1.0


def test_adamw_skips_nonfinite_and_counts():
    m = _model()
    o = AdamW(m.parameters(), lr=1e-2)
    _train(m, o, steps=1)
    before = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    next(iter(m.parameters())).grad[0, 0] = float("nan")
    o.step()
    assert o.skipped_steps == 1 and o.last_step_skipped
    for p, q in zip(m.parameters(), before, strict=True):
        assert torch.equal(p, q)
        assert torch.isfinite(p).all()


def test_adamw_state_dict_round_trip_and_mismatch():
    m1 = _model()
    o1 = AdamW(m1.parameters(), lr=1e-2, state_precision="bf16", param_format="bf16")
    _train(m1, o1, steps=2)
    sd_m, sd_o = copy.deepcopy(m1.state_dict()), copy.deepcopy(o1.state_dict())
    _train(m1, o1, steps=2, seed=7)
    m2 = _model(5)
    m2.load_state_dict(sd_m)
    o2 = AdamW(m2.parameters(), lr=1e-2, state_precision="bf16", param_format="bf16")
    o2.load_state_dict(sd_o)
    _train(m2, o2, steps=2, seed=7)
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    o3 = AdamW(_model().parameters(), state_precision="fp8")
    with pytest.raises(ValueError, match="state formats"):
        o3.load_state_dict(sd_o)


def test_adamw_bad_arguments():
    ps = _model().parameters()
    with pytest.raises(ValueError, match="storage precision"):
        AdamW(ps, state_precision="int3")
    with pytest.raises(ValueError, match="betas"):
        AdamW(_model().parameters(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(_model().parameters(), max_grad_norm=0)


def test_adamw_clipping():
    w = torch.nn.Parameter(torch.zeros(4))
    o = AdamW([w], lr=1.0, weight_decay=0.0, max_grad_norm=1.0)
    w.grad = torch.full((4,), 10.0)
    o.step()
    assert float(o.last_grad_norm) == pytest.approx(20.0)
    assert float(grad_norm([w])) == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------------- clipping helpers
def test_clip_grad_norm_leaves_nonfinite_untouched():
    a = torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(clip_grad_norm_([a], 1.0)) == pytest.approx(5.0)
    assert torch.allclose(a.grad, torch.tensor([0.6, 0.8, 0.0]), atol=1e-6)
    a.grad = torch.tensor([float("inf"), 1.0, 0.0])
    n = clip_grad_norm_([a], 1.0)
    assert not math.isfinite(float(n)) and float(a.grad[1]) == 1.0
    assert not grads_finite([a])
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([a], -1.0)


# ---------------------------------------------------------------------- LossScaler
def test_loss_scaler_is_exported_top_level():
    assert fp8lab.LossScaler is LossScaler


def _step_with_grad(scaler, opt, w, value):
    opt.zero_grad()
    w.grad = torch.full_like(w, value)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped


def test_dynamic_scaler_growth_and_backoff():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.0)
    s = LossScaler(growth_interval=3)
    assert s.get_scale() == 2.0**16
    for _ in range(3):
        assert _step_with_grad(s, opt, w, 1.0)
    assert s.get_scale() == 2.0**17
    assert not _step_with_grad(s, opt, w, float("inf"))
    assert s.get_scale() == 2.0**16 and s.skipped_steps == 1
    # growth counter restarted by the overflow
    for _ in range(2):
        _step_with_grad(s, opt, w, 1.0)
    assert s.get_scale() == 2.0**16


def test_scaler_hysteresis_and_static():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.0)
    s = LossScaler(hysteresis=2)
    _step_with_grad(s, opt, w, float("nan"))
    assert s.get_scale() == 2.0**16  # first overflow tolerated
    _step_with_grad(s, opt, w, float("nan"))
    assert s.get_scale() == 2.0**15 and s.skipped_steps == 2
    st = LossScaler(128.0, dynamic=False)
    _step_with_grad(st, opt, w, float("nan"))
    assert st.get_scale() == 128.0 and st.skipped_steps == 1


def test_scaler_unscales_gradients_and_skips():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    s = LossScaler(8.0)
    loss = (w * 3.0).sum()
    s.scale(loss).backward()
    assert torch.equal(w.grad, torch.full((2,), 24.0))
    assert s.step(opt)
    s.update()
    assert torch.equal(w, torch.full((2,), -2.0))  # 1 - 1.0 * 3
    w.grad = torch.tensor([float("inf"), 0.0])
    assert not s.step(opt)
    s.update()
    assert torch.equal(w, torch.full((2,), -2.0))


def test_scaler_training_loop_with_adamw_never_nan():
    m = _model()
    opt = AdamW(m.parameters(), lr=1e-3)
    s = LossScaler(2.0**127, max_scale=2.0**127)  # overflows at first: backs off
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        loss = m(torch.randn(8, 16, generator=g)).pow(2).sum() * 1e4
        opt.zero_grad()
        s.scale(loss).backward()
        s.step(opt)
        s.update()
    assert s.skipped_steps >= 1 and s.get_scale() < 2.0**127
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_scaler_state_dict_and_bad_args():
    s = LossScaler(growth_interval=5, hysteresis=3)
    s._growth_tracker = 2
    s2 = LossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="missing"):
        s2.load_state_dict({"scale": 1.0})
    for kw in ({"init_scale": 0.0}, {"backoff_factor": 1.5}, {"hysteresis": 0}):
        with pytest.raises(ValueError):
            LossScaler(**kw)


def test_from_recipe():
    opt = AdamW.from_recipe(_model().parameters(), "deepseek-v3", lr=1e-3)
    assert opt.state_formats == ("bf16", "bf16") and opt.param_format is None
    assert LossScaler.from_recipe("te-current") is None
    s = LossScaler.from_recipe("fp16-amp")
    assert s.dynamic and s.get_scale() == 2.0**16
    with pytest.raises(ValueError, match="unknown recipe"):
        AdamW.from_recipe(_model().parameters(), "nope")


def test_loss_scaler_from_recipe_is_the_one_recipe_to_scaler_path():
    # what the training lab needs: no recipe and "none" -> None, static / dynamic from the
    # recipe's loss_scale, constructor options passed through
    from fp8lab.recipe import Recipe

    assert LossScaler.from_recipe(None) is None
    assert LossScaler.from_recipe(Recipe(loss_scaling="none")) is None
    s = LossScaler.from_recipe(Recipe(loss_scaling="static", loss_scale=1024.0))
    assert not s.dynamic and s.get_scale() == 1024.0
    d = LossScaler.from_recipe("fp16-amp", growth_interval=7, hysteresis=2)
    assert d.dynamic and d.growth_interval == 7 and d.hysteresis == 2
