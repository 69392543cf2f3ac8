"""Device-correct code paths, checked on the CPU (issue 32, part 3).

No CUDA device runs these tests, so two CPU stand-ins catch what would stop or slow a GPU run,
both under the device-generic torch kernels (``FP8LAB_KERNELS=torch``, what a CUDA tensor gets):

(a) ``torch.set_default_device("meta")`` around one `fp8lab.nn.Linear` forward and backward on
    CPU tensors: every tensor fp8lab makes without naming a device lands on ``meta`` and meets a
    CPU operand ("tensors on different devices (cpu and meta)"), as a CPU-made buffer would meet
    a CUDA operand;
(b) one lab training step (`fp8lab.lab.train.train_run`, evaluation and operand statistics
    included) under a `TorchFunctionMode` that records every tensor factory called from a frame
    in ``src/fp8lab`` without an explicit ``device=`` (torch's own code is exempt: only the
    calling frame's file counts). Such a tensor is made on the process's default device, which
    is not the operand's on a GPU (or is, under ``torch.set_default_device("cuda")``, where a
    CPU generator or a numpy view then fails).

The ``meta`` device cannot stand in for a whole training step itself (autocast has no meta
backend, ``.item()`` has no data): docs/gpu.md lists what these tests cannot show.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import fp8lab
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.nn import Linear
from fp8lab.recipe import get_recipe, recipes

# every test here runs the torch kernels itself (fp8lab.using_kernels('torch')) and checks where
# tensors are made, not their bits: the torch-kernel and AVX2 repeats would run it again as is
pytestmark = pytest.mark.no_arithmetic

SRC = str(Path(fp8lab.__file__).resolve().parent)

#: the factories that take ``device=`` and otherwise use the default device (torch's own list,
#: the one `torch.set_default_device` patches); ``*_like`` and ``Tensor.new_*`` follow their input
FACTORIES = frozenset(_device_constructors())
#: these keep a tensor argument's device; only other data (a float, a list, numpy) is a factory
CONVERTERS = frozenset({torch.as_tensor, torch.asarray})


class ImplicitDevice(TorchFunctionMode):
    """Records ``file:line torch.name`` for every factory called from ``src/fp8lab`` without a
    ``device=`` (or with ``device=None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func in FACTORIES
            and kwargs.get("device") is None
            and not (func in CONVERTERS and args and isinstance(args[0], torch.Tensor))
        ):
            frame = sys._getframe(1)  # the factory's caller (a C function has no frame)
            code = frame.f_code
            if code.co_filename.startswith(SRC):
                where = f"{code.co_filename[len(SRC) + 1 :]}:{frame.f_lineno}"
                self.found.append(f"{where} torch.{func.__name__} ({code.co_name})")
        return func(*args, **kwargs)


def test_the_checker_records_fp8lab_frames_only() -> None:
    """The checker itself: a frame of src/fp8lab without ``device=`` is recorded; torch's own
    code, this file and an explicit device are not."""
    in_src = compile("import torch\ntorch.zeros(1)\ntorch.zeros(1, device='cpu')\n",
                     f"{SRC}/fake_module.py", "exec")  # fmt: skip
    with ImplicitDevice() as mode:
        torch.zeros(3)  # this file
        torch.nn.Linear(2, 2)  # torch's own code (its init makes tensors without a device)
        torch.as_tensor(torch.ones(1))  # keeps its argument's device
        exec(in_src, {})
    assert mode.found == ["fake_module.py:2 torch.zeros (<module>)"]


# ---------------------------------------------------------------------- (a) default device meta
@pytest.mark.parametrize("name", recipes())
def test_linear_on_cpu_under_default_device_meta(name: str) -> None:
    """One forward and backward of every preset on CPU tensors while the default device is
    ``meta``: every tensor fp8lab makes for an operand follows the operand's device."""
    torch.manual_seed(0)
    lin = Linear(64, 32, recipe=name, device="cpu")
    x = torch.randn(32, 64, device="cpu", requires_grad=True)  # 32: Hadamard blocks
    with fp8lab.using_kernels("torch"), torch.device("meta"):
        y = lin(x)
        y.backward(torch.ones_like(y))
        y2 = lin(x)  # a second step: delayed scales updated, pooled buffers reused
        y2.backward(torch.ones_like(y2))
    for t in (y, y2, x.grad, lin.weight.grad):
        assert t.device.type == "cpu" and bool(torch.isfinite(t).all())
    assert all(p.device.type == "cpu" for p in lin.parameters())


def test_scaling_state_starts_on_the_weights_device() -> None:
    """A converted layer's delayed-scaling state (its own recipe's, and an autocast override's
    made during a forward) is made on its weight's device, not the default device's."""
    lin = Linear(8, 8, recipe="te-delayed", device="meta")
    other = lin._state_for(get_recipe("hif8-delayed"))  # what autocast("hif8-delayed") makes
    states = [*lin.scaling_states.values(), *other.by_key.values()]
    assert len(states) == 6
    assert all(t.is_meta for ds in states for t in ds.state.tensors().values())


# ---------------------------------------------------------------------- (b) one lab step
TINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(
        steps=1, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=1, eval_batches=1,
        stats_every=1,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Any:
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("Now is the winter of our discontent made glorious summer. " * 80)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


@pytest.mark.parametrize("name", recipes())
def test_lab_step_names_every_device(name: str, corpus: Any) -> None:
    """One lab step of every preset (forward, backward, clipping, optimizer, evaluation, the
    operand statistics): no tensor factory in ``src/fp8lab`` relies on the default device."""
    with fp8lab.using_kernels("torch"), ImplicitDevice() as mode:
        result = train_run(get_recipe(name), TINY, corpus)
    assert mode.found == [], "\n".join(sorted(set(mode.found)))
    assert result.records and result.records[-1]["step"] == 1
