"""accelerate's mixed_precision="fp8" on a model fp8lab converted: a real Accelerator on the CPU
swaps fp8lab layers for torchao's Float8Linear in prepare; fp8lab refuses it with a message
saying what to use instead."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("torchao.float8")

from fw_tiny import converted  # noqa: E402

from fp8lab.integrations import check_prepared  # noqa: E402
from fp8lab.integrations.accelerate import foreign_fp8_layers  # noqa: E402


@pytest.fixture
def fresh_state():
    """Accelerator state is a per-process singleton: start and leave it clean."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _model():
    m = converted()
    m.mid = torch.nn.Linear(32, 32)  # a 5th Linear, so accelerate's filter keeps 2 of them
    import fp8lab

    return fp8lab.nn.convert(m, "te-delayed", default_exclude=False)


def _names(m):
    from fp8lab.nn import converted as names

    return names(m)


def test_fp8_prepare_replaces_fp8lab_layers_and_is_refused(fresh_state):
    model = _model()
    before = _names(model)
    acc = accelerate.Accelerator(mixed_precision="fp8", cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, _ = acc.prepare(model, opt)
    foreign = foreign_fp8_layers(prepared)
    assert foreign and set(foreign.values()) == {"torchao"}  # the documented takeover
    with pytest.raises(RuntimeError) as err:
        check_prepared(prepared, before)
    msg = str(err.value)
    for part in ("fp8lab layers were replaced", "torchao", "Transformer Engine", "MS-AMP",
                 "mixed_precision='bf16'", "fp8lab.nn.convert"):  # fmt: skip
        assert part in msg


def test_the_hf_callback_refuses_it_at_train_begin(fresh_state):
    from fp8lab.integrations.hf import FP8LabCallback

    model = _model()
    cb = FP8LabCallback()
    cb.on_init_end(None, None, None, model=model)  # the Trainer's init, before prepare
    acc = accelerate.Accelerator(mixed_precision="fp8", cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, opt = acc.prepare(model, opt)
    with pytest.raises(RuntimeError, match="accelerate's FP8 mode took it over"):
        cb.on_train_begin(None, _State(), None, model=prepared, optimizer=opt)


class _State:
    global_step = 0


@pytest.mark.parametrize("mp", ["no", "bf16"])
def test_bf16_or_no_is_accepted(fresh_state, mp):
    model = _model()
    before = _names(model)
    acc = accelerate.Accelerator(mixed_precision=mp, cpu=True)
    prepared, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    check_prepared(prepared, before)
    assert _names(prepared) == before


def test_a_model_fp8lab_never_converted_is_not_its_business(fresh_state):
    from fw_tiny import TinyLM

    acc = accelerate.Accelerator(mixed_precision="fp8", cpu=True)
    m = TinyLM()
    m.mid = torch.nn.Linear(32, 32)
    prepared, _ = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    check_prepared(prepared)
