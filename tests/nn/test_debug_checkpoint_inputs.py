"""save_debug_checkpoint refuses at save time what fp8lab debug could not read back (issue 32,
part 6): NumPy arrays or other objects in ``extra`` (named by key), a model that is not a
Module, an optimizer that is not one."""

from __future__ import annotations

import collections
import enum

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.nn import convert, read_debug_checkpoint, save_debug_checkpoint
from fp8lab.optim import AdamW


class Custom:
    pass


class Colour(enum.IntEnum):
    RED = 1


def _model_opt(opt_cls=torch.optim.AdamW):
    torch.manual_seed(0)
    model = convert(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), "te-delayed")
    opt = opt_cls(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize(
    ("extra", "key", "kind"),
    [
        ({"a": np.zeros(3)}, "extra['a']", "numpy.ndarray"),
        ({"a": [1, {"b": Custom()}]}, "extra['a'][1]['b']", "Custom"),
        ({"lr": np.float64(1e-3)}, "extra['lr']", "numpy.float64"),  # a float subclass
        ({"c": Colour.RED}, "extra['c']", "Colour"),  # an int subclass
        ({"d": collections.defaultdict(int)}, "extra['d']", "defaultdict"),
        ({Colour.RED: 3}, "a key of extra (<Colour.RED: 1>)", "Colour"),
    ],
)
def test_extra_that_a_weights_only_load_refuses_is_refused_when_saving(tmp_path, extra, key, kind):
    model, opt = _model_opt()
    path = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match="save_debug_checkpoint") as info:
        save_debug_checkpoint(model, opt, 3, path, extra=extra)
    assert key in str(info.value) and kind in str(info.value)
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing written


def test_plain_extra_round_trips_through_the_debuggers_reader(tmp_path):
    model, opt = _model_opt(AdamW)  # fp8lab's AdamW: its state is plain too
    extra = {
        "run": "x", "lr": 1e-3, "n": 3, "ok": True, "none": None, "t": torch.ones(2),
        "nested": {"a": [1, 2.5, ("s", torch.zeros(1))]}, "od": collections.OrderedDict(a=1),
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), (1, "k"): "tuple key",
    }  # fmt: skip
    path = save_debug_checkpoint(model, opt, 3, tmp_path / "ckpt.pt", extra=extra)
    back = read_debug_checkpoint(path)["extra"]
    assert back.keys() == extra.keys() and back["nested"]["a"][:2] == [1, 2.5]
    assert torch.equal(back["t"], extra["t"]) and back["size"] == torch.Size([2, 3])


@pytest.mark.parametrize(
    ("model", "optimizer", "words"),
    [
        ("my-model", "OPT", "model must be a torch.nn.Module, got str"),
        (None, "OPT", "model must be a torch.nn.Module, got NoneType"),
        ("MODEL", None, "optimizer must be a torch.optim.Optimizer (the one training model, for its moments), got NoneType"),
        ("MODEL", "adamw", "optimizer must be a torch.optim.Optimizer"),
    ],
)  # fmt: skip
def test_a_model_or_optimizer_of_the_wrong_type_is_a_clear_type_error(
    tmp_path, model, optimizer, words
):
    m, o = _model_opt()
    model = m if model == "MODEL" else model
    optimizer = o if optimizer == "OPT" else optimizer
    with pytest.raises(TypeError) as info:
        save_debug_checkpoint(model, optimizer, 1, tmp_path / "c.pt")
    assert words in str(info.value)
    with pytest.raises(TypeError, match="extra must be a dict, got list"):
        save_debug_checkpoint(m, o, 1, tmp_path / "c.pt", extra=[1])
    assert fp8lab.save_debug_checkpoint is save_debug_checkpoint
