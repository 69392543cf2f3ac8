import math

import pytest
import torch

from fp8lab.guard import AnomalyGuard, GuardMonitor, detectors
from fp8lab.guard.config import DETECTOR_DEFAULTS as D


def test_robust_z_ignores_one_outlier_and_has_a_floor():
    w = [0.0, 0.1, -0.1, 0.05, -0.05, 100.0]  # one outlier does not move median / MAD much
    assert abs(detectors.robust_z(0.0, w)) < 1
    assert detectors.robust_z(1.0, [0.0] * 10) == pytest.approx(1 / detectors.MIN_SIGMA)


def test_megatron_loss_spike_rule():
    p = D["loss_spike"]
    assert detectors.loss_spike(60.0, 5.0, 99, p) == []  # still sampling the max
    assert detectors.loss_spike(49.9, 5.0, 100, p) == []
    (f,) = detectors.loss_spike(50.0, 5.0, 100, p)  # >= 10x the max of the first 100
    assert f.detector == "loss_spike" and f.value == 10.0
    assert detectors.loss_spike(math.nan, 5.0, 100, p) == []  # non-finite: another detector


def test_nonfinite_respects_a_dynamic_loss_scaler():
    p = D["nonfinite"]
    assert detectors.nonfinite(1.0, math.inf, True, 1, p, dynamic_scaler=True) == []
    assert detectors.nonfinite(1.0, math.inf, True, 5, p, dynamic_scaler=True)
    assert detectors.nonfinite(1.0, math.inf, True, 1, p, dynamic_scaler=False)
    (f,) = detectors.nonfinite(math.nan, math.nan, True, 1, p, dynamic_scaler=True)
    assert f.tensor == "loss"
    (f,) = detectors.nonfinite(1.0, 1.0, False, 0, p, dynamic_scaler=False)
    assert f.tensor == "amax_history"


def test_percent_findings():
    det = {"saturation": D["saturation"], "underflow": D["underflow"]}
    rows = [{"layer": "a", "role": "grad_output", "saturation_pct": 6.0, "underflow_pct": 90.0}]
    found = detectors.percent_findings(rows, {"a:grad_output": [10.0, 0.0]}, det)
    assert {f.detector for f in found} == {"saturation", "underflow"}
    assert detectors.percent_findings(rows, {"a:grad_output": [80.0, 0.0]}, {}) == []


def _one_layer():
    import fp8lab

    return torch.nn.Sequential(fp8lab.nn.Linear(16, 16, recipe="te-delayed", name="lin"))


def _step(model, x):
    model(x).pow(2).sum().backward()


def test_headroom_and_staleness_of_a_delayed_spike():
    torch.manual_seed(0)
    model = _one_layer()
    mon = GuardMonitor(AnomalyGuard(), model)
    assert [n.split(":")[1] for n in mon.tensor_names] == ["input", "weight", "grad_output"]
    x = torch.randn(8, 16)
    for _ in range(3):
        mon.before_step()
        _step(model, x)
        assert mon.check(0, 1.0, 1.0) == []
        mon.accept()
    mon.before_step()
    _step(model, x * 2.0**20)  # the input's amax jumps 20 binades over its delayed scale
    found = mon.check(3, 1.0, 1.0)
    head = [f for f in found if f.detector == "headroom"]
    assert head and head[0].tensor.endswith(":input") and head[0].value == pytest.approx(20, abs=1)
    mon.accept()
    mon.before_step()
    _step(model, x)  # back to normal: the history still holds the spike
    stale = [f for f in mon.check(4, 1.0, 1.0) if f.detector == "staleness"]
    assert stale and stale[0].value == pytest.approx(20, abs=1)
    assert mon.signals["staleness_tensor"].endswith(":input")


def test_reset_scaling_runs_one_current_step_then_delayed_again():
    torch.manual_seed(0)
    model = _one_layer()
    mon = GuardMonitor(AnomalyGuard(), model)
    x = torch.randn(8, 16)
    for _ in range(2):
        _step(model, x)
    name, ds = next((n, d) for n, d in mon.states if n.endswith(":input"))
    assert ds.cfg.first_step == "unit" and ds.initialized
    assert mon.reset_scaling([name]) == [name]
    assert not ds.initialized and float(ds.amax_history.abs().max()) == 0.0
    assert ds.cfg.first_step == "current"
    _step(model, x)  # current scaling, then the update sets a scale from this amax alone
    mon.end_step()
    assert ds.initialized and ds.cfg.first_step == "unit"
    amax = float(x.abs().max())
    assert float(ds.scale) == pytest.approx(448.0 / amax, rel=1e-6)


def test_state_dict_roundtrip():
    mon = GuardMonitor(AnomalyGuard(), torch.nn.Linear(2, 2))
    for v in (3.0, 2.5, 2.0):
        mon.check(0, v, 1.0)
        mon.accept()
    other = GuardMonitor(AnomalyGuard(), torch.nn.Linear(2, 2))
    other.load_state_dict(mon.state_dict())
    assert other.state_dict() == mon.state_dict() and other.loss_count == 3


@pytest.mark.parametrize("recipe", ["te-current", "mxfp8", "te-delayed"])
def test_operand_percentages_equal_the_watch_records(recipe):
    # one definition: the guard's percentages are the watch's, saturation included (block
    # scales too); te-delayed: the input jumps 64x over its delayed scale and clamps
    import fp8lab
    from fp8lab.guard.percent import operand_percentages
    from fp8lab.observe import sample

    torch.manual_seed(0)
    lin = fp8lab.nn.Linear(64, 64, recipe=recipe, name="lin")
    x = torch.randn(32, 64)
    x[0, 0] = 1e-9  # underflows in E4M3 under the per-tensor scale
    x.requires_grad_(True)  # dgrad runs (its grad_output is the natural-layout one)
    if recipe == "te-delayed":
        (lin(x) * 1e-6).sum().backward()  # sets the delayed scales
        x = (x.detach() * 64).requires_grad_(True)
        x.data[0, 0] = 1e-9
    with sample(lin, 1) as rows, operand_percentages() as ours:
        (lin(x) * 1e-6).sum().backward()
    watch = {(r["gemm"], r["role"]): r for r in rows if r["call"] == 0}
    assert {(r["gemm"], r["role"]) for r in ours} == {
        ("fprop", "input"),
        ("fprop", "weight"),
        ("dgrad", "grad_output"),
    }
    for r in ours:
        w = watch[(r["gemm"], r["role"])]
        assert r["underflow_pct"] == w["underflow_pct"]
        assert r["saturation_pct"] == w["saturation_pct"]
    assert next(r for r in ours if r["role"] == "input")["underflow_pct"] > 0
    if recipe == "te-delayed":
        assert next(r for r in ours if r["role"] == "input")["saturation_pct"] > 0


@pytest.mark.parametrize("recipe, acted", [("te-delayed", True), ("te-current", False)])
def test_percentages_act_on_delayed_operands_only(recipe, acted):
    import fp8lab

    model = torch.nn.Sequential(fp8lab.nn.Linear(16, 16, recipe=recipe, name="lin"))
    mon = GuardMonitor(AnomalyGuard(), model)
    row = {"layer": "lin", "role": "grad_output", "gemm": "dgrad", "saturation_pct": 0.0}
    mon.check(9, 1.0, 1.0, [{**row, "underflow_pct": 10.0}])
    mon.accept()
    found = mon.check(19, 1.0, 1.0, [{**row, "underflow_pct": 100.0}])  # +90 points
    assert bool([f for f in found if f.detector == "underflow"]) is acted
    assert mon.signals["underflow_pct"] == 100.0  # reported either way


def test_staleness_warns_and_acts_only_when_the_operand_flushed():
    p = D["staleness"]
    vals = [("a:input", 17.0), ("b:grad_output", 20.0), ("c:input", 3.0)]
    act, warn = detectors.staleness_findings(vals, p, {"a:input": 0.8, "b:grad_output": -1.0})
    assert [f.tensor for f in act] == ["b:grad_output"]  # its largest element rounded to 0
    assert [f.tensor for f in warn] == ["a:input"]  # stale, but the amax still representable
    act, warn = detectors.staleness_findings(vals, p)  # no floor known: never acts
    assert act == [] and len(warn) == 2


@pytest.mark.parametrize("binades, acts", [(17, False), (20, True)])
def test_a_stale_input_warns_unless_its_amax_flushed(binades, acts):
    # E4M3 spans 17.8 binades from 448 down to 2^-9: after a spike of 2^17 the stale scale
    # leaves the normal amax 0.8 binades above the smallest subnormal (a warning); after
    # 2^20, 2.2 binades below it: the whole operand was zero (acts)
    torch.manual_seed(0)
    model = _one_layer()
    mon = GuardMonitor(AnomalyGuard(detectors=["staleness"]), model)
    x = torch.randn(8, 16)
    for scale in (1.0, 1.0, 2.0**binades, 1.0):
        mon.before_step()
        _step(model, x * scale)
        found = mon.check(0, 1.0, 1.0)
        mon.accept()
    assert mon.signals["staleness_tensor"].endswith(":input")
    assert mon.signals["staleness"] >= D["staleness"]["threshold"]
    assert "staleness" in mon.signals["fired"]
    assert bool(found) is acts and bool(mon.warnings) is not acts
    assert ("staleness" in mon.signals["warned"]) is not acts
