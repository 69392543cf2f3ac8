"""Activation recompute (issue 32, part 2): under ``torch.utils.checkpoint`` (non-reentrant and
reentrant) a checkpointed model trains bit for bit as the same model without checkpointing, for
every preset; the amax histories roll once per step; the tensors a Linear keeps for its
backward are saved tensors, so checkpointing frees them; HF's gradient checkpointing works on a
converted model."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import fp8lab
from fp8lab.nn import convert, delayed_states, on_operand
from fp8lab.qtensor import QTensor
from fp8lab.recipe import get_recipe

MODES = ("non-reentrant", "reentrant")
D, T, STEPS = 32, 32, 2  # tiny (T: a multiple of the 32-token Hadamard blocks of mxfp4-quartet)
# the autocast variant of every preset runs in make test-slow; these in make test too
AUTOCAST_FAST = ("te-delayed", "hif8-delayed", "deepseek-v3", "nvfp4")


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts/recompute_memory.py"
    spec = importlib.util.spec_from_file_location("recompute_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_MEMORY = _script()  # the stack, the saved-bytes counter and the docs' measurement
Stack, saved_bytes = _MEMORY.Stack, _MEMORY.saved_bytes


def _train(recipe, mode, *, under_autocast=False, steps=STEPS, preserve_rng=True):
    """Weights, gradients of the last step and delayed-scaling states after ``steps`` SGD steps
    of a converted `Stack` (under ``fp8lab.nn.autocast(recipe)`` around an fp32-converted
    stack when ``under_autocast``)."""
    torch.manual_seed(0)
    net = Stack(D, 1, mode, **({} if preserve_rng else {"preserve_rng_state": False}))
    net = convert(net, "fp32" if under_autocast else recipe, default_exclude=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    grads = {}
    for _ in range(steps):
        x = torch.randn(T, D, generator=gen, requires_grad=True)
        if under_autocast:
            with fp8lab.nn.autocast(recipe):
                y = net(x)
        else:
            y = net(x)
        y.square().mean().backward()
        grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        grads["x"] = x.grad.clone()
        opt.step()
        opt.zero_grad()
    states = {k: ds.state_dict() for k, ds in delayed_states(net).items()}
    return net.state_dict(), grads, states


@functools.cache
def _plain(recipe: str, under_autocast: bool = False):
    return _train(recipe, None, under_autocast=under_autocast)


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            if isinstance(w[k], dict):
                for f in w[k]:
                    assert torch.equal(g[k][f], w[k][f]), (k, f)
            else:
                assert torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", fp8lab.recipes())
def test_checkpointed_training_is_bit_identical(recipe: str, mode: str) -> None:
    _assert_same(_train(recipe, mode), _plain(recipe))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=() if r in AUTOCAST_FAST else pytest.mark.slow)
        for r in fp8lab.recipes()
    ],
)
def test_recompute_runs_the_autocast_recipe_of_the_first_forward(recipe: str, mode: str) -> None:
    # the backward (and its recompute) runs outside fp8lab.nn.autocast: the recompute must
    # still quantize under the recipe the first forward ran under, with its states
    _assert_same(_train(recipe, mode, under_autocast=True), _plain(recipe, True))


@pytest.mark.parametrize("mode", MODES)
def test_amax_history_rolls_once_per_step(mode: str) -> None:
    _, _, states = _train("te-delayed", mode)
    forward = {k: s for k, s in states.items() if k.endswith((".input", ".weight"))}
    assert len(forward) == 4  # 2 layers x (input, weight)
    for k, s in forward.items():
        assert int(s["step"]) == STEPS, k
        assert int((s["amax_history"] != 0).sum()) == STEPS, k  # staging slot empty


@pytest.mark.parametrize("mode", MODES)
def test_recompute_draws_the_same_random_bits(mode: str) -> None:
    # stochastic rounding in the forward, and torch's checkpoint told not to restore the
    # generator: the recompute replays the first forward's bits and leaves the stream alone
    base = get_recipe("te-current")
    sr = dataclasses.replace(base.input, rounding="stochastic")
    recipe = base.replace(name="sr-forward", input=sr, weight=sr)
    want = _train(recipe, None)
    _assert_same(_train(recipe, mode, preserve_rng=False), want)
    _assert_same(_train(recipe, mode), want)


@pytest.mark.parametrize("mode", MODES)
def test_observers_see_each_operand_once(mode: str) -> None:
    def count(mode):
        seen: list[tuple[str, str, str]] = []
        with on_operand(lambda layer, gemm, role, source, used: seen.append((gemm, role))):
            out = _train("te-delayed", mode, steps=2)
        return sorted(seen), out

    want_seen, want = count(None)
    got_seen, got = count(mode)
    assert got_seen == want_seen
    _assert_same(got, want)


def test_a_checkpointed_forward_without_backward_leaves_nothing_behind() -> None:
    torch.manual_seed(0)
    net = convert(Stack(D, 2, "non-reentrant"), "te-delayed", default_exclude=False)
    net(torch.randn(T, D, requires_grad=True))  # graph dropped: its recompute never comes
    assert all(r() is None for m in net.modules() for r in getattr(m, "_replays", ()))


def _is_kept(v) -> bool:
    if isinstance(v, (torch.Tensor, QTensor)):
        return True
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return any(_is_kept(getattr(v, f.name)) for f in dataclasses.fields(v))
    return isinstance(v, (list, tuple)) and any(_is_kept(e) for e in v)


@pytest.mark.parametrize("recipe", ["te-delayed", "deepseek-v3", "mxfp8"])
def test_the_linear_keeps_its_operands_as_saved_tensors(recipe: str) -> None:
    lin = fp8lab.nn.Linear(D, D, recipe=recipe)
    y = lin(torch.randn(T, D, requires_grad=True))
    node = y.grad_fn
    assert node.saved_tensors, "nothing saved for the backward"
    held = [k for k, v in vars(node).items() if k != "held" and _is_kept(v)]
    assert held == [], f"tensors kept on ctx, out of reach of saved-tensor hooks: {held}"


@pytest.mark.parametrize("recipe", ["fp32", "te-delayed", "deepseek-v3", "mxfp8"])
def test_checkpointing_frees_the_kept_operands(recipe: str) -> None:
    plain = saved_bytes(recipe, None, D, T)
    # per block (float32 values): each Linear's input ([T, D], [T, 2D]; quantized or not) and
    # GELU's input [T, 2D]; the quantized copies of the weights [2D, D] and [D, 2D] when kept
    r = get_recipe(recipe)
    weights = r.weight is not None and r.save_for_backward == "quantized"
    want = 4 * 2 * (T * D + 2 * T * 2 * D + (2 * 2 * D * D if weights else 0))
    assert plain >= want, (plain, want)
    for mode in MODES:
        kept = saved_bytes(recipe, mode, D, T)
        assert kept <= 4 * 2 * T * D, (mode, kept, plain)  # the blocks' inputs, nothing more


# ----------------------------------------------------------------- Hugging Face models
transformers = pytest.importorskip("transformers")
LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip


def _hf_train(recipe: str, enable: dict | None, steps: int = 2):
    torch.manual_seed(0)
    model = convert(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), recipe)
    model.train()
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_*
            model.gradient_checkpointing_enable(**enable)
        assert model.is_gradient_checkpointing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        loss = model(idx, labels=idx).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    states = {k: ds.state_dict() for k, ds in delayed_states(model).items()}
    return {"loss": torch.stack(losses)}, model.state_dict(), states


@pytest.mark.parametrize(
    "enable",
    [
        pytest.param({}, id="default"),
        pytest.param(
            {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
            id="reentrant",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_hf_gradient_checkpointing_on_a_converted_model(enable: dict) -> None:
    _assert_same(_hf_train("te-delayed", enable), _hf_train("te-delayed", None))
