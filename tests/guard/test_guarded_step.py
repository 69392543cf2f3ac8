"""fp8lab.GuardedStep: the lab's guard (detectors, skip / rollback, snapshots, event records,
escalation) around a user's own step, from the same code as the lab's loop (GuardSession)."""

from __future__ import annotations

import copy
import functools
import io
import json

import pytest
import torch

import fp8lab
from fp8lab.guard import AnomalyGuard, GuardedStep, GuardSession

STEPS = 16


def _model(recipe: str | None = "te-delayed") -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    if recipe is not None:
        fp8lab.nn.convert(m, recipe, default_exclude=False)
    return m


def _data(n: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def _fwd_bwd(model, x, y, fault=None, scaler=None):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if fault == "nan":
        loss = loss * float("nan")
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if fault in ("spike", "inf"):
        for p in model.parameters():
            p.grad.mul_(2.0**40 if fault == "spike" else float("inf"))
    return loss


def _run(guard, faults, steps=STEPS, recipe="te-delayed", stateful=False):
    model, data = _model(recipe), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if stateful else None
    gs = GuardedStep(model, opt, guard=guard, scheduler=sched)
    faults, pos, results = dict(faults), 0, []
    while gs.steps_done < steps:
        x, y = data[pos]
        fault = faults.pop(gs.steps_done, None)
        r = gs.step(functools.partial(_fwd_bwd, model, x, y, fault), position=pos)
        results.append(r)
        pos = r.next_position
    return model, gs, results


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_nan_and_a_gradient_spike_are_rolled_back_and_the_replay_is_bit_identical():
    guard = AnomalyGuard(checkpoint_every=4, detectors={"grad_norm_zscore": {"min_samples": 4}})
    clean, _, _ = _run(guard, {})
    model, gs, results = _run(guard, {6: "nan", 13: "spike"})
    rolled = [r for r in results if r.rolled_back]
    assert [(r.to_step, r.next_position, r.reason) for r in rolled] == [
        (4, 4, "nonfinite on loss"),
        (8, 8, "grad_norm_zscore"),  # the 2nd rollback within `window` goes 2 snapshots back
    ]
    assert [e["action"] for e in gs.events] == ["rollback", "rollback"]
    assert gs.events[0]["step"] == 6 and gs.events[0]["batch"] == 6
    # the replay ran the same batches from the restored state: the clean run's weights exactly
    assert _same_weights(model, clean)


def test_skip_does_not_apply_the_update():
    model, data = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs = GuardedStep(model, opt, guard=AnomalyGuard(policy="skip"))
    before = [p.detach().clone() for p in model.parameters()]
    r = gs.step(functools.partial(_fwd_bwd, model, *data[0], "nan"))
    assert r.action == "skipped" and not r.applied and r.steps_done == 1
    assert r.events[0]["action"] == "skip" and r.events[0]["detector"] == "nonfinite"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert gs.step(functools.partial(_fwd_bwd, model, *data[1])).applied


def test_policy_off_reports_but_applies():
    model, data = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs = GuardedStep(model, opt, guard=AnomalyGuard(policy="off"))
    r = gs.step(functools.partial(_fwd_bwd, model, *data[0], "spike"))
    assert r.applied and r.events == () and gs.signals["step"] == 0


def test_rollback_restores_the_users_scheduler():
    guard = AnomalyGuard(checkpoint_every=4)
    clean, gs0, _ = _run(guard, {}, steps=8, stateful=True)
    model, gs, results = _run(guard, {6: "nan"}, steps=8, stateful=True)
    assert sum(r.rolled_back for r in results) == 1
    assert gs.scheduler.last_epoch == gs0.scheduler.last_epoch == 8
    assert _same_weights(model, clean)


def test_guarded_step_is_the_one_train_step_with_the_guard_as_its_hook():
    """No second step: GuardedStep runs `fp8lab.step.TrainStep` (the closure runs backward)
    with its guard (`GuardHook`, the lab's hook too) and watch as hooks, so a clean guarded
    run is bit-identical to the hook-free TrainStep on the same closures."""
    from fp8lab.guard import GuardHook
    from fp8lab.step import TrainStep, WatchHook

    model, data = _model(), _data()
    twin = copy.deepcopy(model)
    gs = GuardedStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), clip=0.5)
    assert isinstance(gs._step, TrainStep) and not gs._step.backward
    assert isinstance(gs.session, GuardHook) and gs._step.hooks[0] is gs.session
    assert isinstance(gs._step.hooks[1], WatchHook)
    plain = TrainStep(lambda c: c(), torch.optim.AdamW(twin.parameters(), lr=1e-2), clip=0.5,
                      backward=False)  # fmt: skip
    for i in range(6):
        r = gs.step(functools.partial(_fwd_bwd, model, *data[i]))
        ctx = plain(i, functools.partial(_fwd_bwd, twin, *data[i]))
        assert r.applied and (r.loss, r.grad_norm) == (ctx.loss_value, ctx.grad_norm)
    assert _same_weights(model, twin)


def test_escalation_pins_the_layer_of_a_user_model():
    """A reproducible anomaly (the replay of its own step fails again) escalates: the flagged
    delayed-scaling tensor is pinned to current scaling in the user's converted layer."""
    model, data = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gs = GuardedStep(model, opt, guard=AnomalyGuard(checkpoint_every=2))
    for i in range(2):
        gs.step(functools.partial(_fwd_bwd, model, *data[i]))
    ses = gs.session
    ses.check = lambda *a: _flag(ses)  # the third step flags layer 0's input, every time
    r1 = gs.step(functools.partial(_fwd_bwd, model, *data[2]), position=2)
    assert r1.rolled_back and r1.to_step == 2
    r2 = gs.step(functools.partial(_fwd_bwd, model, *data[2]), position=2)
    actions = [e["action"] for e in r2.events]
    assert actions == ["escalate", "rollback"] and gs.state.escalations == [["0", "input"]]
    assert model[0].recipe.input.scaling == "max"  # current scaling for that tensor
    assert model[2].recipe.input.is_delayed  # the other layer keeps its recipe


def _flag(ses: GuardSession) -> bool:
    from fp8lab.guard import Finding

    ses.findings = [Finding("headroom", 9.0, 4.0, "0:input")]
    ses.monitor.signals = {"step": 2, "loss": 1.0, "grad_norm": 1.0}
    return True


def test_a_dynamic_grad_scaler_handles_one_overflow_itself():
    model, data = _model(None), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gs = GuardedStep(model, opt, guard=AnomalyGuard(), scaler=scaler)
    r = gs.step(functools.partial(_fwd_bwd, model, *data[0], "inf", scaler))
    assert r.action == "skipped" and r.events == ()  # the scaler backs off, the guard waits
    assert scaler.get_scale() == 2.0**15
    assert gs.step(functools.partial(_fwd_bwd, model, *data[1], None, scaler)).applied


def test_state_dict_is_plain_data_and_round_trips():
    guard = AnomalyGuard(checkpoint_every=4)
    model, gs, _ = _run(guard, {6: "nan"}, steps=8)
    buf = io.BytesIO()
    torch.save(gs.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    gs2 = GuardedStep(model, torch.optim.SGD(model.parameters(), lr=0.1), guard=guard)
    gs2.load_state_dict(state)
    gs2.snapshot()
    assert gs2.steps_done == 8 and gs2.events == gs.events
    assert gs2.session.monitor.state_dict() == gs.session.monitor.state_dict()
    with pytest.raises(ValueError, match="not an fp8lab guard checkpoint"):
        gs2.load_state_dict({"guard": {}})


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "not a model"}, "model must be a torch.nn.Module"),
    ({"optimizer": object()}, "optimizer must be a torch optimizer"),
    ({"clip": -1.0}, "clip must be a number >= 0"),
    ({"position": -3}, "position must be an integer >= 0"),
    ({"stateful": {"sched": object()}}, r"stateful\['sched'\]"),
    ({"watch_every": -1}, "watch_every must be an integer >= 0"),
    ({"guard": "rollback"}, r"guard must be an fp8lab\.AnomalyGuard \(a policy name: "
                            r"AnomalyGuard\(policy='rollback'\)\)"),
    ({"optimizer": torch.optim.SGD(_model(None).parameters(), lr=0.1)},
     "4 of the optimizer's 4 parameters are not parameters of the model"),
])  # fmt: skip
def test_bad_arguments_are_named(kwargs, match):
    model = _model(None)
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        GuardedStep(**args)


def test_an_optimizer_over_part_of_another_model_is_refused():
    model, other = _model(None), _model(None)
    opt = torch.optim.SGD([*model[0].parameters(), *other[2].parameters()], lr=0.1)
    with pytest.raises(ValueError, match="2 of the optimizer's 4 parameters are not"):
        GuardedStep(model, opt)


@pytest.mark.parametrize("returns, err, match", [
    (None, TypeError, "the closure returned None; it must return the loss"),
    ("dict", TypeError, "the closure returned a dict"),
    ("str", TypeError, "the closure returned a str"),
    ("no-backward", ValueError, "the closure returned the loss but no parameter's gradient"),
])  # fmt: skip
def test_a_closure_that_does_not_return_the_loss_or_never_calls_backward_is_named(
    returns, err, match
):
    model, data = _model(), _data()
    gs = GuardedStep(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def closure():
        x, y = data[0]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if returns == "no-backward":
            return loss
        loss.backward()
        return {"dict": {"loss": loss}, "str": "loss"}.get(returns)

    with pytest.raises(err, match=f"GuardedStep: {match}"):
        gs.step(closure)
    assert gs.steps_done == 0
    assert all(p.grad is None for p in model.parameters())  # no stale gradient left behind
    # the step after a refused one runs normally (the operand collectors were closed)
    assert gs.step(functools.partial(_fwd_bwd, model, *data[0])).applied


def test_watch_every_on_a_model_without_fp8lab_layers_warns():
    model = _model(None)
    with pytest.warns(UserWarning, match="GuardedStep: watch_every=2 but the model has no fp8lab"):
        GuardedStep(model, torch.optim.SGD(model.parameters(), lr=0.1), watch_every=2)


def test_reexported_from_fp8lab():
    assert fp8lab.GuardedStep is GuardedStep


def test_watch_records_equal_the_labs_and_a_rollback_drops_the_abandoned_ones():
    from fp8lab.step import TrainStep, WatchHook

    model, data = _model(), _data()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gs = GuardedStep(model, opt, guard=AnomalyGuard(checkpoint_every=2), watch_every=1)
    for i in range(3):
        gs.step(functools.partial(_fwd_bwd, model, *data[i]))
    # the lab's step with its watch hook, same weights, same batches
    watch, rows = WatchHook(twin, 1), []
    opt2 = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ts = TrainStep(lambda b: torch.nn.functional.cross_entropy(twin(b[0]), b[1]), opt2, None, 0.0,
                   [watch])  # fmt: skip
    for i in range(3):
        ts(i, data[i])
        rows += watch.rows
    assert rows and json.dumps(gs.records, default=float) == json.dumps(rows, default=float)
    r = gs.step(functools.partial(_fwd_bwd, model, *data[3], "nan"), position=3)
    assert r.rolled_back and r.to_step == 2
    assert {x["step"] for x in gs.records} == {1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_rollback_restores_the_cuda_generator_too():
    """Dropout on the GPU draws from the CUDA generator: the replay after a rollback equals the
    clean run only when the snapshot holds that generator's state as well."""

    def run(faults):
        torch.manual_seed(0)
        torch.cuda.manual_seed_all(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(32, 4)).cuda()  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gs = GuardedStep(model, opt, guard=AnomalyGuard(checkpoint_every=2))
        data, pos, faults = _data(), 0, dict(faults)
        while gs.steps_done < 8:
            x, y = (t.cuda() for t in data[pos])
            fault = faults.pop(gs.steps_done, None)
            pos = gs.step(
                functools.partial(_fwd_bwd, model, x, y, fault), position=pos
            ).next_position
        return model, gs

    clean, _ = run({})
    model, gs = run({5: "nan"})
    assert [e["action"] for e in gs.events] == ["rollback"]
    assert _same_weights(model, clean)
