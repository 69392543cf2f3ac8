"""The FP8 state file proves which weights it belongs to, and weights loaded without their FP8
state do not restart the scaling state silently (issue 32, part 6)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8lab.nn import (
    FP8_STATE_FILE,
    convert,
    delayed_states,
    fp8_state,
    load_fp8_state,
    save_fp8_state,
)

# which state file is applied to which weights (hashes, warnings): nothing the kernel choice or
# the instruction set could change, so the torch-kernel and AVX2 repeats leave it out
pytestmark = pytest.mark.no_arithmetic

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip


def _trained_dir(tmp_path, steps: int = 2):
    """A converted tiny Llama trained ``steps`` steps and saved with ``save_pretrained``."""
    torch.manual_seed(0)
    model = convert(transformers.LlamaForCausalLM(_config()), "te-delayed")
    idx = torch.randint(0, 256, (2, 16))
    for _ in range(steps):
        model(idx, labels=idx).loss.backward()
    d = tmp_path / "run"
    model.save_pretrained(d)
    return model, d


def _states(m) -> dict[str, dict[str, torch.Tensor]]:
    return {k: ds.state_dict() for k, ds in delayed_states(m).items()}


def _fresh(states) -> bool:
    return all(float(s["scale"]) == 1.0 and int(s["step"]) == 0 for s in states.values())


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][f], b[k][f]) for k in a for f in a[k]
    )  # fmt: skip


def test_the_file_records_the_weights_and_convert_restores_only_onto_them(tmp_path):
    model, d = _trained_dir(tmp_path)
    assert fp8_state.saved_weights_sha256(d) == fp8_state.weights_sha256(model)
    trained = _states(model)
    assert not _fresh(trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the matching weights: restored without a word
        resumed = convert(transformers.LlamaForCausalLM.from_pretrained(d), "te-delayed")
    assert _equal(_states(resumed), trained)


def test_a_random_model_built_from_the_config_does_not_get_the_trained_state(tmp_path):
    _, d = _trained_dir(tmp_path)
    torch.manual_seed(1)
    cfg = transformers.AutoConfig.from_pretrained(d)  # config.name_or_path is d
    fresh = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.warns(UserWarning, match=r"fp8lab_state\.safetensors was saved with other weights.*not applied"):  # fmt: skip
        convert(fresh, "te-delayed")
    assert _fresh(_states(fresh))


def test_a_stale_file_beside_newer_weights_is_not_applied(tmp_path):
    model, d = _trained_dir(tmp_path)
    stale = (d / FP8_STATE_FILE).read_bytes()
    idx = torch.randint(0, 256, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(idx, labels=idx).loss.backward()
    opt.step()
    model.save_pretrained(d)  # a converted model writes a new file: still restored
    assert fp8_state.saved_weights_sha256(d) == fp8_state.weights_sha256(model)
    (d / FP8_STATE_FILE).write_bytes(stale)  # the file of the older weights, as a plain
    # save_pretrained (an unconverted model's) leaves it
    loaded = transformers.LlamaForCausalLM.from_pretrained(d)
    with pytest.warns(UserWarning, match="saved with other weights"):
        convert(loaded, "te-delayed")
    assert _fresh(_states(loaded))
    with pytest.raises(ValueError, match=r"fp8lab_state\.safetensors was saved with other weights.*check_weights=False"):  # fmt: skip
        load_fp8_state(loaded, d)
    assert load_fp8_state(loaded, d, check_weights=False)  # the user's explicit choice
    assert not _fresh(_states(loaded))


def test_a_file_without_the_weights_hash_is_not_applied_by_convert(tmp_path):
    model, d = _trained_dir(tmp_path)
    from safetensors.torch import load_file, save_file

    old = load_file(str(d / FP8_STATE_FILE))
    save_file(old, str(d / FP8_STATE_FILE), metadata={"format": "fp8lab-state", "version": "1"})
    loaded = transformers.LlamaForCausalLM.from_pretrained(d)
    with pytest.warns(UserWarning, match="does not record which weights"):
        convert(loaded, "te-delayed")
    assert _fresh(_states(loaded))
    assert load_fp8_state(loaded, d)  # explicitly: not checked, loaded
    assert _equal(_states(loaded), _states(model))


def test_weights_sha256_tells_weights_apart():
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(_config())
    b = transformers.LlamaForCausalLM(_config())
    b.load_state_dict(a.state_dict())
    assert fp8_state.weights_sha256(a) == fp8_state.weights_sha256(b)
    assert fp8_state.weights_sha256(a) == fp8_state.weights_sha256(
        convert(b, "te-delayed")
    )  # shared Parameters
    with torch.no_grad():
        p = next(b.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1e9))  # one ulp
    assert fp8_state.weights_sha256(a) != fp8_state.weights_sha256(b)
    assert fp8_state.weights_sha256(a) != fp8_state.weights_sha256(a.to(torch.bfloat16).float())


def test_save_fp8_state_on_an_unconverted_model_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"no converted layer.*convert it first"):
        save_fp8_state(torch.nn.Sequential(torch.nn.Linear(4, 4)), tmp_path / "s.safetensors")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- a plain Trainer
def _resume_weights_only(d):
    """What the HF Trainer's ``resume_from_checkpoint`` does without fp8lab's callback: a
    converted fresh model, then ``load_state_dict`` of the checkpoint's weights file."""
    from safetensors.torch import load_file

    torch.manual_seed(3)
    model = convert(transformers.LlamaForCausalLM(_config()), "te-delayed")
    model.load_state_dict(load_file(str(d / "model.safetensors")), False)
    return model


def test_weights_loaded_without_their_fp8_state_warn_at_the_next_training_forward(tmp_path):
    _, d = _trained_dir(tmp_path)
    model = _resume_weights_only(d)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model.eval()
        model(idx)  # evaluation does not train on the lost state: no warning yet
    model.train()
    with pytest.warns(UserWarning, match=r"without the FP8 state.*model\.layers\.0\.mlp\.down_proj.*and 3 more.*load_fp8_state.*FP8LabCallback"):  # fmt: skip
        model(idx, labels=idx).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(idx, labels=idx).loss.backward()  # once


def test_loading_the_fp8_state_after_the_weights_is_silent_and_restores_it(tmp_path):
    trained, d = _trained_dir(tmp_path)
    model = _resume_weights_only(d)
    assert load_fp8_state(model, d)  # what the callback does at on_train_begin
    assert _equal(_states(model), _states(trained))
    idx = torch.randint(0, 256, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(idx, labels=idx).loss.backward()
    # a full state_dict (fp8_* included) never warns
    again = _resume_weights_only(d)
    again.load_state_dict(trained.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again(idx, labels=idx).loss.backward()


def test_a_plain_trainer_resume_warns(tmp_path):
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 256, (16,), generator=g)
            return {"input_ids": ids, "labels": ids}

    def trainer(max_steps: int):
        torch.manual_seed(0)
        model = convert(transformers.LlamaForCausalLM(_config()), "te-delayed")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2,
            save_steps=2, report_to=[], use_cpu=True, logging_strategy="no",
            save_strategy="steps", disable_tqdm=True,
        )  # fmt: skip
        return transformers.Trainer(model=model, args=args, train_dataset=Tokens())

    trainer(2).train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert (ckpt / FP8_STATE_FILE).is_file()
    with pytest.warns(UserWarning, match="without the FP8 state"):
        trainer(3).train(resume_from_checkpoint=str(ckpt))
