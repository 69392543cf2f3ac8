"""Per-expert scale statistics (`fp8lab.observe.expert_scales`, `Watch.expert_scales`)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab.nn import MoE
from fp8lab.nn.grouped import expert_of
from fp8lab.observe import expert_scales


def test_watch_summarises_the_experts_of_a_moe_layer():
    torch.manual_seed(0)
    m = MoE(64, 32, n_experts=4, top_k=2, recipe="te-current", name="mlp")
    x = torch.randn(40, 64) * torch.linspace(0.1, 3.0, 40).unsqueeze(1)
    with fp8lab.watch(m, every=1) as w:
        m(x).sum().backward()
    summary = {(s["layer"], s["gemm"], s["role"]): s for s in w.expert_scales()}
    s = summary[("mlp.gate", "fprop", "input")]
    rows = [r for r in w.records if r["layer"].startswith("mlp.gate.experts.")
            and (r["gemm"], r["role"]) == ("fprop", "input")]  # fmt: skip
    routed = sum(n > 0 for n in m.last_tokens)
    assert s["experts"] == len(rows) == routed
    amaxes = [r["amax"] for r in rows]
    assert (s["amax_min"], s["amax_max"]) == (min(amaxes), max(amaxes))
    # te-current: each expert's own per-tensor scale 448 / amax of its tokens
    for r in rows:
        assert r["scale"] == pytest.approx(448.0 / r["amax"], rel=1e-6)
    assert s["scale_spread_log2"] == pytest.approx(math.log2(max(amaxes) / min(amaxes)), rel=1e-5)
    assert {k[0] for k in summary} == {"mlp.gate", "mlp.up", "mlp.down"}
    assert ("mlp.down", "wgrad", "grad_output") in summary


@pytest.mark.no_arithmetic
def test_expert_names_and_other_rows():
    assert expert_of("blocks.0.mlp.up.experts.12") == ("blocks.0.mlp.up", 12)
    assert expert_of("blocks.0.mlp.up") is None and expert_of("experts.3") is None
    assert expert_scales([{"layer": "attn.qkv", "gemm": "fprop", "role": "input"}]) == []
