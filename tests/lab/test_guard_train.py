"""The anomaly guard inside the training loop (fp8lab.lab.guard_run): no false alarm, spike
recovery, one-shot faults, NaN rollback, skip, escalation, resume."""

import json

import pytest
import torch

import fp8lab
from fp8lab.guard import AnomalyGuard
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.inject import InjectConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run

CFG = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(
        steps=40, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=10, eval_batches=2,
        stats_every=5, checkpoint_every=10,
    ),
)  # fmt: skip
GUARD = AnomalyGuard(checkpoint_every=10)
#: a detector that fires on every delayed operand on every step after the first
EVERY_STEP = {"underflow": {"jump_pct": 0.0, "every": 1}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("Now is the winter of our discontent made glorious summer by this sun. " * 40)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


@pytest.fixture(scope="module")
def clean(corpus):
    return train_run(fp8lab.get_recipe("te-delayed"), CFG, corpus)


def _with(**inject):
    return LabConfig(model=CFG.model, train=CFG.train, inject=InjectConfig(**inject))


def _same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _losses(res):
    return [(r["step"], r["train_loss"], r["grad_norm"], r.get("val_loss")) for r in res.records]


def test_no_false_alarm_and_bit_identical(corpus, clean, tmp_path):
    guarded = train_run(fp8lab.get_recipe("te-delayed"), CFG, corpus, tmp_path, guard=GUARD)
    assert guarded.summary["guard_events"] == []
    assert _losses(guarded) == _losses(clean) and _same_model(guarded.model, clean.model)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["guard_events"] == [] for r in recs)
    assert json.loads((tmp_path / "run.json").read_text())["summary"]["guard_events"] == []


def _grad_underflow(path, steps):
    rows = [json.loads(x) for x in (path / "stats.jsonl").read_text().splitlines()]
    out = {}
    for r in rows:
        if r["role"] == "grad_output" and r["gemm"] == "dgrad" and r["step"] in steps:
            out.setdefault(r["step"], {})[r["layer"]] = r["underflow_pct"]
    return out


def test_spike_is_caught_rolled_back_and_recovers(corpus, clean, tmp_path):
    spike_at = 23
    cfg = _with(grad_spike_step=spike_at, grad_spike_scale=1e12)
    res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, tmp_path / "g", guard=GUARD)
    events = res.summary["guard_events"]
    assert [e["action"] for e in events] == ["rollback"]
    ev = events[0]
    assert ev["step"] in (spike_at, spike_at + 1) and ev["detector"] == "headroom"
    assert ev["value"] > 30 and ev["to_step"] == 20 and ev["reset"]
    # every step once, in order; the spike fired once and was not replayed
    assert [r["step"] for r in res.records] == list(range(1, 41))
    # after the restart no gradient operand underflows more than 1 point above pre-spike
    pre = _grad_underflow(tmp_path / "g", {20})[20]
    for step, by_layer in _grad_underflow(tmp_path / "g", {25, 30, 35, 40}).items():
        for layer, u in by_layer.items():
            assert u <= pre[layer] + 1.0, (step, layer, u, pre[layer])
    final, ref = res.summary["final_val_loss"], clean.summary["final_val_loss"]
    assert abs(final - ref) / ref < 0.005
    # unguarded, the stale scale flushes the gradients: the failure the guard prevents
    train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, tmp_path / "u")
    after = _grad_underflow(tmp_path / "u", {30, 35, 40})
    assert after and all(max(d.values()) > 99.0 for d in after.values())


def test_spike_without_headroom_is_caught_by_staleness_at_t_plus_1(corpus, clean):
    # staleness alone is a warning, but after a x2^40 gradient spike the stale scale flushes
    # the next step's whole gradient operand (the amax lands below E5M2's smallest subnormal):
    # certain, so it acts, one step after the spike
    spike_at = 23
    cfg = _with(grad_spike_step=spike_at, grad_spike_scale=1e12)
    dets = {"headroom": False}
    res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus,
                    guard=AnomalyGuard(checkpoint_every=10, detectors=dets))  # fmt: skip
    (ev,) = res.summary["guard_events"]
    assert ev["action"] == "rollback" and ev["detector"] == "staleness"
    assert ev["step"] == spike_at + 1 and ev["tensor"].endswith(":grad_output")
    final, ref = res.summary["final_val_loss"], clean.summary["final_val_loss"]
    assert abs(final - ref) / ref < 0.005


def test_hot_learning_rate_warns_but_does_not_loop(corpus):
    # at lr 0.3 (100x the test's) delayed scales go stale on many steps: staleness warns there
    # (the run with policy off shows it) but never acts alone; the anomalies that do act
    # (headroom: the amax outgrows its delayed scale by 16x while warmup ends) reproduce on
    # the replay of the same step, so the guard escalates at once instead of replaying again
    cfg = LabConfig(model=CFG.model, train=CFG.train.__class__(
        **{**CFG.train.__dict__, "lr": 0.3, "stats_every": 0}))  # fmt: skip
    recipe = fp8lab.get_recipe("te-delayed")
    sig = []
    train_run(recipe, cfg, corpus, guard=AnomalyGuard(policy="off"),
              callback=lambda e: sig.append(e) if e["event"] == "guard_signals" else None)  # fmt: skip
    # how many steps warn depends on the trajectory, which depends on the CPU's BLAS kernels
    # (steps 14-18 and 21 warn everywhere; then 20 steps in all on AVX-512, 11 under
    # ATEN_CPU_CAPABILITY=avx2, 6 on a Xeon with AMX): the behaviour is that it warns at all
    warned = [s["step"] for s in sig if "staleness" in s["warned"]]
    assert warned
    res = train_run(recipe, cfg, corpus, guard=AnomalyGuard(checkpoint_every=5))
    events = res.summary["guard_events"]
    assert all(e["detector"] != "staleness" for e in events)
    # a step is rolled back at most twice: once, and once more right after escalating
    rollbacks = [e["step"] for e in events if e["action"] == "rollback"]
    assert rollbacks and all(rollbacks.count(t) <= 2 for t in rollbacks)
    seen = set()
    for i, e in enumerate(events):
        if e["action"] == "rollback":
            if e["step"] in seen:
                assert events[i - 1]["action"] == "escalate" and events[i - 1]["step"] == e["step"]
            seen.add(e["step"])
    assert len(rollbacks) <= 2 * AnomalyGuard().max_rollbacks
    assert res.summary["complete"] and [r["step"] for r in res.records] == list(range(1, 41))


def test_nan_step_one_rollback_no_step_lost_or_applied_twice(corpus, clean, tmp_path):
    cfg = _with(nan_step=17)
    res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, tmp_path, guard=GUARD)
    (ev,) = res.summary["guard_events"]
    assert ev["action"] == "rollback" and ev["detector"] == "nonfinite" and ev["step"] == 17
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 41))
    assert sum(len(r["guard_events"]) for r in recs) == 1
    assert res.summary["skipped_steps"] == 0
    # the NaN step replays clean: exactly the clean run (each update applied once, none lost)
    assert _losses(res) == _losses(clean) and _same_model(res.model, clean.model)
    ref = clean.summary["final_val_loss"]
    assert abs(res.summary["final_val_loss"] - ref) / ref < 0.01
    # unguarded: the NaN step is skipped (its update lost)
    plain = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus)
    assert plain.summary["skipped_steps"] == 1


def test_skip_policy_drops_the_update_and_keeps_going(corpus):
    res = train_run(fp8lab.get_recipe("te-delayed"), _with(nan_step=5), corpus,
                    guard=AnomalyGuard(policy="skip"))  # fmt: skip
    (ev,) = res.summary["guard_events"]
    assert ev["action"] == "skip" and ev["step"] == 5
    assert res.records[5]["skipped"] and res.records[5]["guard_events"] == [ev]
    assert res.summary["skipped_steps"] == 1 and len(res.records) == 40


def test_policy_off_reports_nothing_and_changes_nothing(corpus):
    cfg = _with(nan_step=5)
    off = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, guard=AnomalyGuard(policy="off"))
    plain = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus)
    assert off.summary["guard_events"] == [] and _losses(off) == _losses(plain)


def test_skip_batch_moves_the_data_cursor(corpus, tmp_path):
    g = AnomalyGuard(checkpoint_every=10, on_restart="skip_batch")
    res = train_run(fp8lab.get_recipe("te-delayed"), _with(nan_step=17), corpus, tmp_path, guard=g)
    (ev,) = res.summary["guard_events"]
    assert ev["skip_batch"] and ev["batch"] == 17
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["loop"]["step"] == 40 and state["loop"]["cursor"] == 41
    assert state["loop"]["skip_batches"] == [17] and state["loop"]["injected"] == ["nan@17"]


def test_rollback_then_resume_is_bit_identical(corpus, tmp_path):
    cfg = _with(nan_step=17)
    full = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, tmp_path / "a", guard=GUARD)
    r = fp8lab.get_recipe("te-delayed")
    train_run(r, cfg, corpus, tmp_path / "b", guard=GUARD, stop_after=25)
    resumed = train_run(r, cfg, corpus, tmp_path / "b", guard=GUARD)
    assert _losses(resumed) == _losses(full) and _same_model(resumed.model, full.model)
    assert resumed.summary["guard_events"] == full.summary["guard_events"]


def test_escalation_pins_the_tensor_to_current_scaling(corpus):
    # an underflow "jump" of >= 0 points, measured every step, fires on every delayed operand
    # from the second step on: rollbacks repeat until max_rollbacks, then every flagged tensor
    # is pinned to current scaling
    g = AnomalyGuard(detectors=EVERY_STEP, checkpoint_every=5, max_rollbacks=1)
    cfg = LabConfig(model=CFG.model, train=CFG.train.__class__(
        **{**CFG.train.__dict__, "steps": 12, "stats_every": 0}))  # fmt: skip
    res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, guard=g)
    actions = [e["action"] for e in res.summary["guard_events"]]
    assert actions[:1] == ["rollback"] and "escalate" in actions
    assert res.summary["complete"] and [r["step"] for r in res.records] == list(range(1, 13))
    eff = res.summary["effective_recipe"]
    assert eff["layer"] and all(
        rule[key] == {"scaling": "max"} for rule in eff["layer"] for key in rule if key != "match"
    )
    pinned = [e["tensor"] for e in res.summary["guard_events"] if e["action"] == "escalate"]
    layer, role = pinned[0].rsplit(":", 1)
    mod = res.model.get_submodule(layer)
    assert mod.recipe.spec("dgrad" if role == "grad_output" else "fprop", role).scaling == "max"


@pytest.mark.parametrize("name", ["fp32", "bf16", "te-delayed", "deepseek-v3", "mxfp8",
                                  "hif8-delayed", "e4m3-unscaled-grads"])  # fmt: skip
def test_demo_recipes_guarded_are_bit_identical(corpus, name):
    from fp8lab.lab.recipes import resolve_recipe

    cfg = LabConfig(model=CFG.model, train=CFG.train.__class__(
        **{**CFG.train.__dict__, "steps": 12, "stats_every": 0}))  # fmt: skip
    g = AnomalyGuard(checkpoint_every=5, detectors={"saturation": {"every": 3},
                                                    "underflow": {"every": 3}})  # fmt: skip
    plain = train_run(resolve_recipe(name), cfg, corpus)
    guarded = train_run(resolve_recipe(name), cfg, corpus, guard=g)
    assert guarded.summary["guard_events"] == []
    assert _losses(guarded) == _losses(plain) and _same_model(guarded.model, plain.model)


def test_report_draws_guard_events_on_the_loss_timeline(tmp_path, monkeypatch):
    import matplotlib.axes

    from fp8lab.report.training import plot_loss

    ev = {"action": "rollback", "step": 3, "detector": "headroom", "tensor": "a:grad_output"}
    recs = [{"step": s, "train_loss": 3.0 - 0.1 * s, "guard_events": [ev] if s == 3 else []}
            for s in range(1, 8)]  # fmt: skip
    texts, lines = [], []
    annotate, axvline = matplotlib.axes.Axes.annotate, matplotlib.axes.Axes.axvline
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "annotate",
        lambda ax, t, *a, **k: texts.append(t) or annotate(ax, t, *a, **k),
    )
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda ax, x, *a, **k: lines.append(x) or axvline(ax, x, *a, **k))  # fmt: skip
    fig = plot_loss({"te-delayed": recs}, "te-delayed", set(), tmp_path / "loss.png")
    assert fig.stat().st_size > 0
    assert texts == ["rollback (headroom)"] and lines == [4]  # drawn at its record step


def test_a_persistent_anomaly_does_not_roll_back_forever(corpus):
    # a detector firing on every step: rollbacks (the second also skips its batch: no
    # escalation), then skips once 2 x max_rollbacks rollbacks fell within the window
    g = AnomalyGuard(detectors=EVERY_STEP, checkpoint_every=5, max_rollbacks=1, escalate=False)
    cfg = LabConfig(model=CFG.model, train=CFG.train.__class__(
        **{**CFG.train.__dict__, "steps": 12, "stats_every": 0}))  # fmt: skip
    res = train_run(fp8lab.get_recipe("te-delayed"), cfg, corpus, guard=g)
    actions = [e["action"] for e in res.summary["guard_events"]]
    assert actions.count("rollback") == 2 and "skip" in actions
    assert res.summary["complete"] and [r["step"] for r in res.records] == list(range(1, 13))
