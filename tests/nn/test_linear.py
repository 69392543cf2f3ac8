"""fp8lab.nn.Linear: exactness against torch and hand-written references, per-GEMM overrides,
delayed scaling timing, state_dict round trip and its errors, autocast, operand collection."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fp8lab
from fp8lab.nn import Linear, autocast, collect_operands
from fp8lab.qtensor import QuantSpec, fake_quant, quantize, retile_counts
from fp8lab.recipe import get_recipe
from fp8lab.scaling.delayed import DelayedScaling


def _pair(recipe, in_f=64, out_f=32, bias=True, seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_f, out_f, bias=bias)
    torch.manual_seed(seed)
    mod = Linear(in_f, out_f, bias=bias, recipe=recipe)
    return ref, mod


def _run(mod, x, dy):
    x = x.detach().clone().requires_grad_()
    y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad, mod.weight.grad, None if mod.bias is None else mod.bias.grad


@pytest.mark.parametrize("shape", [(6, 64), (3, 5, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_recipe_equals_torch_linear_bitwise(shape, bias):
    ref, mod = _pair("fp32", bias=bias)
    assert torch.equal(ref.weight, mod.weight)  # same init
    assert set(ref.state_dict()) <= set(mod.state_dict())
    x = torch.randn(shape)
    dy = torch.randn(*shape[:-1], 32)
    for a, b in zip(_run(ref, x, dy), _run(mod, x, dy), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_te_current_equals_hand_written_reference():
    _, mod = _pair("te-current", 256, 128)
    x, dy = torch.randn(48, 256), torch.randn(48, 128)
    y, dx, dw, db = _run(mod, x, dy)
    w, b = mod.weight.detach(), mod.bias.detach()
    e4, e5 = QuantSpec("e4m3", scaling="max"), QuantSpec("e5m2", scaling="max")

    def q(t, spec):  # by hand: scale = fmt_max / amax, cast, keep 1/scale
        s = torch.tensor(spec.fmt.max, dtype=torch.float32) / t.abs().amax()
        return fp8lab.cast(t * s, spec.format), torch.reciprocal(s)

    (xv, xs), (wv, ws), (gv, gs) = q(x, e4), q(w, e4), q(dy, e5)
    # hardware semantics: GEMM of the grid values, then both dequantization multipliers
    assert torch.equal(y, (xv @ wv.t()).mul_(xs * ws).add_(b))
    assert torch.equal(dx, (gv @ wv).mul_(gs * ws))
    assert torch.equal(dw, (xv.t() @ gv).mul_(xs * gs).t())
    assert torch.equal(db, dy.sum(0))
    # ... which is fp8lab.quantize + fp8lab.qmatmul
    qx, qw = quantize(x, e4), quantize(w, e4)
    assert torch.equal(y, fp8lab.qmatmul(qx, qw.t()) + b)


def _gemm_errors(recipe, x, dy, w):
    mod = Linear(w.shape[1], w.shape[0], bias=False, recipe=recipe)
    with torch.no_grad():
        mod.weight.copy_(w)
    y, dx, dw, _ = _run(mod, x, dy)
    return (
        float((y - x @ w.t()).abs().max()),
        float((dx - dy @ w).abs().max()),
        float((dw - (x.t() @ dy).t()).abs().max()),
    )


@pytest.mark.parametrize("base", ["te-current", "te-delayed", "deepseek-v3", "mxfp8"])
def test_each_override_moves_only_its_gemm_to_high_precision(base):
    torch.manual_seed(1)
    x, dy, w = torch.randn(256, 256), torch.randn(256, 128), torch.randn(128, 256)
    rec = get_recipe(base).with_accumulator("fp32")
    errs = _gemm_errors(rec, x, dy, w)
    assert all(e > 1e-3 for e in errs)
    for i, g in enumerate(("fprop", "dgrad", "wgrad")):
        e32 = _gemm_errors(rec.with_high_precision(g, precision="fp32"), x, dy, w)
        ebf = _gemm_errors(rec.with_high_precision(g, precision="bf16"), x, dy, w)
        assert e32[i] == 0.0  # exactly the fp32 GEMM
        assert 0 < ebf[i] < errs[i] / 4  # bf16 operands: far closer than fp8
        for j in range(3):
            if j != i:
                assert e32[j] > 1e-3  # the other two GEMMs stay quantized


def test_spec_override_for_one_gemm_only():
    # the cure in NVIDIA's developer blog "探索 FP8 训练中 Debug 思路与技巧": current scaling for
    # grad_output in dgrad only
    torch.manual_seed(2)
    x, dy, w = torch.randn(32, 64), torch.randn(32, 16) * 1e-3, torch.randn(16, 64)
    rec = get_recipe("te-delayed").with_override(
        "dgrad", "grad_output", QuantSpec("e5m2", scaling="max")
    )
    mod = Linear(64, 16, bias=False, recipe=rec)
    with torch.no_grad():
        mod.weight.copy_(w)
    _, dx, _, _ = _run(mod, x, dy)
    e5 = QuantSpec("e5m2", scaling="max")
    e4_unit = QuantSpec("e4m3", scaling=1.0)  # step 0 of delayed scaling: scale 1
    assert torch.equal(dx, fp8lab.qmatmul(quantize(dy, e5), quantize(w, e4_unit)))
    # the delayed grad_output state still serves wgrad; the override (current) needs none
    assert set(mod.scaling_states) == {"input", "weight", "grad_output"}


def test_delayed_scaling_in_module_reproduces_standalone_sequence():
    torch.manual_seed(3)
    mod = Linear(64, 32, bias=True, recipe="te-delayed")
    w0, b0 = mod.weight.detach().clone(), mod.bias.detach().clone()
    ds = {r: DelayedScaling(history_len=1024, algorithm="max") for r in ("x", "w", "g")}
    sx = QuantSpec("e4m3", scaling=ds["x"])
    sw = QuantSpec("e4m3", scaling=ds["w"])
    sg = QuantSpec("e5m2", scaling=ds["g"])
    for step in range(5):
        x = torch.randn(16, 64) * 2.0**step
        dy = torch.randn(16, 32) * 4.0**-step
        y, dx, dw, _ = _run(mod, x, dy)
        mod.weight.grad = None
        xq, wq = quantize(x, sx), quantize(w0, sw)
        ds["x"].update()
        ds["w"].update()
        gq = quantize(dy, sg)
        ds["g"].update()
        assert torch.equal(y, fp8lab.qmatmul(xq, wq.t()) + b0), step
        assert torch.equal(dx, fp8lab.qmatmul(gq, wq)), step
        assert torch.equal(dw, fp8lab.qmatmul(xq.t(), gq).t()), step
        for key, r in (("input", "x"), ("weight", "w"), ("grad_output", "g")):
            st = mod.scaling_states[key]
            assert torch.equal(st.scale, ds[r].scale)
            assert torch.equal(st.amax_history, ds[r].amax_history)


def test_hif8_delayed_first_step_current_and_interval_in_module():
    torch.manual_seed(7)
    rec = get_recipe("hif8-delayed")
    mod = Linear(32, 16, bias=False, recipe=rec)
    w0 = mod.weight.detach().clone()
    # standalone objects built from the recipe's own templates
    ds = {
        r: DelayedScaling.bind(getattr(rec, r).scaling) for r in ("input", "weight", "grad_output")
    }
    spec = {r: getattr(rec, r).replace(scaling=ds[r]) for r in ds}
    first_scales = []
    for step in range(12):
        x = torch.randn(8, 32) * (1.0 + step)
        dy = torch.randn(8, 16)
        y, dx, _, _ = _run(mod, x, dy)
        xq, wq = quantize(x, spec["input"]), quantize(w0, spec["weight"])
        ds["input"].update()
        ds["weight"].update()
        gq = quantize(dy, spec["grad_output"])
        ds["grad_output"].update()
        assert torch.equal(y, fp8lab.qmatmul(xq, wq.t())), step
        assert torch.equal(dx, fp8lab.qmatmul(gq, wq)), step
        first_scales.append(float(mod.scaling_states["input"].scale))
    # step 0 used current scaling (not 1.0); the amax is measured only every 5th step
    assert mod.scaling_states["input"].initialized
    st = mod.scaling_states["input"]
    assert int((st.amax_history > 0).sum()) == 3  # steps 0, 5, 10
    assert first_scales[0] == first_scales[4] != first_scales[5]


def test_distributed_single_rank_group(tmp_path):
    import torch.distributed as dist

    from fp8lab.distributed import set_amax_reduction

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    old = set_amax_reduction()  # explicit: no import turns the amax all-reduce on
    try:
        mod = Linear(16, 8, recipe="te-delayed")
        mod(torch.ones(4, 16) * 2.0).sum().backward()
        assert float(mod.scaling_states["input"].scale) == pytest.approx(448.0 / 2.0)
    finally:
        set_amax_reduction(old)
        dist.destroy_process_group()


def test_autocast_accumulates_microbatch_amax_and_updates_at_exit():
    mod = Linear(32, 16, recipe="te-delayed")
    st = mod.scaling_states["input"]
    with autocast():
        mod(torch.ones(4, 32) * 3.0).sum().backward()
        mod(torch.ones(4, 32) * 5.0).sum().backward()
        assert st.step == 0 and float(st.scale) == 1.0  # nothing updated inside
    assert st.step == 1
    assert float(st.amax_history[-1]) == 5.0  # max over the two micro-batches
    assert float(st.scale) == pytest.approx(448.0 / 5.0)
    g = mod.scaling_states["grad_output"]
    assert g.step == 2  # the gradient role updates after every backward (TE)
    # outside autocast: after each forward
    mod(torch.ones(4, 32)).sum().backward()
    assert st.step == 2


def test_autocast_overrides_recipe_temporarily():
    ref, mod = _pair("te-current")
    x = torch.randn(8, 64)
    with autocast("fp32"):
        y = mod(x)
    assert torch.equal(y, ref(x))
    assert not torch.equal(mod(x), ref(x))
    with autocast(enabled=False):
        assert torch.equal(mod(x), ref(x))
    with pytest.raises(ValueError, match="unknown recipe"), autocast("fp9"):
        pass


def test_retile_from_quantized_vs_high_precision():
    rec = get_recipe("deepseek-v3").with_accumulator("fp32")
    torch.manual_seed(4)
    x, dy = torch.randn(256, 256), torch.randn(256, 128)
    mod = Linear(256, 128, bias=False, recipe=rec)
    retile_counts(reset=True)
    _, _, dw_q, _ = _run(mod, x, dy)
    assert retile_counts()["from_quantized"] >= 1  # x re-tiled 1x128 -> 128x1 (DeepSeek-V3)
    mod.weight.grad = None
    mod.set_recipe(rec.replace(save_for_backward="high_precision"))
    _, _, dw_h, _ = _run(mod, x, dy)
    w = mod.weight.detach()
    xq_col = fake_quant(x, QuantSpec("e4m3", (128, 1)))
    dyq_col = fake_quant(dy, QuantSpec("e4m3", (128, 1)))
    assert torch.equal(dw_h, (xq_col.t() @ dyq_col).t())
    assert not torch.equal(dw_q, dw_h)  # double quantization differs
    assert w.shape == (128, 256)


def test_state_dict_round_trip_resumes_bit_for_bit():
    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            Linear(32, 64, recipe="te-delayed"), torch.nn.GELU(), Linear(64, 8, recipe="te-delayed")
        )

    def train(m, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            m(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
            opt.step()

    m1 = model(0)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    train(m1, o1, 3, 0)
    sd = copy.deepcopy(m1.state_dict())
    assert "0.fp8_input_amax_history" in sd and "0.fp8_recipe" in sd
    train(m1, o1, 3, 1)
    m2 = model(5)
    m2.load_state_dict(sd)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    train(m2, o2, 3, 1)
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_errors():
    src = Linear(16, 8, recipe="te-delayed")
    src(torch.randn(4, 16)).sum().backward()
    sd = src.state_dict()
    with pytest.raises(ValueError, match="another recipe"):
        Linear(16, 8, recipe="te-current").load_state_dict(sd)
    bad = dict(sd)
    del bad["fp8_weight_scale"]
    with pytest.raises(ValueError, match="mismatched scaling state"):
        Linear(16, 8, recipe="te-delayed").load_state_dict(bad)
    bad = dict(sd)
    bad["fp8_input_amax_history"] = sd["fp8_input_amax_history"].clone()
    bad["fp8_input_amax_history"][3] = float("nan")
    with pytest.raises(ValueError, match="NaN in amax history"):
        Linear(16, 8, recipe="te-delayed").load_state_dict(bad)
    # a plain torch.nn.Linear checkpoint loads (scaling state starts fresh)
    plain = torch.nn.Linear(16, 8)
    m = Linear(16, 8, recipe="te-delayed")
    m.load_state_dict(plain.state_dict())
    assert torch.equal(m.weight, plain.weight)


def test_collect_operands_records_every_gemm_and_role():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    fp8lab.nn.convert(model, "te-current", default_exclude=False)
    x = torch.randn(8, 32, requires_grad=True)  # else layer 0 has no dgrad
    with collect_operands(model) as ops:
        model(x).sum().backward()
    assert len(ops) == 2 * 6 and ops.layers() == ["0", "1"]
    rec = ops[("0", "fprop", "input")]
    assert torch.equal(rec["high_precision"], x.detach())
    assert torch.equal(rec["used"], fake_quant(x, QuantSpec("e4m3")))
    # reused operands (per-tensor x in wgrad) still report the fp32 source next to what was used
    rec = ops[("0", "wgrad", "input")]
    assert torch.equal(rec["high_precision"], x.detach())
    assert torch.equal(rec["used"], fake_quant(x.detach(), QuantSpec("e4m3")))
    w1 = model[1].weight.detach()
    assert torch.equal(ops[("1", "dgrad", "weight")]["high_precision"], w1)
    with collect_operands(model, fn=lambda hp, used: float((hp - used).abs().max())) as errs:
        model(x).sum().backward()
    assert all(isinstance(v, float) for v in errs.values())
    assert errs[("1", "dgrad", "grad_output")] >= 0.0
    model(x)  # no collection outside the context
    assert len(errs) == 12


def test_bad_inputs():
    with pytest.raises(ValueError, match="in_features=4"):
        Linear(4, 2)(torch.ones(3, 5))
    with pytest.raises(TypeError, match="floating point"):
        Linear(4, 2)(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown recipe"):
        Linear(4, 4, recipe="fp7")
    with pytest.raises(TypeError):
        Linear(4, 4, recipe=42)


@pytest.mark.parametrize("name", ["deepseek-v3", "te-delayed-hopper"])
def test_block_and_limited_accumulator_recipes_match_qmatmul(name):
    torch.manual_seed(5)
    rec = get_recipe(name)
    mod = Linear(256, 128, bias=False, recipe=rec)
    x, dy = torch.randn(128, 256), torch.randn(128, 128)
    y, dx, _, _ = _run(mod, x, dy)
    w = mod.weight.detach()
    if name == "deepseek-v3":
        sx, sw, sg = (QuantSpec("e4m3", g) for g in ((1, 128), (128, 128), (1, 128)))
    else:
        sx, sw = QuantSpec("e4m3", scaling=1.0), QuantSpec("e4m3", scaling=1.0)
        sg = QuantSpec("e5m2", scaling=1.0)  # delayed scaling's first step: scale 1
    qx, qw, qg = quantize(x, sx), quantize(w, sw), quantize(dy, sg)
    assert torch.equal(y, fp8lab.qmatmul(qx, qw.t(), rec.fprop.accumulator))
    assert torch.equal(dx, fp8lab.qmatmul(qg, qw, rec.dgrad.accumulator))
    # the limited accumulator really differs from fp32 accumulation
    assert not torch.equal(y, fp8lab.qmatmul(qx, qw.t(), "fp32"))


def test_attention_matmul_only_when_the_recipe_asks():
    torch.manual_seed(6)
    q, k = torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 4, 16, 8)
    plain = torch.matmul(q, k)
    assert torch.equal(fp8lab.nn.attention_matmul(q, k), plain)  # no autocast
    with autocast("te-current"):  # attention=False by default
        assert torch.equal(fp8lab.nn.attention_matmul(q, k), plain)
    rec = get_recipe("te-current").replace(attention=True)
    with autocast(rec):
        out = fp8lab.nn.attention_matmul(q, k)
    e4 = QuantSpec("e4m3")
    assert torch.equal(out, torch.matmul(fake_quant(q.detach(), e4), fake_quant(k, e4)))
    g = torch.randn_like(out)
    out.backward(g)
    gq = fake_quant(g, QuantSpec("e5m2"))
    assert torch.equal(q.grad, torch.matmul(gq, fake_quant(k, e4).transpose(-1, -2)))


def test_deepcopy_is_independent():
    a = Linear(16, 8, recipe="te-delayed")
    a(torch.randn(4, 16)).sum().backward()  # builds and caches a plan
    b = copy.deepcopy(a)
    before = {k: v.state_dict() for k, v in a.scaling_states.items()}
    b(torch.randn(4, 16) * 100).sum().backward()
    for k, v in a.scaling_states.items():
        for f, t in v.state_dict().items():
            assert torch.equal(t, before[k][f]), (k, f)
    assert b.scaling_states["input"].step == 2 and a.scaling_states["input"].step == 1


def test_bf16_recipe_rounds_operands_over_repeated_steps():
    # the rounded gradient lives in a reused buffer: several backwards must stay exact
    ref, mod = _pair("bf16")
    w = ref.weight.detach().to(torch.bfloat16).float()
    for i in range(3):
        x, dy = torch.randn(8, 64), torch.randn(8, 32) * (i + 1)
        mod.zero_grad()
        y, dx, dw, _ = _run(mod, x, dy)
        xb, gb = x.to(torch.bfloat16).float(), dy.to(torch.bfloat16).float()
        assert torch.equal(y, F.linear(xb, w, ref.bias.detach()))
        assert torch.equal(dx, gb @ w)
        assert torch.equal(dw, (xb.t() @ gb).t())


def test_bf16_parameters_and_inputs_run_in_float32():
    # model.to(bfloat16): computation in float32, outputs and grads in the tensors' dtypes
    torch.manual_seed(8)
    ref = torch.nn.Linear(32, 16)
    mod = Linear.from_linear(copy.deepcopy(ref), "te-current").to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = mod(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and mod.weight.grad.dtype == torch.bfloat16
    e4 = QuantSpec("e4m3")
    w32 = mod.weight.detach().float()
    expect = fp8lab.qmatmul(quantize(x.detach().float(), e4), quantize(w32, e4).t())
    expect = (expect + mod.bias.detach().float()).to(torch.bfloat16)
    assert torch.equal(y.detach(), expect)
