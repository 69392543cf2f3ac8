"""The parts of ``debug --from-checkpoint`` (issue 25): layer names across the lab's wrapper,
the start checkpoint made from a user's debug checkpoint, and a probe continuing from it."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.lab.debug.names import lab_prefix, to_lab_names, with_user_names
from fp8lab.lab.debug.runner import keep_same_numerics
from fp8lab.lab.debug.start import read_start
from fp8lab.lab.debug.variants import per_layer, with_cells_hp
from fp8lab.lab.parts import build_model
from fp8lab.lab.train import LabConfig
from fp8lab.recipe import LayerRule, get_recipe
from tiny_lab import tiny_lab_toml

MODEL = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, idx):
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(idx)))))


def tiny():
    return Tiny()
"""
LAB = ["model.fc1", "model.fc2"]


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "m.py").write_text(MODEL)
    (tmp_path / "t.txt").write_text("to be or not to be, that is the question. " * 40)
    toml = tmp_path / "lab.toml"
    toml.write_text(tiny_lab_toml(tmp_path / "t.txt", model={"factory": f"{tmp_path}/m.py:tiny"},
                                  steps=4, batch_size=2))  # fmt: skip
    cfg, _ = LabConfig.from_toml(toml)
    from fp8lab.lab.data import load_corpus

    return tmp_path, cfg, load_corpus(cfg.data, cfg.model.block_size)


def _user_model(cfg: LabConfig) -> torch.nn.Module:
    return build_model(cfg.model, None, cfg.train.seed).model  # the user's own module


def test_recipe_rules_in_the_users_names_reach_the_lab_model():
    rec = get_recipe("te-delayed").with_layers(LayerRule("fc2", base="bf16"))
    lab = to_lab_names(rec, "model.", LAB)
    assert lab.layers[0].match == ("fc2", "model.fc2")
    assert lab.for_layer("model.fc2").fingerprint() == rec.for_layer("fc2").fingerprint()
    assert lab.for_layer("model.fc1").fingerprint() == rec.for_layer("fc1").fingerprint()
    in_lab_names = get_recipe("te-delayed").with_layers(LayerRule("model.fc2", base="bf16"))
    assert to_lab_names(in_lab_names, "model.", LAB) is in_lab_names  # already fits: as is
    assert to_lab_names(rec, "", ["fc1", "fc2"]) is rec  # the built-in GPT: no wrapper


def test_fix_rules_name_the_users_layers_first_and_keep_every_layers_numerics():
    rec = get_recipe("te-delayed").with_layers(LayerRule("*fc*", changes={"input": {"margin": 1}}))
    remedy = per_layer(rec, ["model.fc2"], lambda r: with_cells_hp(r, [("wgrad", "input")],
                                                                   "bf16"), "fix")  # fmt: skip
    fix = with_user_names(remedy, rec, "model.")
    assert fix.layers[0] == rec.layers[0]  # R's own rule (a glob) untouched
    assert fix.layers[1].match == ("fc2", "model.fc2")
    for name in LAB:
        assert fix.for_layer(name).fingerprint() == remedy.for_layer(name).fingerprint()
    assert fix.for_layer("fc2").fingerprint() == remedy.for_layer("model.fc2").fingerprint()
    assert with_user_names(remedy, rec, "") is remedy


def test_start_checkpoint_takes_weights_moments_by_name_and_fp8_state(setup):
    d, cfg, corpus = setup
    user = _user_model(cfg)
    assert lab_prefix(build_model(cfg.model, None, 0)) == "model."
    fp8lab.nn.convert(user, "te-delayed")
    # the user's optimizer holds the parameters in another order than the lab's AdamW
    opt = torch.optim.AdamW(list(reversed(list(user.parameters()))), lr=1e-3)
    idx = torch.randint(0, 256, (2, 8))
    torch.nn.functional.cross_entropy(user(idx).flatten(0, 1), idx.flatten()).backward()
    opt.step()
    fp8lab.save_debug_checkpoint(user, opt, 7, d / "ck.pt")
    start = read_start(d / "ck.pt", cfg, corpus)
    assert start["loop"]["step"] == 0 and start["start"]["step"] == 7
    assert start["start"]["moments"] == "kept" and start["start"]["fp8_layers"] == LAB
    lab = build_model(cfg.model, get_recipe("te-delayed"), 0)
    lab_opt = fp8lab.lab.parts.make_optimizer(lab, None, cfg.train)
    lab_opt.load_state_dict(start["optimizer"])
    for name, p in lab.named_parameters():
        mine = user.get_parameter(name.removeprefix("model."))
        assert torch.equal(start["model"][name], mine.detach())
        assert torch.equal(lab_opt.state[p]["exp_avg"], opt.state[mine]["exp_avg"]), name
    # the same numerics keep the saved scaling state, other numerics start fresh
    assert keep_same_numerics(lab, start["model"]) == LAB
    assert float(lab.model.fc1.scaling_states["input"].scale) == float(
        user.fc1.scaling_states["input"].scale
    )
    other = build_model(cfg.model, get_recipe("te-current"), 0)
    assert keep_same_numerics(other, start["model"]) == []


def test_an_optimizer_without_adam_moments_starts_fresh(setup):
    d, cfg, corpus = setup
    user = _user_model(cfg)
    opt = torch.optim.SGD(user.parameters(), lr=0.1, momentum=0.9)
    user(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    fp8lab.save_debug_checkpoint(user, opt, 1, d / "sgd.pt")
    start = read_start(d / "sgd.pt", cfg, corpus)
    assert start["start"]["moments"] == "fresh" and start["optimizer"]["state"] == {}
    assert start["start"]["fp8_layers"] == []  # an unconverted model: no FP8 state


def test_save_debug_checkpoint_refuses_bad_arguments(tmp_path):
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"optimizer parameter 0 .* not a parameter of the model"):
        fp8lab.save_debug_checkpoint(m, opt, 0, tmp_path / "x.pt")
    good = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="is a directory"):
        fp8lab.save_debug_checkpoint(m, good, 0, tmp_path)
    with pytest.raises(ValueError, match="step must be an integer"):
        fp8lab.save_debug_checkpoint(m, good, -1, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
