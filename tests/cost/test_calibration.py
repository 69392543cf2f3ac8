"""Held-out prediction of Transformer Engine's published GEMM timings (issue 17 acceptance).

Calibration uses fprop sums only (the pre-quantized GEMM kernels where TE publishes them, then
te-current's autocast fprop for the quantization kernels; deepseek-v3's autocast fprop on H200);
dgrad, wgrad, the layer totals and the other recipes' autocast fprop are predictions.
"""

from __future__ import annotations

import tomllib

import pytest

from fp8lab.cost import calibration as C
from fp8lab.cost.devices import DATA, DEVICES_DIR, device_names, get_device


@pytest.fixture(scope="module")
def fitted():  # a few hundred roofline evaluations: ~5 s
    return C.calibrate()


@pytest.mark.slow
def test_shipped_calibration_is_the_fit(fitted):
    shipped = tomllib.loads((DATA / "calibration.toml").read_text())
    assert set(shipped) == set(fitted)
    for dev, cal in fitted.items():
        assert shipped[dev]["bandwidth_efficiency"] == pytest.approx(
            cal["bandwidth_efficiency"], abs=2e-6
        )
        for cls, e in cal["efficiency"].items():
            assert shipped[dev]["efficiency"][cls] == pytest.approx(e, abs=2e-6)
        if dev != "b200":  # b200: named B200 figures, no TE timing
            assert all(" fprop" in f for f in cal["fitted_on"])
        assert shipped[dev]["fitted_on"] == cal["fitted_on"]


@pytest.mark.slow
def test_fit_reproduces_the_calibration_passes(fitted):
    fit = [r for r in C.residuals(fitted) if not r.held_out]
    assert {r.quantity for r in fit} == {"fprop", "fprop (pre-quantized)"}
    # H200 NVL: bf16 + te-current pre-quantized, te-current + deepseek-v3 autocast; B300: bf16,
    # te-current, mxfp8, nvfp4 pre-quantized + te-current autocast (one parameter each)
    assert len(fit) == 4 + 5
    assert all(abs(r.error) < 1e-6 for r in fit)


def test_held_out_autocast_within_10_percent():
    held = [r for r in C.residuals() if r.held_out and "pre-quantized" not in r.quantity]
    # dgrad, wgrad, layer of every published recipe, and the fprop of all but te-current
    # (both devices) and deepseek-v3 (H200)
    assert len(held) == 9 * 3 + 9 - 3
    worst = max(held, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.10, worst


def test_held_out_prequantized_gemm_kernels_within_10_percent():
    # the known weak spot of the fprop-autocast-only fit (B300 raw kernels 11-47 % too fast)
    held = [r for r in C.residuals() if r.held_out and "pre-quantized" in r.quantity]
    assert len(held) == 6 * 4 - 6  # 6 published recipes x (fprop, dgrad, wgrad, layer)
    worst = max(held, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.10, worst


def test_quantization_share_of_current_scaling_on_h200():
    published, predicted = C.quantization_share()
    assert published == 0.17
    assert abs(predicted - published) <= 0.05


def test_recipe_ordering_where_speedups_differ_by_more_than_5_percent():
    pairs = C.ordering_check()
    assert len(pairs) >= 10
    assert all(p["agree"] for p in pairs), [p for p in pairs if not p["agree"]]


def test_405b_blackwell_ordering_external_check():
    # with the B300 TE fit (b200 priced as before the B200-only calibration): with that one,
    # MXFP8's cuBLAS figure (within 0.3 % of per-tensor FP8's CUTLASS one) lands level with
    # te-current, so the reported MXFP8 < current order is not reproduced (docs/cost.md)
    from fp8lab.cost.devices import load_calibration

    full = load_calibration()
    ext = C.external_check({**full, "b200": full["b300"]})
    assert ext["reported_order"] == ["mxfp8", "te-current", "te-delayed"]
    assert ext["agree"], ext
    assert "reported" in ext["status"]


def test_device_tables_carry_sources_and_flags():
    assert set(device_names()) == {"h100", "h200", "h200-nvl", "b200", "b300"}
    for name in device_names():
        raw = tomllib.loads((DEVICES_DIR / f"{name}.toml").read_text())
        for entry in [*raw["peak_tflops"].values(), raw["bandwidth_tbs"]]:
            assert entry["status"] in ("verified", "reported")
            assert entry["source"]
        assert all(v["dense"] is True for v in raw["peak_tflops"].values())
        dev = get_device(name)
        assert dev.efficiency, name  # every device has calibrated efficiencies (own or borrowed)
    assert "sparsity" in get_device("b200").note  # the spec-sheet disagreement is stated


def test_second_split_hopper_calibration_predicts_b300_speedups():
    # H200 NVL efficiencies on B300's peaks and bandwidth: the speedups over bf16 within 10 %
    # and in the published order (absolute layer times are reported in docs/cost.md)
    res = {(r.recipe, r.quantity): r for r in C.cross_architecture_check()}
    for recipe in ("te-current", "te-delayed"):
        assert abs(res[(recipe, "speedup")].error) <= 0.10
    assert res[("te-delayed", "speedup")].predicted > res[("te-current", "speedup")].predicted


def test_blackwell_calibration_uses_only_named_b200_figures():
    # each efficiency is its cited figure over the b200 table's dense peak, recomputed here from
    # the data file and the device table (no fitting, no B300 or TE number involved)
    fig = C.b200_figures()
    raw = tomllib.loads((DEVICES_DIR / "b200.toml").read_text())
    peak = {"bf16": "bf16", "fp8": "fp8", "mxfp8": "fp8", "nvfp4": "fp4"}
    cal = C.blackwell_calibration()
    for cls, row in fig["gemm"].items():
        assert row["source"]
        assert cal["efficiency"][cls] == pytest.approx(
            row["tflops"] / raw["peak_tflops"][peak[cls]]["value"], rel=1e-12
        )
        assert "B300" not in row["source"] and "b300" not in row["source"]
    bw = fig["quantize"]["gbs"] / 1e3 / raw["bandwidth_tbs"]["value"]
    assert cal["bandwidth_efficiency"] == pytest.approx(bw, rel=1e-12)
    assert get_device("b200").efficiencies_from == "b200"
    assert get_device("b300").efficiencies_from == "b300"  # B300 keeps its TE fit


def test_b200_figures_are_compute_bound_under_the_roofline():
    # efficiency = TFLOPS / peak is the model's own reading only where its compute term wins
    from fp8lab.cost.model import price_linears

    dev = get_device("b200")
    for cls, recipe in (
        ("bf16", "bf16"),
        ("fp8", "te-current"),
        ("mxfp8", "mxfp8"),
        ("nvfp4", "nvfp4"),
    ):
        s = C.b200_figures()["gemm"][cls]["shape"]
        flops = 2 * s["m"] * s["n"] * s["k"]
        c = price_linears(recipe, dev, [("x", s["k"], s["n"])], s["m"], "te-benchmark")
        g = next(g for g in c.gemms if g.name.endswith(".fprop"))
        assert g.ms == pytest.approx(flops / (dev.peak(cls) * dev.gemm_efficiency(cls)) * 1e3)
        # the shipped calibration (6 digits) still reads the cited figure on B200
        tflops = C.b200_figures()["gemm"][cls]["tflops"]
        assert dev.gemm_efficiency(cls) == pytest.approx(tflops * 1e12 / dev.peak(cls), rel=1e-5)


def test_peak_scaling_solves_the_two_b200_figures_and_prices_b300_fp4():
    # time per FLOP = 1/(P e) + 1/r; two figures at one shape (FP8 at 4.5, NVFP4 at 9 PFLOPS)
    # are two linear equations in (1/e, 1/r): solved here with numpy, independently
    import numpy as np

    fig = C.b200_figures()["gemm"]
    t8, t4 = fig["fp8"]["tflops"], fig["nvfp4"]["tflops"]
    inv_e, inv_r = np.linalg.solve([[1 / 4500.0, 1.0], [1 / 9000.0, 1.0]], [1 / t8, 1 / t4])
    ps = C.blackwell_calibration()["peak_scaling"]
    assert ps["tensor_core_efficiency"] == pytest.approx(1 / inv_e, rel=1e-9)
    assert ps["fixed_tflops"] == pytest.approx(1 / inv_r, rel=1e-9)
    assert 0 < ps["tensor_core_efficiency"] <= 1 and ps["fixed_tflops"] > 0
    cal = {"b300": C.blackwell_calibration()}
    b300 = get_device("b300", calibration=cal)
    # B300's FP4 peak (13.5 PFLOPS): only the tensor-core share gets faster
    assert b300.gemm_efficiency("nvfp4") == pytest.approx(1 / (inv_e + 13500.0 * inv_r))
    assert b300.gemm_efficiency("nvfp4") * 13500 < 1.5 * t4  # less than the peak ratio
    assert b300.gemm_efficiency("nvfp4") * 13500 > t4
    # FP8 and BF16 peaks are B200's: their figures carry over unchanged; MXFP8 (the FP8 rate)
    # is outside the CUTLASS pair's split and keeps its own cuBLAS figure
    assert b300.gemm_efficiency("fp8") * 4500 == pytest.approx(t8)
    assert b300.gemm_efficiency("bf16") == pytest.approx(fig["bf16"]["tflops"] / 2250)
    assert "mxfp8" not in ps["classes"]
    assert b300.gemm_efficiency("mxfp8") * 4500 == pytest.approx(fig["mxfp8"]["tflops"])


def test_b200_calibration_on_te_b300_layer_speedups():
    # held out entirely: TE's four B300 layer speedups priced on B300 peaks with the B200-only
    # calibration. In the published order; te-current, mxfp8 and nvfp4 within 10 %; te-delayed
    # is the known miss (docs/cost.md: the B200 FP8 GEMM figure): bounded here, not pinned.
    res = {r.recipe: r for r in C.b300_speedup_check()}
    assert set(res) == {"te-current", "te-delayed", "mxfp8", "nvfp4"}
    order_pub = sorted(res, key=lambda r: res[r].published)
    order_pred = sorted(res, key=lambda r: res[r].predicted)
    assert order_pub == order_pred == ["te-current", "mxfp8", "te-delayed", "nvfp4"]
    assert abs(res["te-current"].error) <= 0.10 and abs(res["mxfp8"].error) <= 0.10
    assert -0.15 <= res["te-delayed"].error < -0.10  # delayed scaling saves only its amax pass
    # the FP4 GEMM on B300 speeds up by its tensor-core share only (peak_scaling)
    assert abs(res["nvfp4"].error) <= 0.10


def test_h200_keeps_its_fit_next_to_the_b200_calibration():
    held = [r for r in C.residuals() if r.device == "h200-nvl" and r.held_out]
    assert held and all(abs(r.error) <= 0.10 for r in held)


@pytest.mark.slow  # prices nvfp4-te: counting its RHT step takes ~2 s
def test_nvfp4_blog_outside_check_states_the_non_gemm_share():
    ext = C.nvfp4_blog_check()
    assert ext["reported"] == 1.59 and "reported" in ext["status"]
    # GEMM-only speedup above the end-to-end one: the rest of the step does not speed up
    s, f = ext["predicted_gemm_only"], ext["implied_non_gemm_share"]
    assert s > ext["reported"]
    assert 1 / ext["reported"] == pytest.approx(f + (1 - f) / s)
    assert 0.0 < f < 0.5
    # bf16 attention priced too: a smaller speedup, a smaller share left outside the model
    sa, fa = ext["predicted_with_attention"], ext["implied_other_share"]
    assert ext["reported"] < sa < s and 0.0 <= fa < f
    assert 1 / ext["reported"] == pytest.approx(fa + (1 - fa) / sa)
