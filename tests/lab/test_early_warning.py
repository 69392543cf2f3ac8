"""Early-warning arithmetic (divergence step, z-score firings, lead time, detection delay,
false-alarm rate) on hand-made series, the optional indicators' hooks, and a tiny real run in
which the headroom signal fires at the planted gradient spike."""

import math

import pytest
import torch

import fp8lab
from fp8lab.guard import AnomalyGuard
from fp8lab.lab import early_warning as ew
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.lab.inject import InjectConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run


def test_divergence_step():
    assert ew.divergence_step([5.0, 4.0, 3.0, 4.4, 4.6]) == 4  # 4.4 <= 1.5 * 3 < 4.6
    assert ew.divergence_step([5.0, 4.0, 3.0, 4.4], factor=1.4) == 3
    assert ew.divergence_step([5.0, 2.0, float("nan"), 9.0]) == 2
    assert ew.divergence_step([5.0, None, 1.0]) == 1
    assert ew.divergence_step([float("inf")]) == 0
    assert ew.divergence_step([9.0, 8.0, 8.5, 3.0]) is None
    assert ew.divergence_step([]) is None


def test_zscore_firings_exact():
    base = [1.0] * 20  # median 1, MAD 0: the spread is the 0.01 floor
    # 1.08 -> z = 8 (no), 1.2 -> z = 20 (fires), 0.8 -> z = -20 (two-sided only)
    got = ew.zscore_firings([*base, 1.08, 1.2, 0.8], log=False)
    assert got == [False] * 20 + [False, True, False]
    got = ew.zscore_firings([*base, 1.08, 1.2, 0.8], log=False, two_sided=True)
    assert got == [False] * 20 + [False, True, True]
    # fewer than min_samples earlier values: never fires
    assert ew.zscore_firings([1.0] * 5 + [100.0], log=False) == [False] * 6
    assert ew.zscore_firings([1.0] * 5 + [100.0], log=False, min_samples=5)[-1] is True
    # log: z of log(x); non-positive and non-finite values neither fire nor join the window
    got = ew.zscore_firings([1.0] * 19 + [0.0, None, math.nan, 1.0, 1.3], log=True)
    assert got == [False] * 23 + [True]  # log(1.3) / 0.01 = 26.2 after 20 usable values
    # the window: only the previous `window` values count
    series = [100.0] * 16 + [1.0] * 14 + [1.5]
    assert ew.zscore_firings(series, log=False, window=14, min_samples=10)[-1] is True
    assert ew.zscore_firings(series, log=False, window=30)[-1] is False  # median 100


def test_lead_time_and_detection_delay():
    assert ew.lead_time([10, 50, 95], 100) == 90
    assert ew.lead_time([10, 50, 95], 100, lookback=20) == 5
    assert ew.lead_time([100, 120], 100) == 0
    assert ew.lead_time([103], 100) == -3  # fires only after the loss crossed
    assert ew.lead_time([250], 100) is None  # too late to be related
    assert ew.lead_time([], 100) is None
    assert ew.lead_time([5], None) is None  # no divergence: no lead time
    assert ew.detection_delay([3, 40, 41], 40) == 0
    assert ew.detection_delay([3, 40, 41], 39) == 1
    assert ew.detection_delay([3, 40, 41], 39, horizon=0) is None
    assert ew.detection_delay([3], 10) is None


def test_false_alarm_rate_and_firing_steps():
    assert ew.false_alarm_rate(3, 1200) == 2.5
    assert ew.false_alarm_rate(0, 400) == 0.0
    with pytest.raises(ValueError, match="n_steps"):
        ew.false_alarm_rate(1, 0)
    recs = [{"step": t, "fired": ["headroom"] if t in (7, 9) else []} for t in range(12)]
    recs[3]["fired"] = ["staleness", "headroom"]
    assert ew.firing_steps(recs, "headroom") == [3, 7, 9]
    assert ew.firing_steps(recs, "staleness") == [3]
    assert ew.firing_steps(recs, "nonfinite") == []
    recs = [{"step": t + 5, "log_z": 5.0} for t in range(20)] + [{"step": 25, "log_z": 5.5}]
    assert ew.firing_steps(recs, "log_z") == [25]  # |z| = 0.5 / 0.01 = 50
    assert ew.firing_steps(recs, "log_z", threshold=60.0) == []
    with pytest.raises(ValueError, match="unknown signal"):
        ew.firing_steps(recs, "nope")


def test_firings_rebuilt_from_signals():
    recs = [
        {"step": 0, "loss": 3.0, "grad_norm": 1.0, "underflow_pct": 1.0, "headroom": 4.0},
        {"step": 1, "loss": 3.0, "grad_norm": None, "grad_norm_zscore": -12.0},
        {"step": 2, "loss": 3.0, "grad_norm": 1.0, "underflow_pct": 20.0, "staleness": 15.9},
        {"step": 3, "loss": None, "grad_norm": 1.0, "underflow_pct": 45.0, "loss_zscore": -11},
    ]
    assert ew.firing_steps(recs, "nonfinite") == [1, 3]
    assert ew.firing_steps(recs, "headroom") == [0]
    assert ew.firing_steps(recs, "staleness") == []
    assert ew.firing_steps(recs, "grad_norm_zscore") == [1]  # two-sided
    assert ew.firing_steps(recs, "loss_zscore") == []  # upward only
    assert ew.firing_steps(recs, "underflow") == [3]  # 20 -> 45: +25 points


def test_recorder_keeps_one_record_per_step_after_a_replay():
    rec = ew.SignalRecorder()
    for t in (0, 1, 2, 1, 2, 3):  # a rollback after step 2 replays steps 1 and 2
        rec({"event": "guard_signals", "recipe": "r", "step": t, "loss": float(t), "fired": []})
        rec({"event": "step", "step": t + 1})  # other events are ignored
    assert [r["step"] for r in rec.records] == [0, 1, 2, 3]
    assert "event" not in rec.records[0] and "recipe" not in rec.records[0]


def test_channel_kurtosis():
    x = torch.zeros(4, 3, 8)
    x[..., 0] = 2.0  # all energy in one of 8 channels
    assert ew.channel_kurtosis(x) == 8.0
    assert ew.channel_kurtosis(torch.ones(5, 8) * 3) == 1.0


def _brute_max_logit(qkv, H, hd):
    q, k, _ = qkv.split(H * hd, dim=2)
    want = -math.inf
    for b in range(qkv.shape[0]):
        for h in range(H):
            for i in range(qkv.shape[1]):
                for j in range(i + 1):  # causal: query i sees keys 0..i
                    qi = q[b, i, h * hd : (h + 1) * hd]
                    kj = k[b, j, h * hd : (h + 1) * hd]
                    want = max(want, float(qi @ kj) / math.sqrt(hd))
    return want


def test_max_attention_logit_is_causal():
    B, T, H, hd = 2, 5, 2, 4
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * hd, generator=g)
    assert ew.max_attention_logit(qkv, H) == pytest.approx(_brute_max_logit(qkv, H, hd), rel=1e-6)
    # query 0 x key 4 (a future key for query 0) = 100 * 100 * 4 / 2 = 20000: masked out
    qkv[0, 0, :hd] = 100.0
    qkv[0, 4, H * hd : H * hd + hd] = 100.0
    got = ew.max_attention_logit(qkv, H)
    assert got == pytest.approx(_brute_max_logit(qkv, H, hd), rel=1e-6) and got < 20000.0


def test_optional_signals_hooks():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, d_model=16, d_ff=32))
    hooks = ew.OptionalSignals(model)
    x = torch.randint(0, 256, (2, 8))
    logits, _ = model(x)
    vals = hooks.take()
    assert set(vals) == set(ew.OPTIONAL_SIGNALS)
    assert vals["log_z"] == pytest.approx(float(logits.detach().logsumexp(-1).mean()), rel=1e-6)
    assert vals["kurtosis_block"] >= 1.0 and vals["kurtosis_linear_in"] >= 1.0
    assert hooks.take() == {}
    model.eval()
    model(x)
    assert hooks.take() == {}  # evaluation forwards are not training steps
    model.train()
    hooks.remove()
    model(x)
    assert hooks.take() == {}


def test_spike_fires_headroom_at_the_spike_step(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Now is the winter of our discontent made glorious summer by this sun. " * 40)
    corpus = load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)
    spike_at = 23
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
        train=TrainConfig(
            steps=40,
            batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            eval_every=20,
            eval_batches=1,
            stats_every=0,
        ),
        inject=InjectConfig(grad_spike_step=spike_at, grad_spike_scale=1e12),
    )
    rec = ew.SignalRecorder()
    with ew.recording(rec):
        res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, None, rec,
                        guard=AnomalyGuard(policy="off"))  # fmt: skip
    assert res.summary["guard_events"] == []  # policy off: signals only
    assert [r["step"] for r in rec.records] == list(range(40))
    assert all(set(ew.OPTIONAL_SIGNALS) <= set(r) for r in rec.records)
    fires = ew.firing_steps(rec.records, "headroom")
    assert fires and min(fires) in (spike_at, spike_at + 1)
    assert ew.detection_delay(fires, spike_at) in (0, 1)
    assert rec.records[min(fires)]["headroom"] >= 4.0
    # without the monitor's `fired` list, the rebuilt firings of the threshold rules agree
    stripped = [{k: v for k, v in r.items() if k != "fired"} for r in rec.records]
    for d in ("headroom", "staleness", "saturation", "loss_zscore", "grad_norm_zscore"):
        assert ew.guard_firings(stripped, d) == ew.guard_firings(rec.records, d), d
    # the hooks are gone after the block
    assert rec.hooks is not None and rec.hooks._handles == []
