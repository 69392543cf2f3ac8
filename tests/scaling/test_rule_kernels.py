"""The fused scale-rule kernels (scaling/rule_kernels.py) equal their rule functions
(scaling/rules.py) bit for bit over the whole float32 range, its top binade densely."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8lab.qtensor.nvfp4 import second_level_amax
from fp8lab.scaling import rules
from fp8lab.scaling.rule_kernels import (
    MX_RULES,
    _max_rule_scales,
    _mx_rule_scales,
    max_rule_scales,
    mx_rule_scales,
    nvfp4_rule_scales,
)

F32 = np.float32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.nan_to_num(a, nan=7.77)
    b = torch.nan_to_num(b, nan=7.77)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def float32_sweep() -> torch.Tensor:
    """Every binade with mantissas near its edges, float32 subnormals, the whole top binade at a
    1/256 step (where MX rounding carries past 2**127) and its last 300 values, 0, inf, NaN and
    negatives of a sample."""
    e = torch.arange(-149, 128, dtype=torch.float64)
    mants = torch.tensor([1.0, 1.0 + 2.0**-23, 1.0625, 1.5, 1.75, 1.875, 1.9375, 2.0 - 2.0**-23])
    vals = (2.0 ** e[:, None] * mants[None, :]).reshape(-1)
    top = 2.0**127 * (1.0 + torch.arange(256, dtype=torch.float64) / 256)
    vals = torch.cat([vals, top])
    vals = vals[vals <= float(np.finfo(F32).max)].to(torch.float32)
    flt_max_bits = int(np.array(np.finfo(F32).max).view(np.uint32))
    last = torch.arange(flt_max_bits - 299, flt_max_bits + 1, dtype=torch.int32).view(torch.float32)
    extra = torch.tensor([0.0, math.inf, math.nan, 448.0, 57344.0, 6.0, 2.0**-127, 1e-45])
    return torch.cat([vals, last, extra, -vals[::97], torch.tensor([-math.inf, -math.nan])])


MX_FORMATS = ["e4m3", "e5m2", "e2m1", "e2m3", "e3m2", "e4m3fnuz", "e5m2fnuz", "hif8", "bf16"]


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("rule", MX_RULES)
def test_mx_kernel_equals_the_rule_function(fmt, rule):
    amax = float32_sweep()
    s, inv = mx_rule_scales(amax, rule, fmt)
    code = rules.mx_exponent(amax, fmt, rule.removeprefix("mx_"))
    assert same_bits(s, rules.get_rule(rule)(amax, fmt))
    assert same_bits(s, rules.e8m0_to_scale(code))
    assert same_bits(inv, rules.e8m0_to_scale_inv(code))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e2m3", "e3m2"])
def test_mx_kernel_at_the_top_of_float32_gives_finite_codes(fmt):
    # issue 11 item 2: a finite amax whose rounding carries past 2**127 gets the finite code
    # 128 - emax + 127; only NaN (and inf) give 255. 1.9375 * 2**127 and FLT_MAX carry for every
    # element width of at most 3 mantissa bits.
    from fp8lab.formats import get_format

    emax = get_format(fmt).emax
    amax = torch.tensor([np.finfo(F32).max, 1.9375 * 2.0**127, math.nan])
    for rule in MX_RULES:
        s, inv = mx_rule_scales(amax, rule, fmt)
        assert torch.isfinite(s[:2]).all() and torch.isfinite(inv[:2]).all(), rule
        assert math.isnan(s[2]) and math.isnan(inv[2]), rule
    s, inv = mx_rule_scales(amax[:2], "mx_even", fmt)
    assert torch.equal(inv, torch.full((2,), 2.0 ** (128 - emax)))  # code 128 - emax + 127


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "hif8"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"margin": 2}, {"epsilon": 1e-3}, {"margin": -1, "epsilon": 2.0**-140},
     {"value_for_inf": 3.3895313892515355e38}],
)  # fmt: skip
def test_max_kernel_equals_the_rule_function(fmt, kw):
    amax = float32_sweep()
    s, inv = max_rule_scales(amax, fmt, **kw)
    want = rules.max_scale(amax, fmt, **kw)
    assert same_bits(s, want)
    assert same_bits(inv, torch.reciprocal(want))


@pytest.mark.numba_only
def test_fused_scale_kernels_on_nan_amax():
    # quantize never produces a NaN amax (NaN elements are ignored): call the kernels directly
    amax = torch.tensor([math.nan, -math.nan, 1.0, math.inf, 0.0])
    s, inv = np.empty(5, F32), np.empty(5, F32)
    _max_rule_scales(amax.numpy(), F32(448.0), F32(0.0), F32(np.finfo(F32).max), s, inv)
    want = rules.max_scale(amax, "e4m3")
    assert same_bits(torch.from_numpy(s), want)
    assert same_bits(torch.from_numpy(inv), torch.reciprocal(want))
    for mode, name in enumerate(("floor", "ceil", "even", "rceil")):
        _mx_rule_scales(amax.numpy().view(np.uint32), mode, 8, 3, F32(1) / F32(448), s, inv)
        code = rules.mx_exponent(amax, "e4m3", name)
        assert same_bits(torch.from_numpy(s), rules.e8m0_to_scale(code)), name
        assert torch.equal(torch.isnan(torch.from_numpy(inv)), code == 255), name


@pytest.mark.numba_only  # runs numba beside torch (the torch run fences numba off)
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_torch_kernels_equal_numba_over_float32(fmt):
    # issue 24: the device-generic twins (the rule functions on the kernels' constants) give the
    # kernels' bits over the whole float32 sweep, for every MX rule and the max rule's options
    from fp8lab.kernels import using_kernels

    amax = float32_sweep()
    calls = [(mx_rule_scales, (amax, rule, fmt), {}) for rule in MX_RULES]
    calls += [(max_rule_scales, (amax, fmt), kw) for kw in
              ({}, {"margin": 3}, {"epsilon": 1e-3}, {"value_for_inf": 448.0})]  # fmt: skip
    for fn, args, kw in calls:
        with using_kernels("numba"):
            s_n, inv_n = fn(*args, **kw)
        with using_kernels("torch"):
            s_t, inv_t = fn(*args, **kw)
        assert same_bits(s_n, s_t) and same_bits(inv_n, inv_t), (fn.__name__, args[1:], kw)


def test_unknown_mx_rule_is_refused():
    with pytest.raises(ValueError, match="mx_round"):
        mx_rule_scales(torch.ones(2), "mx_round", "e4m3")


def test_max_kernel_options_are_max_scales():
    # max_rule_scales binds its keywords to max_scale's signature: same defaults, same refusals
    amax = torch.tensor([0.5, 3.0])
    assert same_bits(max_rule_scales(amax, "e4m3")[0], rules.max_scale(amax, "e4m3"))
    with pytest.raises(TypeError):
        max_rule_scales(amax, "e4m3", marginn=1)
    with pytest.raises(TypeError):
        max_rule_scales(amax, "e4m3", 2)  # margin is keyword-only, as in max_scale


@pytest.mark.numba_only  # calls the numba kernel itself, beside the torch rule
@pytest.mark.parametrize(
    "block, row_scaled, tensor_scale",
    [((1, 16), False, None), ((1, 16), True, None), ((16, 1), True, None), ((16, 16), False, None),
     ((1, 16), False, 0.37), ((1, 16), False, 1e-38), ((1, 16), False, 3e38)],
)  # fmt: skip
def test_nvfp4_rule_kernel_equals_rule(block, row_scaled, tensor_scale):
    # block amaxes over the whole float32 range (NaN is never an amax: block_amax ignores it),
    # laid out [nr, nc] so that rows and columns hold every range; then the same scaled into
    # the top and bottom of the range, and all zeros (the second level's amax-0 rule)
    v = float32_sweep().abs()
    v = v[~torch.isnan(v)]
    v = torch.cat([v, v.new_zeros(64 - v.numel() % 64)]).reshape(-1, 64)
    for amax in (v, v[:, :8] * 2.0**100, v[:7] * 2.0**-100, torch.zeros(5, 3)):
        got = nvfp4_rule_scales(amax, block, row_scaled, tensor_scale)
        g_amax = None if tensor_scale is not None else second_level_amax(amax, block, row_scaled)
        s_blk, s_dec, enc = rules.nvfp4_scales(amax, g_amax, "e2m1", tensor_scale=tensor_scale)
        for a, b in zip(got, (enc, s_blk, s_dec), strict=True):
            assert same_bits(a, b), (block, row_scaled, tensor_scale)
