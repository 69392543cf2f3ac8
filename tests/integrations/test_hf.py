"""fp8lab.integrations.hf.FP8LabCallback under the real transformers Trainer (CPU, tiny model):
the lab's watch records, guard decisions on a planted NaN, FP8 state in Trainer checkpoints."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("accelerate")  # the Trainer needs it (fp8lab[hf])
transformers = pytest.importorskip("transformers")

from fw_tiny import converted, samples  # noqa: E402

import fp8lab  # noqa: E402
from fp8lab.integrations.hf import FP8LabCallback  # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, learning_rate=1e-2,
                max_steps=8, use_cpu=True, report_to="none", save_strategy="no",
                logging_strategy="no", dataloader_num_workers=0, seed=0, max_grad_norm=0.0,
                disable_tqdm=True)  # fmt: skip
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _train(model, cb, tmp_path, data, resume=None, **kw):
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, **kw), train_dataset=data,
                                   callbacks=[cb])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _canon(rows):
    return json.dumps(rows, sort_keys=True, default=float)  # NaN/inf compare as text


def test_watch_records_equal_the_labs_for_the_same_model_and_batch(tmp_path):
    from fp8lab.step import TrainStep, WatchHook

    data = samples(1)
    model = converted()
    twin = copy.deepcopy(model)
    cb = FP8LabCallback(guard=None, watch_every=1)
    _train(model, cb, tmp_path, data, max_steps=1, per_device_train_batch_size=1)
    # the lab's step on the same weights and batch
    watch = WatchHook(twin, 1)
    batch = {k: v[None] for k, v in data[0].items()}
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    TrainStep(lambda b: twin(**b)["loss"], opt, None, 0.0, [watch])(0, batch)
    assert watch.rows and {r["layer"] for r in watch.rows} == {"up", "down", "head"}
    assert _canon(cb.records) == _canon(watch.rows)


class LearningRates(transformers.TrainerCallback):
    """The learning rate each optimizer step uses."""

    def __init__(self):
        self.lrs = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _train_lrs(model, cb, tmp_path, data, **kw):
    lrs = LearningRates()
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, **kw), train_dataset=data,
                                   callbacks=[cb, lrs])  # fmt: skip
    trainer.train()
    return trainer, lrs.lrs


@pytest.mark.parametrize("policy", ["rollback", "skip"])
def test_a_planted_nan_is_rolled_back_or_skipped(tmp_path, policy):
    """The guard acts on the NaN; its step count is the Trainer's global_step, a rollback
    leaves the learning-rate schedule as the Trainer runs it (the linear decay ends at 0, as
    in a run without the fault), and the event is in the Trainer's log history."""
    model = converted(nan_at=5)
    guard = fp8lab.AnomalyGuard(policy=policy, checkpoint_every=2)
    cb = FP8LabCallback(guard=guard)
    trainer, lrs = _train_lrs(model, cb, tmp_path, samples(32))
    assert trainer.state.global_step == 8
    assert [(e["action"], e["detector"], e["step"]) for e in cb.events] == [
        (policy, "nonfinite", 5)
    ]
    if policy == "rollback":
        assert cb.events[0]["to_step"] == 4
    assert cb.core.state.step == trainer.state.global_step == 8
    # the Trainer's linear decay from 1e-2 (LambdaLR: base_lr * (8 - k) / 8) at every step k
    assert lrs == [1e-2 * ((8 - k) / 8) for k in range(8)]
    assert set(trainer.lr_scheduler.get_last_lr()) == {0.0}  # the linear decay ended
    logged = [h for h in trainer.state.log_history if "fp8lab_guard" in h]
    assert logged == [{"fp8lab_guard": cb.events[0], "step": 6}]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    states = fp8lab.nn.delayed_states(model)
    assert states and all(torch.isfinite(ds.state.amax_history).all() for ds in states.values())


def test_a_gradient_spike_is_seen_before_the_trainers_clipping(tmp_path):
    """max_grad_norm=1 clips the 2^40 spike before on_pre_optimizer_step; the guard's norm is
    taken before clipping (as in the lab), so grad_norm_zscore fires."""
    model = converted(spike_at=9)
    guard = fp8lab.AnomalyGuard(
        checkpoint_every=2, detectors={"grad_norm_zscore": {"min_samples": 4}}
    )
    cb = FP8LabCallback(guard=guard)
    _train(model, cb, tmp_path, samples(32), max_steps=12, max_grad_norm=1.0)
    assert [(e["action"], e["detector"], e["step"]) for e in cb.events] == [
        ("rollback", "grad_norm_zscore", 9)
    ]
    assert cb.events[0]["value"] > 10


def test_without_the_guard_the_nan_reaches_the_weights(tmp_path):
    """The control of the test above: the planted NaN does damage when nobody acts."""
    model = converted(nan_at=5)
    _train(model, FP8LabCallback(guard=None), tmp_path, samples(32))
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_fp8_state_saved_with_checkpoints_and_restored_on_resume(tmp_path):
    from safetensors.torch import load_file

    from fp8lab.nn import FP8_STATE_FILE
    from fp8lab.nn.fp8_state import fp8_state_dict

    guard = fp8lab.AnomalyGuard(checkpoint_every=2)
    data = samples(32)
    model = converted()
    cb = FP8LabCallback(guard=guard)
    _train(model, cb, tmp_path, data, max_steps=4, save_strategy="steps", save_steps=2)
    ckpt = tmp_path / "out" / "checkpoint-2"
    saved = load_file(str(ckpt / FP8_STATE_FILE))  # plain tensors (safetensors)
    assert saved and any(k.endswith("fp8_recipe") for k in saved)
    guard_state = json.loads((ckpt / "fp8lab_guard.json").read_text())
    assert guard_state["loop"]["step"] == 2 and guard_state["guard_config"] == guard.to_dict()

    # resume from checkpoint-2 in a fresh model whose scaling state is reset
    fresh = converted()
    cb2 = FP8LabCallback(guard=guard)
    seen = {}
    orig = cb2.core.resume

    def spy(where):
        orig(where)
        seen.update({k: v.clone() for k, v in fp8_state_dict(fresh).items()})

    cb2.core.resume = spy
    _train(fresh, cb2, tmp_path, data, resume=str(ckpt), max_steps=4, save_strategy="steps",
           save_steps=2)  # fmt: skip
    assert seen.keys() == saved.keys()
    assert all(torch.equal(seen[k], saved[k]) for k in saved)
    assert cb2.core.session.monitor.state_dict()["loss_count"] == 4
    # the resumed run ends where the uninterrupted one did
    end = fp8_state_dict(model)
    assert all(torch.equal(v, fp8_state_dict(fresh)[k]) for k, v in end.items())
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_resume_from_a_checkpoint_outside_output_dir_restores_the_fp8_and_guard_state(
    tmp_path, recwarn
):
    """``trainer.train(resume_from_checkpoint=PATH)`` with PATH anywhere (HF's standard way):
    the callback restores the FP8 and guard state from PATH, not from the TrainingArguments
    field (unset here) or output_dir (which holds no checkpoint)."""
    import shutil

    from fp8lab.nn.fp8_state import fp8_state_dict

    guard = fp8lab.AnomalyGuard(checkpoint_every=2)
    data = samples(32)
    model = converted()
    _train(model, FP8LabCallback(guard=guard), tmp_path / "a", data, max_steps=4,
           save_strategy="steps", save_steps=2)  # fmt: skip
    moved = tmp_path / "elsewhere" / "ckpt"
    shutil.move(tmp_path / "a" / "out" / "checkpoint-2", moved)
    shutil.rmtree(tmp_path / "a")
    fresh = converted()
    cb = FP8LabCallback(guard=guard)
    _train(fresh, cb, tmp_path / "b", data, resume=str(moved), max_steps=4)
    assert not [w for w in recwarn if "fp8lab" in str(w.message)]
    assert cb.core.session.monitor.state_dict()["loss_count"] == 4
    end = fp8_state_dict(model)
    assert end and all(torch.equal(v, fp8_state_dict(fresh)[k]) for k, v in end.items())
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_watch_every_on_a_model_without_fp8lab_layers_warns(tmp_path):
    from fw_tiny import TinyLM

    with pytest.warns(UserWarning, match="watch_every=1 but the model has no fp8lab layers"):
        _train(TinyLM(), FP8LabCallback(guard=None, watch_every=1), tmp_path, samples(2),
               max_steps=1)  # fmt: skip


def test_a_loss_outside_the_model_output_is_a_clear_error(tmp_path):
    """The callback reads the loss from the model's output; a compute_loss_func computes it
    outside, where a callback cannot see it."""
    model = converted()

    def loss_func(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten())

    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, labels=None):
            return {"logits": self.inner(input_ids)["logits"]}

    trainer = transformers.Trainer(model=LogitsOnly(), args=_args(tmp_path, max_steps=1),
                                   train_dataset=samples(4), callbacks=[FP8LabCallback()],
                                   compute_loss_func=loss_func)  # fmt: skip
    with pytest.raises(RuntimeError, match="no training loss was seen"):
        trainer.train()


def test_a_tuple_output_gives_its_first_element_as_the_loss(tmp_path):
    class TupleOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = converted()

        def forward(self, input_ids, labels=None):
            out = self.inner(input_ids, labels)
            return (out["loss"], out["logits"])

    cb = FP8LabCallback(guard=fp8lab.AnomalyGuard(policy="off"))
    _train(TupleOut(), cb, tmp_path, samples(4), max_steps=2)
    assert cb.core.session.monitor.loss_count == 2


def test_bad_arguments_and_files_are_named(tmp_path):
    from fp8lab.integrations._core import GUARD_FILE

    with pytest.raises(TypeError, match=r"guard must be an fp8lab\.AnomalyGuard"):
        FP8LabCallback(guard="rollback")
    with pytest.raises(ValueError, match="watch_every must be an integer >= 0"):
        FP8LabCallback(watch_every=-1)
    cb = FP8LabCallback()
    (tmp_path / GUARD_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{GUARD_FILE}: not an fp8lab guard state"):
        cb.core.load(tmp_path)
    assert not cb.core.load(tmp_path / "empty-dir")  # nothing there: nothing restored
    with pytest.warns(UserWarning, match="holds no fp8lab state"):
        cb.core.resume(tmp_path / "empty-dir")
