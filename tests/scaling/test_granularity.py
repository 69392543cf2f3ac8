"""Granularities: block shapes, amax per block, padding, re-tiling, per-block vs per-tensor error."""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab.qtensor import retile_counts
from fp8lab.scaling import granularity as G


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_named_and_tuple_granularities():
    assert G.normalize_granularity("tensor") == (-1, -1)
    assert G.normalize_granularity("row") == (1, -1)
    assert G.normalize_granularity("col") == (-1, 1)
    assert G.normalize_granularity("mx") == (1, 32)
    assert G.normalize_granularity("nvfp4") == (1, 16)
    assert G.normalize_granularity([1, 128]) == (1, 128)
    assert G.canonical_granularity((32, 1)) == "mx_col"
    assert G.canonical_granularity((128, 128)) == (128, 128)
    assert G.transpose_granularity((1, 128)) == (128, 1)
    assert G.transpose_granularity("mx") == "mx_col"
    for bad in ("blocky", (0, 4), (1, -2), (1, 2, 3), 5):
        with pytest.raises(ValueError):
            G.normalize_granularity(bad)


@pytest.mark.parametrize(
    "block", [(-1, -1), (1, -1), (-1, 1), (1, 32), (32, 1), (1, 128), (128, 128), (3, 5), (100, 7)]
)
@pytest.mark.parametrize("shape", [(300, 515), (128, 256), (1, 7), (7,), (2, 3, 40)])
def test_block_amax_fast_equals_reference(block, shape):
    from fp8lab.qtensor import _block_amax_fast

    x = torch.randn(shape, generator=gen()) * torch.exp(torch.randn(shape, generator=gen(1)) * 3)
    x.view(-1)[0] = math.nan
    ref = G.block_amax(x, block)
    fast = _block_amax_fast(G.as_2d(x).contiguous(), G.normalize_granularity(block))
    assert torch.equal(ref, fast)
    # NaN is ignored (TE fmaxf), inf is kept
    x.view(-1)[-1] = math.inf
    assert torch.isinf(G.block_amax(x, block)).any()
    assert not torch.isnan(G.block_amax(x, block)).any()


@pytest.mark.parametrize("g", ["tensor", "row", "col", "mx", (1, 128), (128, 128), (2, 16)])
def test_padding_is_exact(g):
    x = torch.randn(37, 300, generator=gen(2)) * 4
    q = fp8lab.quantize(x, "e4m3", g, "pow2_down" if not isinstance(g, str) else None)
    bm, bk = G.resolve_block(G.normalize_granularity(g), (37, 300))
    pr, pc = -(-37 // bm) * bm, -(-300 // bk) * bk
    xp = torch.zeros(pr, pc)
    xp[:37, :300] = x
    spec_p = q.spec
    gp = g
    if G.normalize_granularity(g)[0] == -1 or G.normalize_granularity(g)[1] == -1:
        gp = (bm, bk)  # full-extent blocks must stay the original extent on the padded tensor
    qp = fp8lab.quantize(xp, spec_p.replace(granularity=gp))
    assert torch.equal(q.values, qp.values[:37, :300])
    assert torch.equal(q.scales, qp.scales)
    assert torch.equal(q.dequantize(), qp.dequantize()[:37, :300])


def test_pad_false_raises_with_shape_and_block():
    x = torch.randn(130, 250)
    with pytest.raises(ValueError, match=r"250 columns are not a multiple of the block width 128"):
        fp8lab.quantize(x, "e4m3", (1, 128), pad=False)
    with pytest.raises(ValueError, match=r"130 rows"):
        fp8lab.quantize(x, "e4m3", (128, 1), pad=False)
    fp8lab.quantize(x[:128, :128], "e4m3", (128, 128), pad=False)  # fits: fine


def test_per_block_error_not_worse_than_per_tensor_on_outliers():
    x = torch.randn(256, 512, generator=gen(3))
    idx = torch.randint(0, x.numel(), (40,), generator=gen(4))
    x.view(-1)[idx] *= 1000.0  # token/channel outliers
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary.view(-1)[idx] = False
    err = {}
    for name, g in [("tensor", "tensor"), ("row", "row"), ("1x128", (1, 128)), ("128x128", (128, 128)),
                    ("mx", "mx")]:  # fmt: skip
        sc = "mx_rceil" if g == "mx" else "max"
        d = fp8lab.fake_quant(x, "e4m3", g, sc) - x
        err[name] = (
            (d.norm() / x.norm()).item(),
            (d[ordinary].norm() / x[ordinary].norm()).item(),
        )
    # per-block amax scaling never loses to per-tensor (relative Frobenius error), and on the
    # ordinary (non-outlier) elements every per-block granularity wins clearly; MX's power-of-two
    # scales may leave an outlier block below 448, so its total is dominated by outlier rounding
    for name in ("row", "1x128", "128x128"):
        assert err[name][0] <= err["tensor"][0] * 1.0001, (name, err)
    for name in ("row", "1x128", "128x128", "mx"):
        assert err[name][1] < err["tensor"][1], (name, err)
    # and small values survive: per-tensor scaling flushes some of them to zero, 1x128 does not
    small = (x.abs() < 0.01) & (x != 0)
    qt = fp8lab.fake_quant(x, "e4m3", "tensor")
    qb = fp8lab.fake_quant(x, "e4m3", (1, 128))
    assert (qt[small] == 0).float().mean() > 0.2
    assert (qb[small] == 0).float().mean() < (qt[small] == 0).float().mean()


@pytest.mark.parametrize(
    ("g", "rule"), [((1, 128), "pow2_down"), ((1, 128), "max"), ("mx", "mx_floor")]
)
def test_retile_from_quantized_equals_requantizing_the_dequantized(g, rule):
    x = torch.randn(256, 384, generator=gen(5)) * torch.exp(torch.randn(256, 384, generator=gen(6)))
    retile_counts(reset=True)
    q = fp8lab.quantize(x, "e4m3", g, rule)
    r = fp8lab.retile(q)
    want = fp8lab.quantize(q.dequantize(), q.spec.transposed())
    assert r.spec.granularity == G.transpose_granularity(g)
    assert torch.equal(r.values, want.values) and torch.equal(r.scales, want.scales)
    # the same thing seen from the transposed side: quantizing the dequantized transpose with the
    # original tiles, transposed back
    qt = fp8lab.quantize(q.dequantize().t().contiguous(), q.spec)
    assert torch.equal(r.t().values, qt.values) and torch.equal(r.t().scales, qt.scales)
    assert r.retiled == 1 and r.meta["retile_source"] == "quantized"
    added = (r.dequantize() - q.dequantize()).abs().max().item()
    assert r.meta["retile_added_error"] == added
    # the transposed view is what a wgrad GEMM consumes: blocks now run down the columns
    assert r.t().spec.granularity == g
    from_src = fp8lab.retile(q, source=x)
    assert torch.equal(from_src.values, fp8lab.quantize(x, q.spec.transposed()).values)
    assert retile_counts() == {"from_quantized": 1, "from_source": 1}


def test_retile_pow2_adds_less_error_than_arbitrary_scales():
    x = torch.randn(256, 256, generator=gen(7)) * 3
    added = {}
    for rule in ("pow2_down", "max"):
        q = fp8lab.quantize(x, "e4m3", (1, 128), rule)
        added[rule] = fp8lab.retile(q).meta["retile_added_error"]
    assert added["pow2_down"] <= added["max"]


def test_retile_bad_input():
    q = fp8lab.quantize(torch.randn(8, 8), "e4m3", "row")
    with pytest.raises(ValueError, match="does not match"):
        fp8lab.retile(q, source=torch.randn(8, 9))
    with pytest.raises(TypeError):
        fp8lab.retile(torch.randn(8, 8))
