"""Built-in scenarios: a known fault planted in the default model and data (ground truth).

Each scenario gives the recipe under debug and the lab configuration; the debugger is not told
what was planted (it only gets the recipe and the config, as for any user run), and the
scenario says what it should find (``expect``). A scenario picks its target layer among the
model's converted layers, so it also works with other sizes (``--set model.n_layer=4``).

- ``outlier-channels``: 4 input channels of one layer (the first attention QKV projection: the
  normalized hidden state, where Dettmers et al. 2022, LLM.int8(), find outlier features) are
  x1e5 larger, under te-delayed (per-tensor delayed scaling): one scale for the whole tensor is
  set by the outliers and the other channels fall below E4M3's smallest subnormal, so that
  layer's attention gets (almost) nothing in fprop and its weights no gradient in wgrad. The
  weights reading the outlier channels are held at zero (``outlier_weights="zero"``): the
  channels carry range without signal, so the high-precision baselines do not depend on the
  scale (bit for bit in fp32) and the gap is FP8's alone. With trained weights instead, Adam
  moves them by about its step size, x1e5 in the output, and even fp32 and bf16 drift apart.
  Expect: that layer, role ``input``.
- ``unscaled-gradient``: one layer's gradient operand (the last attention output projection)
  cast to E4M3 with a fixed scale of 1 (no scaling), via a per-layer recipe rule on te-delayed:
  gradients below E4M3's smallest subnormal (2^-9) flush to zero in that layer. Expect: that layer, role ``grad_output``.
- ``gradient-spike``: a one-step gradient spike (the loss scaled up before backward and the
  gradients scaled down after: the update is unchanged in exact arithmetic) poisons every
  delayed-scaling gradient history of te-delayed: for the rest of the run (history 1024) every
  layer's gradient scale is far too small and most gradients underflow. Expect: role
  ``grad_output`` on many layers, current scaling as the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fp8lab.lab.train import LabConfig


@dataclass(frozen=True)
class Scenario:
    """A planted fault: ``build(cfg, layers)`` -> (recipe, cfg, expect) for the converted
    ``layers`` of the model; ``train`` holds the scenario's default training settings (the
    user's ``--set``/``--steps`` apply on top)."""

    name: str
    description: str
    build: Callable[[LabConfig, Sequence[str]], tuple[Any, LabConfig, dict[str, Any]]]
    train: dict[str, Any]


def _pick(layers: Sequence[str], suffix: str, last: bool = True) -> str:
    hits = [n for n in layers if n.endswith(suffix)]
    if hits:
        return hits[-1] if last else hits[0]
    return layers[len(layers) // 2]


def _outliers(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    target = _pick(layers, "attn.qkv", last=False)
    inject = cfg.inject
    if inject.outlier_channels == 0:  # the user may have set their own
        inject = replace(inject, outlier_channels=4, outlier_scale=1e5, outlier_weights="zero")
    inject = replace(inject, outlier_layers=target)
    recipe = get_recipe("te-delayed")
    return recipe, replace(cfg, inject=inject), {"role": "input", "layers": [target]}


def _unscaled(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.qtensor import QuantSpec
    from fp8lab.recipe import LayerRule, get_recipe

    target = _pick(layers, "attn.proj")
    rule = LayerRule(match=target,
                     changes={"grad_output": QuantSpec(format="e4m3", scaling=1.0).to_dict()})  # fmt: skip
    recipe = (
        get_recipe("te-delayed")
        .with_layers(rule)
        .replace(
            name="te-delayed+unscaled-grad",
            description=f"te-delayed, but {target}'s gradient operand is cast to E4M3 with a "
            "fixed scale of 1 (no scaling): a planted fault",
        )
    )
    return recipe, cfg, {"role": "grad_output", "layers": [target]}


def _spike(cfg: LabConfig, layers: Sequence[str]):
    from fp8lab.recipe import get_recipe

    inject = cfg.inject
    if inject.grad_spike_step < 0:
        # 2^40: E5M2's 32 binades absorb a 1024x spike; this one leaves the later gradients
        # 40 binades under the poisoned scale, i.e. flushed to zero
        inject = replace(inject, grad_spike_step=max(1, cfg.train.steps // 6),
                         grad_spike_scale=2.0**40)  # fmt: skip
    return (get_recipe("te-delayed"), replace(cfg, inject=inject),
            {"role": "grad_output", "layers": "many", "fix": "current-scaling"})  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("outlier-channels", "4 input channels of the first attn.qkv x1e5 (their "
                 "weights held at zero) under te-delayed (per-tensor delayed scaling)", _outliers,
                 {"steps": 200, "eval_every": 20}),
        Scenario("unscaled-gradient", "the last attn.proj gradient operand in E4M3 with a "
                 "fixed scale of 1 (a per-layer recipe rule on te-delayed)", _unscaled,
                 {"steps": 200, "eval_every": 20}),
        Scenario("gradient-spike", "a one-step x2^40 gradient spike poisons te-delayed's "
                 "gradient amax histories", _spike, {"steps": 200, "eval_every": 20}),
    )
}  # fmt: skip


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def scenario_config(cfg: LabConfig, name: str, train: dict[str, Any] | None = None) -> LabConfig:
    """``cfg`` with the scenario's default training settings, then ``train`` (the user's)."""
    sc = get_scenario(name)
    return cfg.replace_train(**{**sc.train, **(train or {})})


def plant(name: str, cfg: LabConfig) -> tuple[Any, LabConfig, dict[str, Any]]:
    """(recipe, config, expectation) of scenario ``name`` on the model of ``cfg``."""
    import torch

    from fp8lab.lab.debug.variants import converted_layers
    from fp8lab.lab.parts import build_model
    from fp8lab.recipe import get_recipe

    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, get_recipe("te-delayed"), cfg.train.seed)
    return get_scenario(name).build(cfg, converted_layers(model))
