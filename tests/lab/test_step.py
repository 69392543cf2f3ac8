"""fp8lab.step.TrainStep: the hooks (order, context, veto, checkpoint, error; a misspelled hook
method is an error), a replay step without an update, a closure step (``backward=False``) and
a hook-free TrainStep bit-identical to the lab loop's step."""

import math

import pytest
import torch

import fp8lab
from fp8lab.lab.data import DataConfig, get_batch, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.parts import build_model, make_optimizer
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.optim import LossScaler
from fp8lab.step import HOOKS, TrainStep

TINY = LabConfig(
    model=GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, d_ff=64),
    train=TrainConfig(
        steps=12, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2,
        stats_every=0, checkpoint_every=5, grad_clip=0.5,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("All the world's a stage, and all the men and women merely players. " * 60)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


def _linear_step(hooks=(), optimizer=True, clip=0.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    params = None if optimizer else list(model.parameters())

    def loss_fn(batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    batch = (torch.randn(3, 4), torch.randn(3, 2))
    return model, TrainStep(loss_fn, opt, clip=clip, hooks=hooks, params=params), batch


class Recorder:
    """Records each hook call with what the context holds at that moment."""

    def __init__(self, veto=False):
        self.calls, self.veto = [], veto

    def on_before_forward(self, ctx):
        self.calls.append(("on_before_forward", ctx.step, ctx.loss))

    def on_after_forward(self, ctx):
        self.calls.append(("on_after_forward", ctx.step, float(ctx.loss.detach())))

    def on_after_backward(self, ctx):
        grads = [p.grad is not None for p in self.params]
        self.calls.append(("on_after_backward", ctx.step, all(grads)))

    def on_before_optimizer_step(self, ctx):
        self.calls.append(("on_before_optimizer_step", ctx.step, ctx.grad_norm))
        return not self.veto

    def on_after_optimizer_step(self, ctx):
        self.calls.append(("on_after_optimizer_step", ctx.skipped, ctx.vetoed))


def test_hooks_are_called_in_order_with_the_context():
    rec = Recorder()
    model, ts, batch = _linear_step([rec], clip=1e-3)
    rec.params = list(model.parameters())
    w0 = model.weight.detach().clone()
    ctx = ts(7, batch)
    names = [c[0] for c in rec.calls]
    assert names == [h for h in HOOKS if h not in ("on_checkpoint", "on_error")]
    assert rec.calls[0] == ("on_before_forward", 7, None)  # no loss before the forward
    assert rec.calls[1][2] == ctx.loss_value and math.isfinite(ctx.loss_value)
    assert rec.calls[2][2] is True  # the gradients exist after backward
    assert rec.calls[3][2] == ctx.grad_norm > 1e-3  # the norm before clipping
    assert rec.calls[4] == ("on_after_optimizer_step", False, False)
    assert ctx.batch is batch and ctx.time_s > 0
    assert not torch.equal(model.weight, w0)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_a_vetoing_hook_skips_the_update_and_every_hook_still_runs():
    veto, after = Recorder(veto=True), Recorder()
    model, ts, batch = _linear_step([veto, after])
    veto.params = after.params = list(model.parameters())
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = ts(0, batch)
    assert ctx.vetoed and ctx.skipped
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in w0.items())
    assert [c[0] for c in after.calls][-2:] == [
        "on_before_optimizer_step",
        "on_after_optimizer_step",
    ]
    assert after.calls[-1] == ("on_after_optimizer_step", True, True)


def test_without_an_optimizer_the_gradients_stay_and_nothing_moves():
    """A replay (the debugger's): forward and backward on a model copy, no update."""
    model, ts, batch = _linear_step(optimizer=False)
    w0 = model.weight.detach().clone()
    ctx = ts(0, batch)
    assert torch.equal(model.weight, w0) and ctx.skipped
    x, y = batch
    ref = torch.autograd.grad(((model(x) - y) ** 2).mean(), model.weight)[0]
    assert torch.equal(model.weight.grad, ref)
    assert ctx.grad_norm == pytest.approx(
        float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    )


def test_on_checkpoint_receives_the_state_to_save():
    class Extra:
        def on_checkpoint(self, ctx, state):
            state["seen"] = dict(state)
            state["extra"] = ctx.step

    _, ts, _ = _linear_step([Extra(), object()])  # a hook without any method is fine
    out = ts.checkpoint(5, {"model": 1})
    assert out == {"model": 1, "seen": {"model": 1}, "extra": 5}


def test_on_error_lets_hooks_close_what_they_opened():
    class Opens:
        open = False

        def on_before_forward(self, ctx):
            self.open = True

        def on_after_backward(self, ctx):
            self.open = False

        def on_error(self, ctx):
            self.open = False

    hook = Opens()
    ts = TrainStep(lambda b: 1 / 0, params=[torch.zeros(1)], hooks=[hook])
    with pytest.raises(ZeroDivisionError):
        ts(0, None)
    assert not hook.open


class Misspelled:
    def on_after_bakward(self, ctx):  # never called by any step
        pass


class OldStyle:
    def after_backward(self, ctx):  # the earlier name of on_after_backward
        pass


@pytest.mark.parametrize("hook, match", [
    (Misspelled(), r"Misspelled has a method 'on_after_bakward'.*did you mean 'on_after_backward'"),
    (OldStyle(), r"OldStyle has a method 'after_backward'.*'on_after_backward'"),
    (type("Inst", (), {})(), None),
])  # fmt: skip
def test_a_misspelled_hook_method_is_an_error_naming_it(hook, match):
    if match is None:  # a method set on the instance counts too
        hook.on_before_fwd = lambda ctx: None
        match = r"'on_before_fwd'.*did you mean 'on_before_forward'"
    with pytest.raises(TypeError, match=match):
        _linear_step([hook])
    from fp8lab.step import Hooks

    with pytest.raises(TypeError, match=match):
        Hooks([hook], "FP8LabCallback")


@pytest.mark.parametrize("out, err, match", [
    (None, TypeError, "returned None; it must return the loss"),
    ({"loss": 1.0}, TypeError, "returned a dict"),
    ("1.0", TypeError, "returned a str"),
    (torch.ones(3), ValueError, r"returned a tensor of shape \(3,\)"),
])  # fmt: skip
def test_a_loss_function_returning_anything_but_the_loss_is_named(out, err, match):
    ts = TrainStep(lambda b: out, params=[torch.zeros(1, requires_grad=True)])
    with pytest.raises(err, match=f"TrainStep: the loss function {match}"):
        ts(0, None)


def _closure_step(backward: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def loss(batch):
        out = ((model(batch[0]) - batch[1]) ** 2).mean()
        if not backward:
            out.backward()
        return out

    return model, TrainStep(loss, opt, clip=0.5, backward=backward), (x, y)


def test_a_closure_step_equals_the_step_that_backpropagates_itself():
    """``backward=False``: the loss function runs backward (GuardedStep's closure); the rest
    of the step is the same code, so the weights are bit-identical."""
    (m1, ts1, b1), (m2, ts2, b2) = _closure_step(True), _closure_step(False)
    for i in range(3):
        c1, c2 = ts1(i, b1), ts2(i, b2)
        assert c1.loss_value == c2.loss_value and c1.grad_norm == c2.grad_norm
    assert torch.equal(m1.weight, m2.weight) and torch.equal(m1.bias, m2.bias)


def test_a_closure_that_never_calls_backward_is_an_error():
    model = torch.nn.Linear(4, 2)
    ts = TrainStep(lambda b: model(b).sum(), torch.optim.SGD(model.parameters(), lr=0.1),
                   backward=False, what="GuardedStep")  # fmt: skip
    with pytest.raises(ValueError, match="GuardedStep: the closure returned the loss but no"):
        ts(0, torch.ones(1, 4))
    # gradients kept from an earlier step (zero_grad(set_to_none=False)) do not hide it
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(ValueError, match="must call backward"):
        ts(1, torch.ones(1, 4))


@pytest.mark.parametrize("name", [None, "te-delayed"])
def test_a_hook_free_train_step_is_bit_identical_to_the_lab_loop(corpus, name):
    recipe = None if name is None else fp8lab.get_recipe(name)
    steps = 3
    lab = train_run(recipe, TINY, corpus, stop_after=steps)
    tc = TINY.train
    model = build_model(TINY.model, recipe, tc.seed)
    opt = make_optimizer(model, recipe, tc)
    scaler = None if recipe is None else LossScaler.from_recipe(recipe)
    ts = TrainStep(lambda batch: model(*batch)[1], opt, scaler, tc.grad_clip)
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = tc.lr_at(i)
        ctx = ts(i, get_batch(corpus.train, tc.batch_size, TINY.model.block_size, tc.seed, i))
        assert ctx.loss_value == lab.records[i]["train_loss"]
        assert ctx.grad_norm == lab.records[i]["grad_norm"]
    sa, sb = model.state_dict(), lab.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
