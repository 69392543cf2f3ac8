"""The names `fp8lab.nn.functional` exported before the nn split stay as deprecated aliases."""

import pytest
import torch

from fp8lab.nn import Linear
from fp8lab.nn import functional as F8
from fp8lab.nn.operand import prepare
from fp8lab.recipe import get_recipe


def _plan(recipe: str):
    lin = Linear(32, 16, recipe=get_recipe(recipe))
    plan, _ = lin._plan(lin.recipe)
    return plan


@pytest.mark.parametrize("recipe", ["te-current", "mxfp8", "deepseek-v3"])
def test_operand_and_dense_warn_and_match_prepare(recipe: str) -> None:
    plan = _plan(recipe)
    x = torch.randn(8, 32) * 3
    with pytest.warns(DeprecationWarning, match="nn.functional.operand"):
        a, q = F8.operand(x, plan, "fprop", "input")
    assert a is None and q is not None
    new = prepare(x, plan.fprop["input"], None).used
    assert torch.equal(q.dequantize(), new.dequantize())
    with pytest.warns(DeprecationWarning, match="nn.functional.dense"):
        d = F8.dense(a, q)
    assert torch.equal(d, new.dequantize())
    assert not torch.equal(d, x)  # really quantized


def test_unquantized_operand_is_the_tensor() -> None:
    plan = _plan("fp32")
    x = torch.randn(4, 32)
    with pytest.warns(DeprecationWarning):
        a, q = F8.operand(x, plan, "wgrad", "input")
        assert q is None and torch.equal(F8.dense(a, q), x)
