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
    ext = C.external_check()
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
