"""fp8lab.integrations.lightning.FP8LabCallback in a real lightning Trainer.fit (CPU, tiny
model): the lab's watch records, guard decisions on a planted NaN, state in checkpoints."""

from __future__ import annotations

import copy
import json

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from fw_tiny import converted, samples  # noqa: E402

import fp8lab  # noqa: E402
from fp8lab.integrations.lightning import FP8LabCallback  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(module, cb, steps, data, batch_size=2, ckpt_path=None, **kw):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], **kw)  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def _canon(rows):
    return json.dumps(rows, sort_keys=True, default=float)


def test_watch_records_equal_the_labs_for_the_same_model_and_batch():
    from fp8lab.step import TrainStep, WatchHook

    data = samples(1)
    model = converted()
    twin = copy.deepcopy(model)
    cb = FP8LabCallback(guard=None, watch_every=1)
    _fit(Lit(model), cb, 1, data, batch_size=1)
    watch = WatchHook(twin, 1)
    batch = {k: v[None] for k, v in data[0].items()}
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    TrainStep(lambda b: twin(**b)["loss"], opt, None, 0.0, [watch])(0, batch)
    assert watch.rows and _canon(cb.records) == _canon(watch.rows)


@pytest.mark.parametrize("policy", ["rollback", "skip"])
def test_a_planted_nan_is_rolled_back_or_skipped(policy):
    model = converted(nan_at=5)
    cb = FP8LabCallback(guard=fp8lab.AnomalyGuard(policy=policy, checkpoint_every=2))
    trainer = _fit(Lit(model), cb, 8, samples(32))
    assert trainer.global_step == 8
    assert [(e["action"], e["detector"], e["step"]) for e in cb.events] == [
        (policy, "nonfinite", 5)
    ]
    if policy == "rollback":
        assert cb.events[0]["to_step"] == 4
    assert cb.core.state.step == trainer.global_step == 8  # the guard counts as Lightning
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_watch_every_on_a_model_without_fp8lab_layers_warns():
    from fw_tiny import TinyLM

    with pytest.warns(UserWarning, match="watch_every=1 but the model has no fp8lab layers"):
        _fit(Lit(TinyLM()), FP8LabCallback(guard=None, watch_every=1), 1, samples(2))


def test_without_the_guard_the_nan_reaches_the_weights():
    model = converted(nan_at=5)
    _fit(Lit(model), FP8LabCallback(guard=None), 8, samples(32))
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_accumulation_checks_once_per_optimizer_step():
    model = converted()
    cb = FP8LabCallback(guard=fp8lab.AnomalyGuard(policy="off"))
    _fit(Lit(model), cb, 2, samples(16), accumulate_grad_batches=2)
    assert cb.core.session.monitor.loss_count == 2  # one check per optimizer step


def test_state_in_the_checkpoint_and_restored_by_ckpt_path(tmp_path):
    from fp8lab.nn.fp8_state import fp8_state_dict

    guard = fp8lab.AnomalyGuard(checkpoint_every=2)
    data = samples(32)
    model = converted(nan_at=3)
    cb = FP8LabCallback(guard=guard)
    trainer = _fit(Lit(model), cb, 4, data)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain tensors and data only
    (state,) = [v for k, v in ckpt["callbacks"].items() if "FP8LabCallback" in k]
    assert state["loop"]["guard_events"] == cb.events and len(cb.events) == 1
    saved = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if ".fp8_" in k}
    assert saved.keys() == fp8_state_dict(model).keys()

    fresh = converted()
    cb2 = FP8LabCallback(guard=guard)
    seen = {}
    orig = cb2.core.snapshot

    def spy():
        orig()
        seen.update(fp8_state_dict(fresh))
        seen["monitor"] = cb2.core.session.monitor.state_dict()
        seen["events"] = list(cb2.events)

    cb2.core.snapshot = spy
    _fit(Lit(fresh), cb2, 5, data, ckpt_path=str(path))
    assert seen["events"] == cb.events
    assert seen["monitor"] == cb.core.session.monitor.state_dict()
    assert all(torch.equal(seen[k], v) for k, v in saved.items())
