"""Tensor error statistics on constructed tensors with known answers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8lab import get_format, stats
from fp8lab.qtensor import QuantSpec, quantize
from fp8lab.scaling.delayed import DelayedScaling

E4M3 = get_format("e4m3")


def test_all_values_below_min_subnormal_underflow_completely() -> None:
    # half the smallest e4m3 subnormal (2^-9) rounds to 0 (a tie to even), smaller values too
    x = torch.tensor([2.0**-10, -(2.0**-11), 2.0**-12, 1e-6])
    s = stats.tensor_stats(x, "e4m3")  # plain cast, no scaling
    assert s["underflow_pct"] == 100.0
    assert s["sqnr_db"] == 0.0  # all noise: error energy == signal energy
    assert s["cosine"] == 0.0
    assert s["rel_error"] == 1.0
    assert s["saturation_pct"] == 0.0
    # with per-tensor scaling the same tensor survives
    assert stats.tensor_stats(x, "e4m3:tensor")["underflow_pct"] == 0.0


def test_tensor_on_the_grid_has_infinite_sqnr() -> None:
    x = torch.tensor([[1.0, -0.5, 448.0, 0.0], [2.0**-9, 3.5, -240.0, 0.125]])
    s = stats.tensor_stats(x, "e4m3")
    assert s["sqnr_db"] == math.inf  # reported as infinite, not a large number
    assert s["rel_error"] == 0.0 and s["cosine"] == pytest.approx(1.0)
    assert s["underflow_pct"] == 0.0 and s["saturation_pct"] == 0.0
    assert s["nonzero_pct"] == pytest.approx(100 * 7 / 8)
    assert json.loads(json.dumps(stats.json_safe(s), allow_nan=False))["sqnr_db"] is None


def test_saturation_counts_clamped_values() -> None:
    x = torch.tensor([1.0, 500.0, -1000.0, 448.0, 2.0, 3.0, 4.0, 5.0])
    s = stats.tensor_stats(x, "e4m3")  # scale 1: 500 and -1000 clamp to +-448
    assert s["saturation_pct"] == pytest.approx(25.0)
    assert s["amax"] == 1000.0
    # dynamic per-tensor scaling maps amax onto 448: nothing clamps
    assert stats.tensor_stats(x, "e4m3:tensor")["saturation_pct"] == 0.0
    # non-saturating cast: overflow becomes NaN and still counts
    spec = QuantSpec(format="e4m3", granularity="tensor", scaling=1.0, saturate=False)
    assert stats.tensor_stats(x, spec)["saturation_pct"] == pytest.approx(25.0)


def test_mx_floor_scale_saturates_some_blocks() -> None:
    # OCP MX floor: a block whose amax mantissa is above 1.75 maps above 448 and clamps
    x = torch.ones(32)
    x[0] = 1.9
    s = stats.tensor_stats(x, "mxfp8")
    assert s["saturation_pct"] == pytest.approx(100 / 32)


def test_dynamic_range_and_amax() -> None:
    x = torch.tensor([0.0, 2.0**-10, -4.0, float("nan"), 1.0])
    assert stats.amax(x) == 4.0
    assert stats.dynamic_range(x) == pytest.approx(12.0)
    assert math.isnan(stats.dynamic_range(torch.zeros(3)))


def test_pair_functions_known_values() -> None:
    x = torch.tensor([3.0, 4.0])
    xq = torch.tensor([3.0, 3.0])
    assert stats.sqnr_db(x, xq) == pytest.approx(10 * math.log10(25.0))
    assert stats.rel_error(x, xq) == pytest.approx(0.2)
    assert stats.cosine(x, xq) == pytest.approx(21 / (5 * math.sqrt(18)))
    assert stats.underflow_pct(torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])) == 50.0
    z = torch.zeros(3)
    assert stats.sqnr_db(z, z) == math.inf and stats.cosine(z, z) == 1.0
    assert stats.sqnr_db(z, torch.ones(3)) == -math.inf
    assert stats.rel_error(z, torch.ones(3)) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        stats.sqnr_db(x, torch.zeros(3))
    with pytest.raises(TypeError, match="floating"):
        stats.amax(torch.arange(3))


def test_sqnr_fine_while_small_values_underflow() -> None:
    # the docstring's warning, made concrete: one big value carries the energy
    x = torch.cat([torch.tensor([448.0]), torch.full((99,), 1e-4)])
    s = stats.tensor_stats(x, "e4m3:tensor")
    assert s["sqnr_db"] > 60
    assert s["underflow_pct"] == pytest.approx(99.0)


def test_block_granularity_helps_an_outlier_tensor() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 256) * 1e-3
    x[0, 0] = 1000.0  # one outlier in the first 128x128 block
    rows = stats.what_if(x, ["e4m3:tensor", "e4m3:128x128", "e4m3:1x128"])
    assert [r["spec"] for r in rows] == ["e4m3:tensor", "e4m3:128x128", "e4m3:1x128"]
    by = {r["spec"]: r for r in rows}
    assert by["e4m3:tensor"]["underflow_pct"] > 50
    assert by["e4m3:128x128"]["underflow_pct"] < by["e4m3:tensor"]["underflow_pct"] / 2
    assert by["e4m3:1x128"]["underflow_pct"] < 1
    with pytest.raises(ValueError, match="at least one spec"):
        stats.what_if(x, [])


def test_block_stats_per_block() -> None:
    x = torch.ones(4, 6)
    x[:2, :3] = 2.0**-12  # block (0, 0) underflows under a plain e4m3 cast
    xq, _, _ = stats.quantized_pair(x, "e4m3")
    pb = stats.block_stats(x, xq, (2, 3))
    assert pb["underflow_pct"].shape == (2, 2)
    assert pb["underflow_pct"][0, 0] == 100.0 and pb["underflow_pct"][1, 1] == 0.0
    assert pb["sqnr_db"][1, 1] == math.inf and pb["sqnr_db"][0, 0] == pytest.approx(0.0)
    summary = stats.block_summary(pb)
    assert summary["max_block_underflow_pct"] == 100.0
    assert summary["min_block_sqnr_db"] == pytest.approx(0.0)


def test_parse_spec_and_names() -> None:
    assert stats.parse_spec("e4m3:128x128").granularity == (128, 128)
    assert stats.parse_spec("E4M3:1x128").block == (1, 128)
    mx = stats.parse_spec("mxfp8")
    assert mx.format == "e4m3" and mx.granularity == "mx"
    assert stats.parse_spec("e5m2").scaling == 1.0  # bare format = plain cast
    for bad in ("e4m3:0x128", "e4m3:blocky", "e9m9:tensor"):
        with pytest.raises(ValueError, match="bad spec"):
            stats.parse_spec(bad)
    with pytest.raises(TypeError):
        stats.parse_spec(3)


def test_delayed_spec_measured_at_steady_state_without_touching_state() -> None:
    ds = DelayedScaling()
    spec = QuantSpec(format="e4m3", granularity="tensor", scaling=ds)
    x = torch.randn(64, 64) * 1e-3
    s = stats.tensor_stats(x, spec)
    assert s == stats.tensor_stats(x, "e4m3:tensor")
    assert ds.step == 0  # no amax recorded in the caller's state


def test_error_stats_keys_for_the_training_lab() -> None:
    x = torch.randn(8, 16)
    s = stats.tensor_stats(x, "e4m3:tensor")
    for key in (
        "amax",
        "underflow_pct",
        "saturation_pct",
        "sqnr_db",
        "cosine",
        "rel_error",
        "dynamic_range",
    ):
        assert isinstance(s[key], float), key
    assert set(s) == set(stats.STAT_KEYS)


def test_fused_error_stats_agree_with_the_pair_functions() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * 10.0 ** torch.randint(-6, 3, (64, 96), generator=g)
    x[0, :5] = 0.0
    x[1, 0] = float("nan")
    for spec in ("e4m3", "e4m3:1x32", "mxfp4"):
        xq, values, fmt = stats.quantized_pair(x, spec)
        fused = stats.error_stats(x, xq, fmt, values)
        # the NaN poisons the sums: compare the rows without it too
        xs, qs, vs = (torch.cat([t[:1], t[2:]]) for t in (x, xq, values))
        finite = stats.error_stats(xs, qs, fmt, vs)
        assert fused["underflow_pct"] == pytest.approx(stats.underflow_pct(x, xq))
        assert fused["saturation_pct"] == pytest.approx(stats.saturation_pct(x, xq, fmt, values))
        assert fused["amax"] == stats.amax(x)
        assert fused["dynamic_range"] == pytest.approx(stats.dynamic_range(x))
        assert math.isnan(fused["sqnr_db"])  # NaN in, NaN out (not silently dropped)
        assert finite["sqnr_db"] == pytest.approx(stats.sqnr_db(xs, qs), rel=1e-9)
        assert finite["cosine"] == pytest.approx(stats.cosine(xs, qs), rel=1e-9)
        assert finite["rel_error"] == pytest.approx(stats.rel_error(xs, qs), rel=1e-9)


def test_steady_spec_of_a_recipe_config_includes_nguard() -> None:
    # a preset's delayed spec (frozen config) is measured at delayed scaling's steady state:
    # what a DelayedScaling reaches after one update on the same tensor, margin + nguard
    import fp8lab

    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 48, generator=g) * 3
    for name in ("hif8-delayed", "te-delayed"):
        spec = fp8lab.get_recipe(name).input
        ds = DelayedScaling.bind(spec.scaling, spec.format)
        ds.observe(x.abs().max())
        ds.update()
        q = fp8lab.quantize(x, spec.replace(scaling=ds))
        want = stats.error_stats(x, q.dequantize(), spec.format, q.values)
        assert stats.tensor_stats(x, spec) == want, name
        assert ds.step == 1  # the statistics did not record into any state


def _torch_percentages(x, xq, fmax, values):
    """The torch definitions the pair functions had before the one kernel (float64)."""
    a, b, v = x.double(), xq.double(), values.double()
    nz = a != 0
    under = 100.0 * int((nz & (b == 0)).sum()) / int(nz.sum()) if int(nz.sum()) else 0.0
    clamped = (v.abs() == fmax) & (a.abs() > b.abs() * (1.0 + stats.SATURATION_TOL))
    overflow = ~torch.isfinite(v) & torch.isfinite(a)
    return under, 100.0 * int((clamped | overflow).sum()) / a.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_definition_of_underflow_and_saturation(dtype) -> None:
    """clip_percentages, the pair functions and error_stats count the same elements as the
    torch reference, NaN/Inf and the non-saturating cast included."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4096, generator=g) * torch.logspace(-12, 4, 4096)).to(dtype)
    x[::97] = 0.0
    x[5], x[6], x[7] = float("nan"), float("inf"), -float("inf")
    for spec in ("e4m3", "e4m3:1x128", QuantSpec("e4m3", scaling=1.0, saturate=False)):
        xq, values, fmt = stats.quantized_pair(x, spec)
        want = _torch_percentages(x, xq, E4M3.max, values)
        q = quantize(x, stats.steady_spec(spec))
        assert stats.clip_percentages(x, q) == want  # the guard's lean pass
        assert stats.underflow_pct(x, xq) == want[0]
        assert stats.saturation_pct(x, xq, fmt, values) == want[1]
        es = stats.error_stats(x, xq, fmt, values)
        assert (es["underflow_pct"], es["saturation_pct"]) == want
    assert math.isnan(stats.error_stats(x, x)["saturation_pct"])
    with pytest.raises(ValueError, match="values shape"):
        stats.saturation_pct(x, x, "e4m3", x[:3])


def test_stats_fake_quant_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="quantized_pair"):
        assert stats.fake_quant is stats.quantized_pair


def test_error_stats_of_an_overflowed_quantization() -> None:
    """An fp16 cast that overflowed (inf in the quantized tensor, a step the loss scaler
    skips) has an infinite error: SQNR -inf, not a math domain error."""
    x = torch.tensor([1.0, 2.0, 1e5])
    xq = x.to(torch.float16).float()
    assert math.isinf(xq[2])
    s = stats.error_stats(x, xq, "fp16")
    assert s["sqnr_db"] == -math.inf
