"""fp8lab.lab.noise: the one noise rule of compare and debug (late_gap_pct) and its factors."""

import math
from types import SimpleNamespace

import pytest

from fp8lab.lab.noise import late_gap_pct


def test_largest_gap_over_the_second_half_in_percent_of_the_reference():
    a = {0: 5.0, 10: 4.0, 20: 3.0, 30: 2.2, 40: 2.0}
    b = {0: 1.0, 10: 1.0, 20: 2.97, 30: 2.0, 40: 2.01}
    ref = {0: 1.0, 10: 1.0, 20: 3.0, 30: 2.0, 40: 2.0}
    # steps 0 and 10 (huge gaps) are in the first half of last = 40; 20 (2 t >= 40) counts
    assert late_gap_pct(a, b, ref) == abs(100.0 * (2.2 - 2.0) / 2.0)


def test_curves_as_pairs_and_only_common_steps():
    a = [(0, 3.0), (50, 2.0), (100, 1.5)]
    b = [(0, 3.0), (50, 2.1), (100, 1.5), (200, 9.0)]  # 200: not in a, ignored
    assert late_gap_pct(a, b, b) == abs(100.0 * (2.0 - 2.1) / 2.1)


def test_the_final_common_point_always_counts():
    assert late_gap_pct({7: 2.0}, {7: 2.02}, {7: 2.0}) == abs(100.0 * (2.0 - 2.02) / 2.0)


def test_unknown_when_a_late_value_is_missing_zero_or_not_finite():
    assert late_gap_pct({}, {}, {}) is None
    assert late_gap_pct({0: None, 10: 2.0}, {0: 1.0, 10: 2.0}, {0: 1.0, 10: 2.0}) is not None
    assert late_gap_pct({10: None}, {10: 2.0}, {10: 2.0}) is None
    assert late_gap_pct({10: 2.0}, {10: 2.0}, {10: 0.0}) is None
    assert late_gap_pct({10: math.nan}, {10: 2.0}, {10: 2.0}) is None
    assert late_gap_pct({10: math.inf}, {10: 2.0}, {10: 2.0}) is None


# ----------------------------------------------------------------------------- the factors
# Every module reads the factors from fp8lab.lab.noise at the point of use: changing the
# constant changes compare's band, the debugger's attribution floor, its "explains" and
# "recovers" verdicts, and the debug report's band, with no second copy to forget.


def test_the_factors_are_those_the_debugger_scenarios_were_measured_with():
    from fp8lab.lab import noise

    # a change of value comes with docs/debug.md's scenario table re-measured
    assert (noise.WITHIN, noise.ATTRIBUTE) == (2.0, 3.0)


def _noise_of_pair():
    """compare's noise estimate of an fp32/bf16 pair 0.5 % apart at the end."""
    from fp8lab.lab.compare_summary import noise_estimate

    metrics = {
        "bf16": [{"step": 10, "val_loss": 2.0}, {"step": 20, "val_loss": 2.0}],
        "fp32": [{"step": 10, "val_loss": 2.0}, {"step": 20, "val_loss": 2.01}],
    }
    return noise_estimate(metrics, ["bf16", "fp32"], "bf16")


def test_compare_within_noise_band_is_noise_within(monkeypatch):
    from fp8lab.lab import noise
    from fp8lab.lab.compare_summary import within_noise

    est = _noise_of_pair()
    assert est["rel_gap_pct"] == pytest.approx(0.5) and est["factor"] == 2.0
    assert within_noise(0.9, est) and not within_noise(1.1, est)
    monkeypatch.setattr(noise, "WITHIN", 1.5)
    est = _noise_of_pair()
    assert est["factor"] == 1.5
    assert not within_noise(0.9, est) and within_noise(0.7, est)


def test_debug_attribution_floor_is_noise_attribute(monkeypatch):
    from fp8lab.lab import noise
    from fp8lab.lab.debug.method import gap_floor, too_small_to_attribute

    assert gap_floor(0.1) == pytest.approx(0.3) and not too_small_to_attribute(0.4, 0.1)
    monkeypatch.setattr(noise, "ATTRIBUTE", 5.0)
    assert gap_floor(0.1) == pytest.approx(0.5) and too_small_to_attribute(0.4, 0.1)


def test_debug_explains_and_recovers_within_noise_within(monkeypatch):
    from fp8lab.lab import noise
    from fp8lab.lab.debug import method, verdict
    from fp8lab.lab.debug.result import Probe

    def probe(gap_pct):
        # final loss = 2 x (1 + gap): the baseline ends at 2.0; R's gap is 10 %
        s = {"final_val_loss": 2.0 * (1 + gap_pct / 100), "diverged": False}
        return Probe(name="p", kind="probe", label="p", summary=s, val=[])

    def verdicts():
        ctx = SimpleNamespace(base_final=2.0, gap_ref=10.0, noise=1.0, close=0.7)
        p = probe(1.8)  # closes 82 % of the gap, and ends within 2 x 1 % of the baseline
        method._Ctx._score(ctx, p)
        strict = method._strict(ctx, p)  # closes < LAYER_CLOSE: only the noise band counts
        ctx.probes = {"recovery": SimpleNamespace(gap_pct=1.8)}
        return p.explains, strict, verdict._recovers(ctx, {})

    assert verdicts() == (True, True, True)
    monkeypatch.setattr(noise, "WITHIN", 1.5)
    assert verdicts() == (True, False, False)  # still explains: it closes >= 70 %


def test_debug_report_band_is_noise_within(monkeypatch, tmp_path):
    from matplotlib.axes import Axes

    from fp8lab.lab import noise
    from fp8lab.lab.debug.result import Probe
    from fp8lab.report.debug import plot_probes

    bands = []
    monkeypatch.setattr(Axes, "axhspan", lambda ax, lo, hi, **kw: bands.append((lo, hi, kw)))
    monkeypatch.setattr(noise, "WITHIN", 1.5)
    probes = {n: Probe(name=n, kind=n, label=n, summary={}, val=[(10, v)])
              for n, v in (("baseline", 2.0), ("recipe", 2.1))}  # fmt: skip
    plot_probes(SimpleNamespace(probes=probes, noise_pct=0.25, baseline="bf16"), tmp_path / "p.png")
    assert [(lo, hi, kw["label"]) for lo, hi, kw in bands] == [(-0.375, 0.375, "±1.5x noise")]
