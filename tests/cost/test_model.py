"""The roofline: counted passes priced into bytes and time, checked against hand-derived sums."""

from __future__ import annotations

import pytest

from fp8lab.cost.devices import get_device
from fp8lab.cost.model import (
    TransformerShape,
    UnpriceableError,
    predict_step_ms,
    price_layer,
)

SHAPE = TransformerShape(hidden=512, ffn=1024, layers=2, tokens=768)
CAL = {
    "h200-nvl": {
        "efficiency": {"bf16": 0.5, "fp8": 0.5, "fp8_block": 0.25},
        "bandwidth_efficiency": 0.5,
    },
    "b300": {
        "efficiency": {"bf16": 0.5, "fp8": 0.5, "mxfp8": 0.4, "nvfp4": 0.4},
        "bandwidth_efficiency": 0.5,
    },
}


def _elements(shape):
    """sum over the layer's Linears of (x + W + dy) elements."""
    t = shape.tokens
    return sum(t * i + o * i + t * o for _, i, o in shape.linears())


def test_te_current_bytes_hopper_and_blackwell():
    n = _elements(SHAPE)
    # Hopper: amax read (2 B) + cast read (2 B) + fp8 write (1 B) + fused transpose write (1 B),
    # one FP32 scale per tensor; Blackwell: no transposed copy
    hop = price_layer("te-current", get_device("h200-nvl", CAL), SHAPE)
    assert sum(k.bytes for k in hop.kernels) == 6 * n + 4 * 3 * 4
    bw = price_layer("te-current", get_device("b300", CAL), SHAPE)
    assert sum(k.bytes for k in bw.kernels) == 5 * n + 4 * 3 * 4
    # delayed: the amax pass is gone
    dl = price_layer("te-delayed", get_device("h200-nvl", CAL), SHAPE)
    assert sum(k.bytes for k in dl.kernels) == 4 * n + 4 * 3 * 4


def test_kernel_launches():
    hop = price_layer("te-current", get_device("h200-nvl", CAL), SHAPE)
    # per tensor: amax + cast kernels; the transpose is written by the cast kernel
    assert sum(k.launches for k in hop.kernels) == 4 * 3 * 2
    ds = price_layer("deepseek-v3", get_device("h200-nvl", CAL), SHAPE)
    # per Linear: 3 casts + 1 re-tiling of x from quantized values (the W transpose and dy's
    # 128x1 copy from high precision are written by their cast kernels; dy was re-tiled from
    # the quantized values, a fifth launch, until the operand-source fix)
    assert sum(k.launches for k in ds.kernels) == 4 * 4


def test_gemm_roofline_by_hand():
    dev = get_device("h200-nvl", CAL)
    c = price_layer("bf16", dev, SHAPE)
    assert c.quantize_ms == 0  # bf16 sources are already bf16
    g = c.gemms[0]  # qkv.fprop: 768 x 512 x 1536
    assert (g.m, g.k, g.n) == (768, 512, 1536)
    flops = 2 * 768 * 512 * 1536
    nbytes = 2 * (768 * 512 + 512 * 1536 + 768 * 1536)
    t = max(flops / (835.5e12 * 0.5), nbytes / (4.8e12 * 0.5))
    assert g.flops == flops and g.bytes == nbytes
    assert g.ms == pytest.approx(t * 1e3, rel=1e-12)


def test_quantization_is_memory_bound_time():
    dev = get_device("h200-nvl", CAL)
    c = price_layer("te-current", dev, SHAPE)
    assert c.quantize_ms == pytest.approx(sum(k.bytes for k in c.kernels) / (4.8e12 * 0.5) * 1e3)


def test_benchmark_scenario_quantizes_per_gemm_call():
    dev = get_device("h200-nvl", CAL)
    train = price_layer("te-current", dev, SHAPE, "training")
    bench = price_layer("te-current", dev, SHAPE, "te-benchmark")
    assert len(bench.gemms) == len(train.gemms) == 12
    # each of the 12 calls quantizes both of its operands (amax + cast each): 2 * 2 * 12
    assert sum(k.launches for k in bench.kernels) == 48
    assert bench.quantize_ms > train.quantize_ms
    assert bench.gemm_ms == pytest.approx(train.gemm_ms)


def test_unpriceable():
    with pytest.raises(UnpriceableError, match="HiF8") as e:
        price_layer("hif8-current", get_device("b300", CAL), SHAPE)
    assert not e.value.device_limit
    with pytest.raises(UnpriceableError, match="mxfp8") as e:
        price_layer("mxfp8", get_device("h200-nvl", CAL), SHAPE)
    assert e.value.device_limit
    with pytest.raises(UnpriceableError, match="fp32"):
        price_layer("fp32", get_device("h200-nvl", CAL), SHAPE)
    with pytest.raises(ValueError, match="unknown device 'a100'"):
        get_device("a100")
    with pytest.raises(ValueError, match="scenario"):
        price_layer("bf16", "h200", SHAPE, "inference")
    with pytest.raises(ValueError, match="hidden"):
        TransformerShape(hidden=0)


def test_fp8_pays_off_only_on_large_gemms_and_step_total():
    dev = get_device("b300", CAL)
    # small GEMMs: the quantization passes cost more than the faster tensor cores save
    bf = price_layer("bf16", dev, SHAPE).layer_ms
    assert price_layer("te-delayed", dev, SHAPE).layer_ms > bf
    big = TransformerShape()  # TE's 5B example
    assert price_layer("te-delayed", dev, big).layer_ms < price_layer("bf16", dev, big).layer_ms
    assert predict_step_ms("bf16", dev, SHAPE) == pytest.approx(bf * SHAPE.layers)


def test_ledger_sums_to_kernel_bytes():
    c = price_layer("mxfp8", get_device("b300", CAL), SHAPE)
    led = c.ledger()
    assert set(led) == {f"{lin}.{r}" for lin, _, _ in SHAPE.linears()
                        for r in ("input", "weight", "grad_output")}  # fmt: skip
    assert sum(sum(v.values()) for v in led.values()) == sum(k.bytes for k in c.kernels)
    # MXFP8: the column-wise copy is written by the row-wise cast kernel (one bf16 read)
    x = SHAPE.tokens * SHAPE.hidden
    assert led["qkv.input"]["read:bf16"] == 2 * x
    assert led["qkv.input"]["written:fp8"] == 2 * x
    assert led["qkv.input"]["written:scales"] == 2 * x // 32


def test_price_linears_and_step_from_a_list_of_linears():
    dev = get_device("h200-nvl", CAL)
    layer = price_layer("te-current", dev, SHAPE)
    lins = SHAPE.linears()
    same = predict_step_ms("te-current", dev, linears=lins, tokens=SHAPE.tokens)
    assert same == pytest.approx(layer.layer_ms)
    one = predict_step_ms("te-current", dev, linears=lins[:1], tokens=SHAPE.tokens)
    assert one == pytest.approx(sum(g.ms for g in layer.gemms if g.name.startswith("qkv."))
                                + sum(k.ms for k in layer.kernels if k.tensor.startswith("qkv.")))  # fmt: skip
    with pytest.raises(ValueError, match="tokens"):
        predict_step_ms("bf16", dev, linears=lins)


def test_single_high_precision_cell_is_a_bf16_gemm_with_a_dequantize():
    from fp8lab.recipe import get_recipe

    dev = get_device("h200-nvl", CAL)
    rec = get_recipe("te-current").with_cell_high_precision("dgrad", "grad_output", "bf16")
    mixed, plain = price_layer(rec, dev, SHAPE), price_layer("te-current", dev, SHAPE)
    bf16 = price_layer("bf16", dev, SHAPE)
    dg = {g.name: g for g in mixed.gemms if g.name.endswith(".dgrad")}
    assert {g.cls for g in dg.values()} == {"bf16"}
    # the same GEMM as bf16's dgrad: both operands read as 16-bit
    for g in bf16.gemms:
        if g.name.endswith(".dgrad"):
            assert dg[g.name].ms == g.ms and dg[g.name].bytes == g.bytes
    # kernels, per Linear: W's dgrad transpose write (1 B/element) is gone, a dequantize of W
    # reads 1 B + the FP32 scale and writes 2 B per element; dy's passes are unchanged
    w = sum(o * i for _, i, o in SHAPE.linears())
    assert sum(k.bytes for k in mixed.kernels) - sum(k.bytes for k in plain.kernels) == (
        -w + (w + 4 * 4 + 2 * w)
    )
    assert [k.kind for k in mixed.kernels].count("dequantize") == 4
