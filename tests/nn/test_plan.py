"""The LinearPlan: frozen, built once per (module, recipe), its reuse decisions as the recipes'
sources define them (per-tensor: one quantization serves two GEMMs; DeepSeek-V3 re-tiles its
cached activations and quantizes the live dy again; MXFP8 and NVFP4 re-quantize the fp32 tensor),
and quantizers that own the module's delayed-scaling states. tests/nn/test_operand_source.py
checks the operands these decisions produce."""

import dataclasses

import pytest
import torch

import fp8lab
from fp8lab.nn import Linear
from fp8lab.nn.plan import Reuse, build_plan
from fp8lab.nn.state import ScalingState
from fp8lab.scaling.delayed import DelayedScalingConfig

S, R, H = Reuse.SAME, Reuse.RETILE, Reuse.SOURCE


@pytest.mark.parametrize(
    ("name", "weight", "grad", "x"),
    [
        ("te-delayed", S, S, S),  # per-tensor: block shape does not depend on direction
        ("te-current", S, S, S),
        ("bf16", S, S, S),  # the same bf16 rounding serves both GEMMs
        # 128x128 weights transpose to themselves; the cached 1x128 x is re-tiled into 128x1,
        # the live dy quantized into 128x1 (arXiv 2412.19437 §3.3.3, App. B.2)
        ("deepseek-v3", S, H, R),
        ("mxfp8", H, H, H),  # 1x32 -> 32x1, re-quantized from fp32 (TE MXFP8)
        ("nvfp4", S, H, H),  # 16x16 weights transpose to themselves
    ],
)
def test_reuse_decisions(name, weight, grad, x):
    rec = fp8lab.get_recipe(name)
    plan = build_plan(rec, ScalingState(rec))
    assert plan.fprop["input"].reuse is None and plan.dgrad["grad_output"].reuse is None
    got = (plan.dgrad["weight"].reuse, plan.wgrad["grad_output"].reuse, plan.wgrad["input"].reuse)
    assert got == (weight, grad, x)
    # a re-tiled operand's source writes its dequantized copy while quantizing
    assert plan.fprop["input"].retile_source == (x is R)
    hp = rec.replace(save_for_backward="high_precision")
    plan_hp = build_plan(hp, ScalingState(hp))
    assert all(plan_hp.wgrad[r].reuse is not R for r in ("input", "grad_output"))


def test_plan_is_frozen_and_its_quantizers_own_the_modules_state():
    mod = Linear(16, 8, recipe="te-delayed")
    mod(torch.randn(4, 16)).sum().backward()
    plan, state = mod._plan(mod.recipe)
    assert mod._plan(mod.recipe)[0] is plan  # built once
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.name = "x"  # type: ignore[misc]
    # specs are configuration; the quantizer of each operand owns the module's state of its role
    for gemm, role in (("fprop", "input"), ("wgrad", "grad_output"), ("dgrad", "grad_output")):
        op = getattr(plan, gemm)[role]
        assert isinstance(op.spec.scaling, DelayedScalingConfig)
        assert op.quantizer.delayed is mod.scaling_states[role]
        assert op.quantizer.spec == op.spec
    # per-tensor: the dgrad and wgrad grad_output cells quantize alike, so they share a quantizer
    assert plan.dgrad["grad_output"].quantizer is plan.wgrad["grad_output"].quantizer
    assert state.by_key is mod._state.by_key
    # a recipe without delayed scaling has an empty state: nothing to update
    assert not ScalingState(fp8lab.get_recipe("te-current"))
