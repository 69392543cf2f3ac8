"""`count_linear_step`: per-tensor passes of one Linear step, against tables derived by hand.

The tables are written from the rules (docs/cost.md), not from the code's output:
* current per-tensor scaling reads a tensor twice (amax pass, then cast); delayed once (the cast
  records the amax); block scales (1x128, 128x128, MX, NVFP4 blocks) need no separate amax pass,
  NVFP4's FP32 tensor scale needs one per quantization from high precision;
* a per-tensor (or square-block) quantized operand reused by a GEMM that reduces it along its other
  axis is a transpose (x for wgrad, W for dgrad, dy for wgrad);
* DeepSeek-V3 re-tiles its cached x (1x128 -> 128x1) from the quantized values and quantizes the
  live dy into 128x1 again from high precision (arXiv 2412.19437 §3.3.3, App. B.2; until the
  operand-source fix it re-tiled dy as well); TE's MXFP8 and NVFP4 quantize the column-wise copy
  again from high precision;
* scale bytes: FP32 per block (per-tensor: one), E8M0 per MX block, E4M3 per NVFP4 block plus the
  FP32 tensor scale; promotion FMAs: M * N * ceil(K / 128) per GEMM for DeepSeek-V3.
"""

from __future__ import annotations

import pytest

from fp8lab.cost.counting import EVENT_KINDS, PROXY, count_linear_step

T, I, O = PROXY["T"], PROXY["I"], PROXY["O"]  # noqa: E741
X, W, DY = T * I, O * I, T * O  # elements of input, weight, grad_output


def _table(counts):
    return {
        role: {k: counts.count(k, role) for k in EVENT_KINDS if counts.count(k, role)}
        for role in ("input", "weight", "grad_output")
    }


# (recipe) -> per tensor: kind -> passes per Linear per step
TABLES = {
    "bf16": {r: {"round": 1} for r in ("input", "weight", "grad_output")},
    "fp32": {r: {} for r in ("input", "weight", "grad_output")},
    "te-current": {
        r: {"amax": 1, "cast": 1, "transpose": 1} for r in ("input", "weight", "grad_output")
    },
    "te-delayed": {
        r: {"cast": 1, "transpose": 1, "scale_update": 1}
        for r in ("input", "weight", "grad_output")
    },
    "deepseek-v3": {
        "input": {"cast": 1, "retile_from_quantized": 1},
        "weight": {"cast": 1, "transpose": 1},
        "grad_output": {"cast": 1, "retile_from_source": 1},
    },
    "mxfp8": {r: {"cast": 1, "retile_from_source": 1} for r in ("input", "weight", "grad_output")},
    "nvfp4": {
        "input": {"amax": 2, "cast": 1, "retile_from_source": 1},
        "weight": {"amax": 1, "cast": 1, "transpose": 1},
        "grad_output": {"amax": 2, "cast": 1, "retile_from_source": 1},
    },
}

SCALE_BYTES = {
    "bf16": 0,
    "fp32": 0,
    "te-current": 3 * 4,
    "te-delayed": 3 * 4,
    # x and dy: 1x128 rows then 128x1 columns; W 128x128; FP32 each
    "deepseek-v3": 4 * (X // 128 + (O // 128) * (I // 128) + DY // 128 + X // 128 + DY // 128),
    # every tensor twice (row-wise and column-wise), one E8M0 byte per 32
    "mxfp8": 2 * (X + W + DY) // 32,
    # x and dy twice (1x16 and 16x1), W once (16x16); one E4M3 per block + FP32 tensor scale
    "nvfp4": 2 * (X // 16 + 4) + (W // 256 + 4) + 2 * (DY // 16 + 4),
}

PROMOTION = {
    "deepseek-v3": T * O * -(-I // 128) + T * I * -(-O // 128) + I * O * -(-T // 128),
}


@pytest.mark.parametrize("recipe", sorted(TABLES))
def test_passes_per_tensor(recipe):
    c = count_linear_step(recipe)
    assert _table(c) == TABLES[recipe]


@pytest.mark.parametrize("recipe", sorted(SCALE_BYTES))
def test_scale_bytes_and_promotion(recipe):
    c = count_linear_step(recipe)
    assert c.scale_bytes() == SCALE_BYTES[recipe]
    assert c.promotion_fmas() == PROMOTION.get(recipe, 0)


def test_retilings_match_the_execution_counter():
    # the counter is the process-wide fp8lab.qtensor.retile_counts delta of the run itself
    assert count_linear_step("deepseek-v3").retiles["from_quantized"] == 1  # x only
    assert count_linear_step("te-current").retiles["from_quantized"] == 0


def test_gemm_shapes_and_formats():
    c = count_linear_step("te-current")
    got = {g.gemm: (g.m, g.k, g.n, g.fmt_a, g.fmt_b) for g in c.gemms}
    assert got == {
        "fprop": (T, I, O, "e4m3", "e4m3"),
        "dgrad": (T, O, I, "e5m2", "e4m3"),
        "wgrad": (I, T, O, "e4m3", "e5m2"),
    }
    assert all(g.flops == 2 * T * I * O for g in c.gemms)


def test_scaled_counts_are_symbolic():
    c = count_linear_step("deepseek-v3").scaled(T=1024, I=512, O=256)
    # same passes, new sizes: scale bytes follow the hand formula at the new shape
    x, dy = 1024 * 512, 1024 * 256  # W 256 x 512: (256 / 128) * (512 / 128) = 8 blocks
    assert c.scale_bytes() == 4 * (x // 128 + 8 + dy // 128 + x // 128 + dy // 128)
    assert c.promotion_fmas() == 1024 * 256 * 4 + 1024 * 512 * 2 + 512 * 256 * 8
    assert _table(c) == TABLES["deepseek-v3"]


def test_to_dict_plain():
    d = count_linear_step("te-current").to_dict()
    assert d["passes"]["amax"] == 3 and d["passes"]["transpose"] == 3
    assert d["by_tensor"]["weight"] == {"amax": 1, "cast": 1, "transpose": 1}


def test_single_high_precision_cell_still_quantizes_for_the_later_gemm():
    # dgrad's dy in bf16 (fp8lab.recipe.GemmConfig.high_precision_roles): dgrad rounds it, and
    # wgrad still takes dy quantized under the nominal E5M2 spec (the plan's shadow): amax + cast
    # in the step, then the transpose for wgrad, as without the switch
    from fp8lab.recipe import get_recipe

    rec = get_recipe("te-current").with_cell_high_precision("dgrad", "grad_output", "bf16")
    table = _table(count_linear_step(rec))
    assert table["grad_output"] == {"round": 1, "amax": 1, "cast": 1, "transpose": 1}
    assert table["input"] == TABLES["te-current"]["input"]
    assert table["weight"] == TABLES["te-current"]["weight"]


def test_counting_issues_no_collective_under_torch_distributed(monkeypatch):
    # a cost estimate on rank 0 alone (fp8lab compare's summary) must not all-reduce amaxes
    # the other ranks never join: delayed-scaling updates use the local amax
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran while counting")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", no_collective)
    assert _table(count_linear_step("te-delayed")) == TABLES["te-delayed"]
