"""DeepSeek-V3's sigmoid router (`fp8lab.nn.moe.Router`, ``router = "sigmoid"``) against the
formulas of arXiv 2412.19437 section 2.1.2, written here in float64 numpy: selection by the
biased affinities, gates from the unbiased ones normalised over the selected experts, the
auxiliary-loss-free bias update and the sequence-wise balance loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8lab.nn import MoE
from fp8lab.nn.moe import Router

N, K = 6, 2


def _affinities(x: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    logits = x.double().numpy() @ w.detach().double().numpy().T
    return 1.0 / (1.0 + np.exp(-logits))


def _router(**kw) -> Router:
    torch.manual_seed(0)
    r = Router(16, N, K, "sigmoid", **kw)
    with torch.no_grad():
        r.weight.normal_(0.0, 0.5)  # affinities spread over (0, 1): no near ties
    return r


def test_selection_by_biased_affinity_gates_from_the_unbiased_one(threads):
    torch.set_num_threads(1)
    r = _router().eval()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        r.bias.copy_(torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 0.0]))  # expert 2 always selected
    gates, experts = r(x)
    s = _affinities(x, r.weight)
    sel = s + r.bias.double().numpy()
    want = np.argsort(-sel, axis=1, kind="stable")[:, :K]
    assert np.array_equal(np.sort(experts.numpy(), 1), np.sort(want, 1))
    assert (experts == 2).any(dim=1).all()
    w = np.take_along_axis(s, experts.numpy(), 1)
    np.testing.assert_allclose(gates.detach().numpy(), w / w.sum(1, keepdims=True), rtol=1e-6)
    assert torch.equal(r.bias, torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 0.0]))  # eval: no update
    assert r.aux_loss is None


def test_bias_moves_by_the_sign_of_the_load_error_once_per_training_forward(threads):
    torch.set_num_threads(1)
    r = _router(bias_update_speed=0.01).train()
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    bias = np.zeros(N)
    for _ in range(3):
        before = r.bias.double().numpy().copy()
        _, experts = r(x)
        load = np.bincount(experts.numpy().ravel(), minlength=N)
        bias = before + 0.01 * np.sign(load.mean() - load)
        np.testing.assert_allclose(r.bias.double().numpy(), bias, rtol=0, atol=1e-7)
    assert np.abs(bias).sum() > 0
    with torch.no_grad():  # no gradient: an evaluation forward, nothing moves
        r(x)
    np.testing.assert_allclose(r.bias.double().numpy(), bias, rtol=0, atol=1e-7)


def test_sequence_wise_balance_loss(threads):
    torch.set_num_threads(1)
    alpha, batch, seq = 0.01, 3, 5
    r = _router(aux_loss_alpha=alpha, bias_update_speed=0.0).train()
    x = torch.randn(batch * seq, 16, generator=torch.Generator().manual_seed(3))
    r(x, seq)
    s = _affinities(x, r.weight).reshape(batch, seq, N)
    want = 0.0
    for b in range(batch):  # eqs. 17-20, one sequence at a time
        top = np.argsort(-s[b], axis=1)[:, :K]
        f = np.array([(top == i).any(1).sum() for i in range(N)]) * N / (K * seq)
        p = (s[b] / s[b].sum(1, keepdims=True)).mean(0)
        want += alpha * (f * p).sum()
    assert r.aux_loss is not None
    np.testing.assert_allclose(float(r.aux_loss), want / batch, rtol=1e-6)
    r.aux_loss.backward()  # the loss trains the router weight through P
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_moe_state_dict_has_the_bias_only_for_the_sigmoid_router():
    assert "router.bias" not in MoE(8, 8, 4, 2).state_dict()
    sd = MoE(8, 8, 4, 2, router="sigmoid").state_dict()
    assert torch.equal(sd["router.bias"], torch.zeros(4))
    with pytest.raises(ValueError, match="router must be one of"):
        MoE(8, 8, 4, 2, router="topk")
    with pytest.raises(ValueError, match=r"aux_loss_alpha = 0\.1 is DeepSeek-V3's"):
        MoE(8, 8, 4, 2, aux_loss_alpha=0.1)
