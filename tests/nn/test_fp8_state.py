"""Checkpoint hygiene (issue 25): a converted model's FP8 state beside its weights, convert
twice keeps or refuses, recipe files in convert."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.nn import (
    FP8_STATE_FILE,
    Linear,
    convert,
    delayed_states,
    load_fp8_state,
    save_fp8_state,
    unconvert,
)


class Net(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _trained(recipe: str = "te-delayed", steps: int = 2) -> Net:
    torch.manual_seed(0)
    m = convert(Net(), recipe)
    for _ in range(steps):
        m(torch.randn(8, 16) * 100).sum().backward()
    return m


def _scales(m: torch.nn.Module) -> dict[str, tuple[float, int]]:
    return {k: (float(ds.scale), int(ds.step)) for k, ds in delayed_states(m).items()}


def test_convert_again_same_recipe_keeps_the_state_other_recipe_refuses():
    m = _trained()
    before = _scales(m)
    states = delayed_states(m)
    assert any(s != 1.0 for s, _ in before.values()) and all(n == 2 for _, n in before.values())
    convert(m, "te-delayed")  # a resume script converting after loading: nothing resets
    assert _scales(m) == before
    assert all(delayed_states(m)[k] is v for k, v in states.items())  # the same objects
    with pytest.raises(ValueError, match=r"fc1 \('te-delayed'\).*retarget=True"):
        convert(m, "mxfp8")
    assert _scales(m) == before and m.fc1.recipe.name == "te-delayed"  # nothing changed
    convert(m, "te-current", retarget=True)
    assert m.fc1.recipe.name == "te-current" and delayed_states(m) == {}


def test_convert_on_a_submodule_keeps_state_of_same_numerics():
    torch.manual_seed(0)
    outer = torch.nn.Sequential(Net())
    convert(outer, "te-delayed")
    outer(torch.randn(4, 16)).sum().backward()
    before = _scales(outer)
    convert(outer[0], "te-delayed")  # new names ("fc1" for "0.fc1"), same numerics
    assert outer[0].fc1.name == "fc1"
    assert _scales(outer) == before


def test_convert_accepts_a_recipe_file(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('base = "te-delayed"\nname = "mine"\n[[layer]]\nmatch = "fc2"\nbase = "bf16"\n')
    m = convert(Net(), str(f))
    assert m.fc1.recipe.fingerprint() == fp8lab.get_recipe("te-delayed").fingerprint()
    assert m.fc2.recipe.fingerprint() != m.fc1.recipe.fingerprint()
    with pytest.raises(ValueError, match="no such recipe file"):
        convert(Net(), str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "te-delayed"\n[[layer]]\nmatch = "nothing*"\nbase = "bf16"\n')
    with pytest.raises(ValueError, match=r"bad\.toml"):
        convert(Net(), str(bad))


def test_save_and_load_fp8_state_round_trip_and_bad_input(tmp_path):
    m = _trained()
    path = save_fp8_state(m, tmp_path)
    assert path == tmp_path / FP8_STATE_FILE
    from safetensors.torch import load_file

    saved = load_file(str(path))
    assert saved and all(k.rpartition(".")[2].startswith("fp8_") for k in saved)
    torch.manual_seed(0)  # the same weights as m's
    fresh = convert(Net(), "te-delayed")
    assert load_fp8_state(fresh, tmp_path) == ["fc1", "fc2"]
    assert _scales(fresh) == _scales(m)
    # bit for bit: the same next forward and update from the restored state
    x = torch.randn(8, 16) * 3
    for model in (m, fresh):
        model(x).sum().backward()
    assert _scales(fresh) == _scales(m)

    other = convert(Net(), "te-delayed", include="fc1")  # other weights: not checked here
    with pytest.raises(ValueError, match=r"fp8lab_state.safetensors.*not converted \['fc2'\]"):
        load_fp8_state(other, path, check_weights=False)
    assert load_fp8_state(other, path, strict=False, check_weights=False) == ["fc1"]
    with pytest.raises(ValueError, match="saved under another recipe"):
        load_fp8_state(convert(Net(), "mxfp8"), path, check_weights=False)
    with pytest.raises(ValueError, match="no such FP8 state file"):
        load_fp8_state(fresh, tmp_path / "none.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"junk\.safetensors: not a readable FP8 state file"):
        load_fp8_state(fresh, junk)


def test_lab_state_dict_still_holds_the_fp8_state():
    # the lab's checkpoints and bit-identical resume read the module state_dict
    sd = _trained().state_dict()
    assert "fc1.fp8_recipe" in sd and "fc1.fp8_input_scale" in sd


# ----------------------------------------------------------------------------- transformers
def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM, transformers.LlamaForCausalLM(cfg)


def test_save_pretrained_loads_into_the_unconverted_model_and_restores_on_convert(tmp_path):
    cls, model = _llama()
    convert(model, "te-delayed")
    idx = torch.randint(0, 256, (2, 16))
    model(idx, labels=idx).loss.backward()
    n_fp8 = sum(k.rpartition(".")[2].startswith("fp8_") for k in model.state_dict())
    assert n_fp8 == 224  # the count: none of them may reach model.safetensors
    model.save_pretrained(tmp_path)
    assert (tmp_path / FP8_STATE_FILE).is_file()
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert not any("fp8_" in k for k in weights)

    plain, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(isinstance(m, Linear) for m in plain.modules())
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    for k, v in model.state_dict().items():
        if "fp8_" not in k:
            assert torch.equal(plain.state_dict()[k], v), k

    before = {k: ds.state_dict() for k, ds in delayed_states(model).items()}
    assert any(float(s["scale"]) != 1.0 for s in before.values())
    convert(plain, "te-delayed")  # the resume script: from_pretrained, then convert
    after = {k: ds.state_dict() for k, ds in delayed_states(plain).items()}
    assert before.keys() == after.keys()
    for k in before:
        for f in before[k]:
            assert torch.equal(before[k][f], after[k][f]), (k, f)

    with pytest.raises(ValueError, match=r"fp8lab_state.safetensors.*retarget=True"):
        convert(cls.from_pretrained(tmp_path), "mxfp8")
    # converting in parts (one call per part) takes each part's saved state
    parts = cls.from_pretrained(tmp_path)
    convert(parts, "te-delayed", include="*self_attn*")
    convert(parts, "te-delayed", include="*mlp*")
    assert {k: ds.state_dict()["scale"] for k, ds in delayed_states(parts).items()} == {
        k: s["scale"] for k, s in before.items()
    }
    more = cls.from_pretrained(tmp_path)  # more layers than were saved: the file is named
    with pytest.raises(ValueError, match=r"no FP8 state for the layers \['lm_head'\]"):
        convert(more, "te-delayed", default_exclude=False)
    assert fp8lab.nn.converted(more) == []  # the failed call changed nothing
    fresh = convert(cls.from_pretrained(tmp_path), "mxfp8", retarget=True)
    assert all(isinstance(fresh.get_submodule(n), Linear) for n in fp8lab.nn.converted(fresh))


def test_unconvert_gives_back_transformers_save_pretrained(tmp_path):
    _, model = _llama()
    convert(model, "te-current")
    assert "save_pretrained" in model.__dict__
    unconvert(model)
    assert "save_pretrained" not in model.__dict__
    model.save_pretrained(tmp_path)
    assert not (tmp_path / FP8_STATE_FILE).exists()
