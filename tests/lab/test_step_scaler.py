"""TrainStep without an optimizer but with a loss scaler (a replay under a recipe's scaling):
the gradients are unscaled, the scaler keeps its state."""

import torch

from fp8lab.optim import LossScaler
from fp8lab.step import TrainStep


def test_a_replay_step_with_a_scaler_unscales_the_gradients_and_keeps_the_scale():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def loss_fn(batch):
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    ref = torch.autograd.grad(loss_fn((x, y)), model.weight)[0]
    scaler = LossScaler(2.0**10, dynamic=True)
    ctx = TrainStep(loss_fn, None, scaler, params=list(model.parameters()))(0, (x, y))
    assert ctx.loss_scale == 2.0**10 and not ctx.found_inf and ctx.skipped
    # S is a power of two: scaling and unscaling are exact
    assert torch.equal(model.weight.grad, ref)
    assert scaler.get_scale() == 2.0**10 and scaler.steps == 0
