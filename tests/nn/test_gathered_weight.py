"""`GatheredWeight`: the typed path of a weight gathered already quantized (FSDP)."""

import pytest
import torch

from fp8lab.nn import GatheredWeight, Linear


def test_fprop_uses_a_gathered_weight_only_for_its_own_quantizer() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=False, recipe="te-delayed")
    x = torch.randn(16, 64)
    layer(x)  # the plan and its quantizers exist now
    plan, _ = layer._own_plan
    wq = plan.fprop["weight"].quantizer
    q = wq.quantize(layer.weight.detach().contiguous())
    q.values.mul_(0)  # a gathered weight that differs from the module's own: detectable
    layer.use_gathered_weight(GatheredWeight(wq.spec, q, wq.delayed))
    assert layer.gathered_weight is not None
    with torch.no_grad():
        assert torch.count_nonzero(layer(x)) == 0  # the gathered weight was used
    other = GatheredWeight(wq.spec, q, None)  # not this quantizer's state: ignored
    layer.use_gathered_weight(other)
    with torch.no_grad():
        assert torch.count_nonzero(layer(x)) > 0
    layer.use_gathered_weight(None)
    assert layer.gathered_weight is None
    with pytest.raises(TypeError, match="GatheredWeight"):
        layer.use_gathered_weight((wq.spec, q))  # type: ignore[arg-type]
