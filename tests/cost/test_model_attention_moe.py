"""Attention (bf16 and TE's FP8 attention, the recipe's ``attention``/``[dpa]``) and the MoE wire
format (``[moe] dispatch``) in the cost model, against sums derived by hand."""

from __future__ import annotations

import pytest

from fp8lab.cost.devices import get_device
from fp8lab.cost.model import TransformerShape, price_layer, price_linears
from fp8lab.nn.moe import wire_bytes
from fp8lab.recipe import get_recipe
from fp8lab.recipe.dpa import DPAConfig
from fp8lab.recipe.moe import MoEConfig

CAL = {"b200": {"efficiency": {"bf16": 0.5, "fp8": 0.5, "mxfp8": 0.4}, "bandwidth_efficiency": 0.5}}
# 2 sequences of 1024 tokens, 8 heads of 64, GQA: K and V of 2 heads (128 features each)
ATT = TransformerShape(hidden=512, ffn=1024, layers=1, tokens=2048, qkv_out=768, heads=8,
                       seq_len=1024)  # fmt: skip
NO_ATT = TransformerShape(hidden=512, ffn=1024, layers=1, tokens=2048, qkv_out=768)


def _dev():
    return get_device("b200", calibration=CAL)


def _attn(cost):
    return [g for g in cost.gemms if g.name.startswith("attn.")]


def test_bf16_attention_is_seven_causal_matmuls():
    c = price_layer("bf16", _dev(), ATT, "training")
    att = _attn(c)
    # per matmul: 2 sequences x 8 heads x 1024 x 1024 x 64 x 2 FLOPs, half under the mask
    flops = 2 * 8 * 1024 * 1024 * 64 * 2 // 2
    assert len(att) == 7 and all(g.flops == flops and g.cls == "bf16" for g in att)
    ms = flops / (2250e12 * 0.5) * 1e3
    assert all(g.ms == pytest.approx(ms) for g in att)
    # without heads/seq_len nothing changes: the Linears alone
    plain = price_layer("bf16", _dev(), NO_ATT)
    assert c.layer_ms == pytest.approx(plain.layer_ms + 7 * ms)


def test_fp8_attention_current_scaling_passes_and_rate():
    rec = get_recipe("te-current").replace(attention=True)
    c = price_layer(rec, _dev(), ATT)
    base = price_layer("te-current", _dev(), ATT)  # attention off: bf16 matmuls
    assert {g.cls for g in _attn(c)} == {"fp8"}
    assert sum(g.ms for g in _attn(base)) == pytest.approx(2 * sum(g.ms for g in _attn(c)))
    att = [k for k in c.kernels if k.tensor.startswith("attn.")]
    # current scaling: an amax pass (2 B) before each cast (2 B read, 1 B + a 4-byte scale
    # written) of Q, K, V (2048 x (512 + 2 x 128)) and dO (2048 x 512); no O / dQKV passes
    qkv, do = 2048 * 768, 2048 * 512
    assert [(k.tensor, k.kind) for k in att] == [("attn.qkv", "amax"), ("attn.qkv", "cast"),
                                                 ("attn.dO", "amax"), ("attn.dO", "cast")]  # fmt: skip
    assert sum(k.bytes for k in att) == 5 * (qkv + do) + 2 * 4
    extra = sum(k.ms for k in att)
    assert extra == pytest.approx(sum(k.bytes for k in att) / (7.7e12 * 0.5) * 1e3)


def test_fp8_attention_delayed_fp8_mha_and_fa_path():
    dev = _dev()
    delayed = get_recipe("te-delayed").replace(attention=True)
    kinds = [(k.tensor, k.kind) for k in price_layer(delayed, dev, ATT).kernels
             if k.tensor.startswith("attn.")]  # fmt: skip
    # delayed: no amax passes; O and dQKV leave cuDNN in FP8 and are dequantized for bf16 users
    assert kinds == [("attn.qkv", "cast"), ("attn.dO", "cast"), ("attn.O", "dequantize"),
                     ("attn.dQKV", "dequantize")]  # fmt: skip
    mha = delayed.replace(dpa=DPAConfig(fp8_mha=True))
    kinds = [k.kind for k in price_layer(mha, dev, ATT).kernels if k.tensor.startswith("attn.")]
    assert kinds == ["cast"]  # Q, K, V arrive in FP8 from the QKV Linear; only dO is cast
    fa = get_recipe("te-current").replace(attention=True, dpa=DPAConfig(path="fa"))
    att = _attn(price_layer(fa, dev, ATT))
    assert [g.cls for g in att] == ["fp8", "fp8"] + ["bf16"] * 5  # forward-only FP8


def test_moe_wire_format_passes_and_bytes():
    lins = [(f"blocks.0.mlp.{p}.experts.{e}", i, o) for p, i, o in
            (("gate", 256, 512), ("up", 256, 512), ("down", 512, 256)) for e in range(4)]  # fmt: skip
    experts = {n: (4, 2) for n, _, _ in lins}
    dev = _dev()
    ds = get_recipe("deepseek-v3")
    bf = price_linears(ds, dev, lins, 1000, experts=experts)
    rows = 1000 * 2  # routed rows of width 256
    assert bf.wire_bytes == {"blocks.0.mlp": 4 * rows * 256 * 2}
    assert not [k for k in bf.kernels if "dispatch" in k.kind or "combine" in k.kind]
    for fmt, scales in (("fp8", rows * 2 * 4), ("mxfp8", rows * 8)):
        c = price_linears(ds.replace(moe=MoEConfig(dispatch=fmt)), dev, lins, 1000,
                          experts=experts)  # fmt: skip
        wire = rows * 256 + scales
        assert wire == wire_bytes(rows, 256, fmt)
        # dispatch and the combine's backward in the format, the other two in bf16
        assert c.wire_bytes["blocks.0.mlp"] == 2 * wire + 2 * rows * 256 * 2
        moe = [k for k in c.kernels if k.kind.startswith(("dispatch", "combine"))]
        # quantize (read 2 B, write the wire) and dequantize (the reverse), forward and backward
        assert len(moe) == 4 and all(k.bytes == rows * 256 * 2 + wire for k in moe)
        assert c.quantize_ms - bf.quantize_ms == pytest.approx(
            4 * (rows * 256 * 2 + wire) / (7.7e12 * 0.5) * 1e3
        )
        assert c.gemm_ms == bf.gemm_ms


def test_attention_shape_errors():
    with pytest.raises(ValueError, match="both heads and seq_len"):
        TransformerShape(heads=8)
    with pytest.raises(ValueError, match="whole number of sequences"):
        TransformerShape(tokens=1000, heads=32, seq_len=512)
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerShape(hidden=500, heads=8, seq_len=512, tokens=1024)
