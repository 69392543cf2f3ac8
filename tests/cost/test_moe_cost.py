"""Mixture of experts in the cost model: expert rows with padding, wire bytes, the routing map."""

from __future__ import annotations

import pytest
import torch

from fp8lab.cost import expert_routing, expert_rows, linear_shapes, price_linears, wire_traffic
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.recipe import get_recipe

pytestmark = pytest.mark.no_arithmetic


def test_expert_rows_are_the_padded_uniform_share():
    ds, bf = get_recipe("deepseek-v3"), get_recipe("bf16")
    assert expert_rows(4096, 8, 2, ds) == 1024
    assert expert_rows(1000, 8, 2, ds) == 256  # 250 routed rows padded to 2 x 128
    assert expert_rows(1000, 8, 2, get_recipe("mxfp8")) == 256  # 250 -> 8 x 32
    assert expert_rows(1000, 8, 2, get_recipe("te-current")) == 256  # 250 -> 16 x 16
    assert expert_rows(1000, 8, 2, bf) == 250  # no padding without quantization


def test_experts_are_priced_on_their_rows():
    lin = [("mlp.up.experts.0", 256, 512)]
    as_expert = price_linears("deepseek-v3", "h100", lin, 1000, experts={lin[0][0]: (8, 2)})
    direct = price_linears("deepseek-v3", "h100", lin, 256)
    assert as_expert.layer_ms == direct.layer_ms
    assert as_expert.layer_ms < price_linears("deepseek-v3", "h100", lin, 1000).layer_ms


def test_wire_traffic_in_each_format():
    t = {f: wire_traffic(100, 256, 2, f) for f in ("bf16", "fp8", "mxfp8")}
    assert t["bf16"]["total"] == 4 * 200 * 256 * 2
    assert t["fp8"]["dispatch"] == 200 * 256 + 200 * 2 * 4
    assert t["mxfp8"]["combine_backward"] == 200 * 256 + 200 * 8
    assert t["fp8"]["combine"] == t["fp8"]["dispatch_backward"] == 200 * 256 * 2


def test_expert_routing_names_the_converted_expert_linears():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, d_model=64, d_ff=64, n_head=2, n_experts=4, top_k=2))
    routing = expert_routing(model)
    names = {n for n, _, _ in linear_shapes(model)}
    assert len(routing) == 3 * 4 and set(routing) <= names
    assert set(routing.values()) == {(4, 2)}
