"""The device-generic torch kernels of quantize, the scale rules and the statistics give the same
bits as the numba kernels (issue 24): every scale rule and block shape on random + edge tensors
(NaN, inf, zero blocks, float32 subnormals, huge and tiny amaxes), bit for bit; NaN outputs are
compared as NaN (their payload is not part of fp8lab's arithmetic: CUDA canonicalises it).

A test that runs the numba kernels beside the torch kernels (`using_kernels`) on the same input is
`numba_only` (skipped in the ``FP8LAB_KERNELS=torch`` run, whose fence makes numba raise; that
run checks the torch kernels against the suite's own oracles). CUDA variants skip without CUDA.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab import QuantSpec
from fp8lab.formats import rounding_torch
from fp8lab.kernels import kernel_counts, using_kernels
from fp8lab.qtensor import kernels_torch
from fp8lab.qtensor.kernels import block_amax, max_abs_diff, mul_blocks
from fp8lab.scaling import DelayedScaling
from fp8lab.scaling.granularity import normalize_granularity, num_blocks, resolve_block
from fp8lab.scaling.rule_kernels import MX_RULES
from fp8lab.stats import clip_percentages, error_stats

FLT_MAX = float(np.finfo(np.float32).max)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 bits, every NaN taken as one value."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return False
    a = torch.nan_to_num(a.float(), nan=7.77)
    b = torch.nan_to_num(b.float(), nan=7.77)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def edge_tensor(shape: tuple[int, int] = (136, 300), seed: int = 0) -> torch.Tensor:
    """Random values over ~80 binades plus edges: whole blocks of zeros, NaN, subnormals, huge
    and tiny values (rows 0-7, cropped for small shapes); scattered NaN, +-inf, -0, the formats'
    max and its rounding midpoints."""
    g = torch.Generator().manual_seed(seed)
    big = (max(shape[0], 16), max(shape[1], 256))
    x = torch.randn(big, generator=g) * torch.exp2(torch.randint(-40, 40, big, generator=g).float())
    x[0:2, 0:160] = 0.0  # zero blocks of 1x32 / 1x128 (and rows of taller blocks)
    x[2, 0:32] = math.nan  # an all-NaN 1x32 block
    x[3, 0:128] = -0.0
    sub = torch.randint(1, 1 << 23, (2, 128), generator=g, dtype=torch.int32).view(torch.float32)
    x[4:6, 0:128] = sub * torch.where(torch.rand(2, 128, generator=g) < 0.5, -1.0, 1.0)
    x[6, 0:128] = FLT_MAX * torch.rand(128, generator=g)  # amaxes near FLT_MAX
    x[7, 0:128] = 1e-38 * torch.rand(128, generator=g)  # tiny amaxes: infinite scales
    x = x[: shape[0], : shape[1]].contiguous()
    specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 1e-45, -1e-45,
                             448.0, 464.0, 480.0, 57344.0, 61440.0, 6.0, 5.0, 240.0, FLT_MAX])  # fmt: skip
    reps = max(1, min(4, x.numel() // (4 * specials.numel())))
    where = torch.randperm(x.numel(), generator=g)[: reps * specials.numel()]
    x.view(-1)[where] = specials.repeat(reps)[: where.numel()]
    return x


def both(fn, *args, **kw):
    """``fn(*args, **kw)`` under the numba kernels and under the torch kernels."""
    with using_kernels("numba"):
        a = fn(*args, **kw)
    with using_kernels("torch"):
        b = fn(*args, **kw)
    return a, b


BLOCKS = [(1, 128), (128, 128), (1, 32), (32, 1), (128, 1), (3, 5), "tensor", "row", "col", "mx",
          "mx_col", (1, 16)]  # fmt: skip


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", [(256, 384), (260, 390), (7, 1000), (1, 33)])
@pytest.mark.numba_only
def test_block_amax_bits(block, shape):
    x = edge_tensor(shape, seed=len(str(block)) + shape[0]).contiguous()
    m, k = resolve_block(normalize_granularity(block), shape)
    nr, nc = num_blocks(shape, (m, k))
    a, b = both(block_amax, x, m, k, nr, nc)
    assert b.device == x.device and b.shape == (nr, nc)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # no NaN: exact bits
    # without NaN the CPU takes the float-reduction shortcut: the same bits (-0 blocks, inf)
    z = torch.nan_to_num(x, nan=-0.0, posinf=math.inf, neginf=-math.inf)
    a, b = both(block_amax, z, m, k, nr, nc)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # an all-NaN block gives 0, as TE's fmaxf reduction from 0
    y = torch.full(shape, math.nan)
    a, b = both(block_amax, y, m, k, nr, nc)
    assert torch.equal(b, torch.zeros(nr, nc)) and torch.equal(a, b)


@pytest.mark.numba_only
def test_block_amax_chunks_inside_tall_blocks(monkeypatch):
    # small chunks: a block row split over several chunks, combined by max
    monkeypatch.setattr(kernels_torch, "_CPU_CHUNK", 1000)
    x = edge_tensor((300, 129), seed=3)
    for m, k in ((128, 128), (300, 129), (7, 5), (1, 129)):
        nr, nc = num_blocks((300, 129), (m, k))
        a, b = both(block_amax, x, m, k, nr, nc)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (m, k)
        q_a, q_b = both(fp8lab.quantize, x, "e4m3", (m, k))
        assert same_bits(q_a.values, q_b.values) and same_bits(q_a.scales, q_b.scales)


RULES = ["max", "pow2_down", "pow2_up", *MX_RULES, 2.0**-3, 1e6]
FORMATS = ["e4m3", "e5m2", "e2m1", "e3m2", "e2m3", "e4m3fnuz", "e5m2fnuz", "fp16", "bf16", "hif8"]


def check_quantize(x: torch.Tensor, *args, **kw) -> None:
    qa, qb = both(fp8lab.quantize, x, *args, **kw)
    assert same_bits(qa.values, qb.values), (args, kw)
    assert same_bits(qa.scales, qb.scales), (args, kw)
    assert same_bits(qa.dequantize(), qb.dequantize()), (args, kw)
    if qa.global_scale is not None:
        assert same_bits(qa.global_scale, qb.global_scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.numba_only
def test_quantize_bits_every_rule_and_block(fmt, rule):
    x = edge_tensor(seed=11)
    for block in BLOCKS:
        if isinstance(rule, str) and rule.startswith("mx") and block not in ("mx", "mx_col"):
            continue  # MX rules on other blocks are covered by the (1, 32) MX granularity
        check_quantize(x, fmt, block, rule)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("gran", ["nvfp4", "nvfp4_col", (1, 16)])
@pytest.mark.numba_only
def test_quantize_bits_nvfp4(fmt, gran):
    x = edge_tensor((64, 96), seed=5)
    x[torch.isnan(x) | torch.isinf(x)] = 1.0  # nvfp4's tensor amax: finite inputs
    check_quantize(x, fmt, gran, "nvfp4")
    check_quantize(x, QuantSpec(format=fmt, granularity=gran, scaling="nvfp4", tensor_scale=0.01))


@pytest.mark.parametrize("kw", [{"margin": 2}, {"epsilon": 1e-3}, {"margin": -1}])
@pytest.mark.numba_only
def test_quantize_bits_rule_options_and_dtypes(kw):
    x = edge_tensor(seed=2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        xd = x.to(dtype)
        check_quantize(xd, "e4m3", (1, 128), "max", **kw)
        check_quantize(xd, "e5m2", "tensor", "pow2_down", **kw)


@pytest.mark.parametrize(
    "fmt, rounding",
    [("e4m3", "stochastic"), ("e4m3", "toward_zero"), ("e5m2", "nearest_away"), ("hif8", "hybrid")],
)
@pytest.mark.numba_only
def test_quantize_bits_other_roundings(fmt, rounding):
    # the general path: x * multiplier, then fp8lab.cast (stochastic draws from a CPU generator)
    x = edge_tensor((64, 256), seed=9)
    qa, qb = both(
        lambda: fp8lab.quantize(
            x, fmt, (1, 128), "max", rounding,
            generator=torch.Generator().manual_seed(4),
        )
    )  # fmt: skip
    assert same_bits(qa.values, qb.values) and same_bits(qa.dequantize(), qb.dequantize())


@pytest.mark.numba_only
def test_quantize_bits_out_buffers_and_in_place():
    x = edge_tensor(seed=4)
    for fmt, gran, rule in (("e4m3", (1, 128), "max"), ("e4m3", "mx", "mx_floor"),
                            ("hif8", "tensor", "max"), ("e2m1", "nvfp4", "nvfp4")):  # fmt: skip
        ref = fp8lab.quantize(x, fmt, gran, rule)
        with using_kernels("torch"):
            out, deq = torch.full_like(x, 3.0), torch.full_like(x, -1.0)
            q = fp8lab.quantize(x, fmt, gran, rule, out=out, dequantized_out=deq)
            y = x.clone()
            q_in_place = fp8lab.quantize(y, fmt, gran, rule, out=y)
        assert q.values.data_ptr() == out.data_ptr()
        assert same_bits(out, ref.values) and same_bits(deq, ref.dequantize()), (fmt, gran)
        assert same_bits(y, ref.values) and same_bits(q_in_place.scales, ref.scales), (fmt, gran)


@pytest.mark.numba_only
def test_small_chunks_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(kernels_torch, "_CPU_CHUNK", 777)
    x = edge_tensor(seed=8)
    for gran, rule in (((128, 128), "max"), ((1, 128), "pow2_up"), ("mx_col", "mx_rceil"),
                       ("tensor", "max"), ((3, 5), "max")):  # fmt: skip
        check_quantize(x, "e4m3", gran, rule)


# ------------------------------------------------------------- the compiled fast path
# (260, 384): 99,840 elements, above rounding_torch.COMPILE_MIN, so the torch kernels run the
# scaled cast compiled (whole-block rectangles: 128-row blocks leave a ragged tail of 4 rows)
BIG = (260, 384)
COMPILED = [("e4m3", "tensor", "max"), ("e4m3", (1, 128), "max"), ("e5m2", (128, 128), "max"),
            ("e4m3", "mx", "mx_floor"), ("e4m3fnuz", "mx_col", "mx_rceil"),
            ("e2m1", "nvfp4", "nvfp4"), ("e3m2", "col", "pow2_up"), ("e4m3", "row", 2.0**-3),
            ("e4m3", (3, 5), "max")]  # fmt: skip


def _count_compiled_calls(monkeypatch) -> list[int]:
    """A one-element list counting the compiled scaled-cast calls from now on."""
    calls = [0]
    real = rounding_torch.call_compiled

    def counting(fn, *args):
        calls[0] += fn is rounding_torch._compiled.get("quantize")
        return real(fn, *args)

    monkeypatch.setattr(rounding_torch, "call_compiled", counting)
    return calls


@pytest.mark.parametrize("fmt, gran, rule", COMPILED)
@pytest.mark.numba_only
def test_compiled_quantize_bits(fmt, gran, rule, monkeypatch):
    """The compiled scaled cast (one fused pass per rectangle) gives numba's bits: values,
    scales and the dequantized copy, allocated and into out= buffers; the compiled kernel ran
    except for (3, 5) blocks, whose 384 columns do not tile."""
    x = edge_tensor(BIG, seed=31)
    if rule == "nvfp4":
        x[torch.isnan(x) | torch.isinf(x)] = 1.0  # nvfp4's tensor amax: finite inputs
    calls = _count_compiled_calls(monkeypatch)
    check_quantize(x, fmt, gran, rule)
    ref = fp8lab.quantize(x, fmt, gran, rule)
    with using_kernels("torch"):
        out, deq = torch.full_like(x, 3.0), torch.full_like(x, -1.0)
        q = fp8lab.quantize(x, fmt, gran, rule, out=out, dequantized_out=deq)
    assert same_bits(out, ref.values) and same_bits(deq, ref.dequantize())
    assert same_bits(q.scales, ref.scales)
    m = resolve_block(normalize_granularity(gran), BIG)[0]
    rects = 0 if gran == (3, 5) else 1 + (BIG[0] % m != 0)  # whole block rows, a ragged tail
    # ran, or its probe rejected it (as it did kernels loaded from another instruction set's cache)
    rejected = [k for k, ok in rounding_torch._compiled.items() if k[0] == "verified" and not ok]
    assert calls[0] == 2 * rects or (rects and rejected)


def test_compiled_quantize_equals_the_eager_passes(monkeypatch):
    """The same check without numba (so the FP8LAB_KERNELS=torch run makes it too): compiled
    against the eager torch passes, every layout of `COMPILED`, with a dequantized copy."""
    x = edge_tensor(BIG, seed=32)
    x[torch.isnan(x) | torch.isinf(x)] = 7.0
    with using_kernels("torch"):
        got = [fp8lab.quantize(x, f, g, r, dequantized_out=torch.empty_like(x))
               for f, g, r in COMPILED]  # fmt: skip
        monkeypatch.setattr(rounding_torch, "COMPILE_MIN", 1 << 62)
        want = [fp8lab.quantize(x, f, g, r, dequantized_out=torch.empty_like(x))
                for f, g, r in COMPILED]  # fmt: skip
    for a, b, spec in zip(got, want, COMPILED, strict=True):
        assert same_bits(a.values, b.values) and same_bits(a.dequantize(), b.dequantize()), spec


def test_compiled_quantize_compiles_once_per_layout():
    """Views with other bases, offsets and shapes of one layout (here [rows * c, 128] for 1x128
    blocks) reuse the probed kernel: no recompile per caller (dynamo guarded on a view's base
    before the kernel took detached tensors)."""
    from torch._dynamo.utils import counters

    big = torch.randn(1000, 512, generator=torch.Generator().manual_seed(34))
    with using_kernels("torch"):
        fp8lab.quantize(big[:300].clone(), "e4m3", (1, 128))
        graphs = counters["stats"]["unique_graphs"]
        fp8lab.quantize(big[100:400], "e4m3", (1, 128))
        fp8lab.quantize(big[3:260].view(-1, 256), "e4m3", (1, 128), out=torch.empty(514, 256))
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_quantize_probes_each_global_mode():
    """dynamo compiles a kernel per grad mode and inference mode: the kernels always run without
    grad (no second kernel), and an inference-mode call probes its own kernel before use."""
    from torch._dynamo.utils import counters

    x = edge_tensor(BIG, seed=35)
    with using_kernels("torch"):
        ref = fp8lab.quantize(x, "e4m3", (1, 128))
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            a = fp8lab.quantize(x, "e4m3", (1, 128))
        assert counters["stats"]["unique_graphs"] == graphs
        with torch.inference_mode():
            b = fp8lab.quantize(x, "e4m3", (1, 128), out=torch.empty_like(x))
    modes = [k[-1] for k in rounding_torch._compiled if isinstance(k, tuple) and k[0] == "verified"]
    assert (True, False) in modes
    assert same_bits(a.values, ref.values) and same_bits(b.values, ref.values)


def test_a_compiled_quantize_that_disagrees_is_not_used(monkeypatch):
    """A compiled scaled cast is used only after it gave the eager passes' bits on its probe (as
    the compiled cast: inductor's AVX2 code once did not): a wrong one is caught, warned about,
    and never used; the verdict is remembered per layout."""

    def wrong(x4, mult4, out4, *args):
        kernels_torch._cast_rect(x4, mult4, out4, *args)
        out4.view(torch.int32).bitwise_xor_(1)

    monkeypatch.setattr(rounding_torch, "_compiled", {"quantize": wrong})
    x = edge_tensor(BIG, seed=33)
    with using_kernels("torch"):
        with pytest.warns(RuntimeWarning, match="kernel for quantize gave different bits"):
            got = fp8lab.quantize(x, "e4m3", (1, 128))
        again = fp8lab.quantize(x, "e4m3", (1, 128))  # remembered: no second warning
        monkeypatch.setattr(rounding_torch, "COMPILE_MIN", 1 << 62)
        eager = fp8lab.quantize(x, "e4m3", (1, 128))
    assert same_bits(got.values, eager.values) and same_bits(again.values, eager.values)
    verdicts = [ok for k, ok in rounding_torch._compiled.items() if k[0] == "verified"]
    assert verdicts == [False]


@pytest.mark.numba_only
def test_retile_and_dequantize_bits():
    x = edge_tensor(seed=6)
    for rule in ("max", "pow2_down", "mx_even"):
        gran = "mx" if rule.startswith("mx") else (1, 128)
        q = fp8lab.quantize(x, "e4m3", gran, rule)
        ra, rb = both(fp8lab.retile, q)
        assert same_bits(ra.values, rb.values) and same_bits(ra.scales, rb.scales)
        ea, eb = ra.meta["retile_added_error"], rb.meta["retile_added_error"]
        assert ea == eb, rule
    v = x.contiguous()
    sc = torch.rand(3, 4) * 8
    a, b = both(mul_blocks, v, sc, 87, 98)
    assert same_bits(a, b)
    a, b = both(max_abs_diff, x, x * 1.001)
    assert a == b


@pytest.mark.numba_only
def test_delayed_scaling_bits_over_steps():
    x = edge_tensor(seed=12)
    x[torch.isnan(x)] = 0.0
    results = {}
    for kernels in ("numba", "torch"):
        with using_kernels(kernels):
            ds = DelayedScaling(history_len=4, margin=1, first_step="current")
            spec = QuantSpec(format="e4m3", granularity="tensor", scaling=ds)
            vals = []
            for step in range(5):
                q = fp8lab.quantize(x * (1 + step) ** 3, spec)
                ds.update()
                vals.append(q.values)
            results[kernels] = (vals, ds.state_dict())
    for va, vb in zip(results["numba"][0], results["torch"][0], strict=True):
        assert same_bits(va, vb)
    for key, t in results["numba"][1].items():
        assert torch.equal(t, results["torch"][1][key]), key


@pytest.mark.numba_only
def test_clip_counts_and_error_stats():
    x = edge_tensor(seed=13)
    for spec in ("e4m3:tensor", "e4m3:1x128", "mxfp8", "e5m2"):
        q = fp8lab.quantize(x, fp8lab.stats.parse_spec(spec))
        a, b = both(clip_percentages, x, q)
        assert a == b, spec  # counts: exact
    y = torch.randn(300, 500, dtype=torch.float64) * 10
    q = fp8lab.quantize(y, "e4m3", (1, 128))
    xq, v = q.dequantize(), q.values
    sa, sb = both(error_stats, y, xq, "e4m3", v)
    for key in ("amax", "dynamic_range", "underflow_pct", "saturation_pct", "nonzero_pct", "numel"):
        assert sa[key] == sb[key], key
    # float64 sums in another order: within n * eps64 relative (n = 150000: < 2e-11)
    for key in ("sqnr_db", "cosine", "rel_error"):
        assert abs(sa[key] - sb[key]) <= 150000 * 2.0**-52 * abs(sa[key]), key


def test_the_dispatch_is_counted():
    x = torch.randn(8, 64)
    kernel_counts(reset=True)
    with using_kernels("torch"):
        fp8lab.quantize(x, "e4m3", (1, 32), "mx_floor")
    counts = kernel_counts(reset=True)
    assert counts["torch"] >= 3 and counts["numba"] == 0  # amax, rule, cast


# ------------------------------------------------------------------ devices
def test_quantize_on_the_meta_device_creates_nothing_on_the_cpu():
    # every tensor of the torch path follows x's device: on "meta" a CPU constant would raise
    x = torch.empty(64, 256, device="meta")
    for gran, rule in (((1, 128), "max"), ("mx", "mx_floor"), ("mx", "mx_rceil"),
                       ((128, 128), "pow2_down"), ("tensor", 2.0)):  # fmt: skip
        q = fp8lab.quantize(x, "e4m3", gran, rule)
        assert q.values.device.type == "meta" and q.scales.device.type == "meta"
        assert q.dequantize().device.type == "meta"
    ds = DelayedScaling(history_len=4)  # created on the CPU: moves to the tensor's device
    others = [fp8lab.quantize(x, "e2m1", "nvfp4", "nvfp4"), fp8lab.quantize(x, "hif8"),
              fp8lab.quantize(x, QuantSpec(format="e4m3", scaling=ds)),
              fp8lab.retile(fp8lab.quantize(x, "e4m3", (1, 128)), measure_error=False)]  # fmt: skip
    for q in others:
        assert q.values.device.type == "meta" and q.dequantize().device.type == "meta"
    assert ds.device.type == "meta"


def test_buffers_on_another_device_are_refused():
    x = torch.randn(8, 64, device="meta")
    with pytest.raises(ValueError, match="out must be a contiguous float32 tensor on x's device"):
        fp8lab.quantize(x, "e4m3", out=torch.empty(8, 64))


def test_numba_refuses_a_non_cpu_tensor():
    with using_kernels("numba"), pytest.raises(ValueError, match="cannot run the numba kernels"):
        fp8lab.quantize(torch.empty(8, 64, device="meta"), "e4m3")


def test_delayed_state_moves_and_loads_on_either_device(tmp_path):
    ds = DelayedScaling(history_len=8, fmt="e4m3")
    fp8lab.quantize(torch.randn(4, 32), QuantSpec(format="e4m3", scaling=ds))
    ds.update()
    assert ds.device.type == "cpu" and ds.to("meta") is ds
    assert ds.amax_history.device.type == "meta" and ds.scale.device.type == "meta"
    ds2 = DelayedScaling(history_len=8, fmt="e4m3")
    fp8lab.quantize(torch.randn(4, 32), QuantSpec(format="e4m3", scaling=ds2))
    ds2.update()
    buf = io.BytesIO()
    torch.save(ds2.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, map_location="cpu", weights_only=True)
    fresh = DelayedScaling(history_len=8)
    fresh.load_state_dict(state)
    for key, t in ds2.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], t), key


@CUDA
def test_cuda_quantize_equals_cpu_numba():
    x = edge_tensor(seed=21)
    for fmt in ("e4m3", "e5m2", "e2m1", "hif8"):
        for gran, rule in (((1, 128), "max"), ((128, 128), "pow2_down"), ("mx", "mx_floor"),
                           ("mx", "mx_rceil"), ("tensor", "max"), ("nvfp4", "nvfp4")):  # fmt: skip
            ref = fp8lab.quantize(x, fmt, gran, rule)
            q = fp8lab.quantize(x.cuda(), fmt, gran, rule)
            assert q.values.is_cuda and q.scales.is_cuda
            assert same_bits(q.values, ref.values), (fmt, gran, rule)
            assert same_bits(q.scales, ref.scales) and same_bits(q.dequantize(), ref.dequantize())


@CUDA
def test_cuda_delayed_state_follows_the_tensor_and_loads_on_cpu():
    ds = DelayedScaling(history_len=4, fmt="e4m3")
    spec = QuantSpec(format="e4m3", scaling=ds)
    ref = DelayedScaling(history_len=4, fmt="e4m3")
    x = torch.randn(64, 128) * 5
    for step in range(3):
        q = fp8lab.quantize(x.cuda() * (step + 1), spec)
        r = fp8lab.quantize(x * (step + 1), QuantSpec(format="e4m3", scaling=ref))
        assert ds.device.type == "cuda" and same_bits(q.values, r.values)
        ds.update()
        ref.update()
    buf = io.BytesIO()
    torch.save(ds.state_dict(), buf)
    buf.seek(0)
    back = DelayedScaling(history_len=4)
    back.load_state_dict(torch.load(buf, map_location="cpu", weights_only=True))
    for key, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], t), key
