import pytest

import fp8lab
from fp8lab.guard import DETECTOR_DEFAULTS, AnomalyGuard


def test_defaults_and_reexport():
    g = fp8lab.AnomalyGuard()
    assert g.policy == "rollback" and g.checkpoint_every == 50 and g.keep == 3
    assert g.max_rollbacks == 3 and g.window == 200 and g.on_restart == "current_step"
    assert g.escalate is True
    assert g.detector_params == DETECTOR_DEFAULTS


def test_detectors_forms():
    assert set(AnomalyGuard(detectors=["nonfinite", "headroom"]).detector_params) == {
        "nonfinite",
        "headroom",
    }
    g = AnomalyGuard(
        detectors={"headroom": {"threshold": 2}, "staleness": False, "nonfinite": True}
    )
    assert g.detector_params["headroom"]["threshold"] == 2.0
    assert "staleness" not in g.detector_params and "nonfinite" in g.detector_params
    # a table overrides the defaults: the detectors it does not name keep theirs
    assert set(g.detector_params) == set(DETECTOR_DEFAULTS) - {"staleness"}
    assert set(AnomalyGuard(detectors={"headroom": False}).detector_params) == set(
        DETECTOR_DEFAULTS
    ) - {"headroom"}
    assert AnomalyGuard.from_dict(g.to_dict()) == g


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"policy": "panic"}, "policy"),
        ({"on_restart": "later"}, "on_restart"),
        ({"keep": 0}, "keep"),
        ({"window": 1.5}, "window"),
        ({"detectors": ["nope"]}, "nope"),
        ({"detectors": {"headroom": {"binades": 3}}}, "binades"),
        ({"detectors": {"headroom": {"threshold": "x"}}}, "threshold"),
        ({"detectors": {"loss_zscore": {"window": 0}}}, "window"),
    ],
)
def test_bad_values_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        AnomalyGuard(**kw)


def test_toml(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text('policy = "skip"\nkeep = 2\n[detectors.headroom]\nthreshold = 6\n')
    g = AnomalyGuard.from_toml(f)
    assert g.policy == "skip" and g.keep == 2 and g.detector_params["headroom"]["threshold"] == 6
    f.write_text("polcy = 'skip'\n")
    with pytest.raises(ValueError, match=r"g\.toml.*polcy"):
        AnomalyGuard.from_toml(f)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('policy = "explode"\n', ("policy", "explode")),
        ("[detectors.saturation]\nthreshold_pct = 500\n", ("saturation.threshold_pct", "500")),
        ("[detectors.underflow]\njump_pct = 101\n", ("underflow.jump_pct", "101")),
    ],
)
def test_guard_file_checked_whole_even_when_policy_is_overridden(tmp_path, text, words):
    # issue 22: `--guard skip --guard-config FILE` overrode the file's policy before checking it
    p = tmp_path / "guard.toml"
    p.write_text(text)
    for overrides in ({}, {"policy": "skip"}):
        with pytest.raises(ValueError) as e:
            AnomalyGuard.from_toml(p, **overrides)
        assert str(e.value).startswith(str(p)) and all(w in str(e.value) for w in words)
    p.write_text('policy = "off"\n[detectors.saturation]\nthreshold_pct = 100\n')
    assert AnomalyGuard.from_toml(p, policy="skip").policy == "skip"
