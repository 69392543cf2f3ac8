"""NVFP4 at Transformer Engine parity: plain 1x16 / 16x16, "4 over 6" (MAE, MSE; bounds 256,
448), row-scaled second level, and the random Hadamard transform, bit for bit against an
independent plain-torch transcription of TE's pure-PyTorch reference quantizer
(``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``: ``NVFP4QuantizerRef``).

The reference below is written from that file's algorithm with torch ops only (torch's own
float8_e4m3fn cast, TE's threshold table for E2M1); it never calls fp8lab's code. It differs
from TE's file in one documented place: at a global amax of 0, TE's global encode scale is
FLT_MAX, fp8lab's is 1 (`fp8lab.scaling.rules.nvfp4_scales`); the codes and scale bytes agree.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8lab
from fp8lab import QuantSpec, quantize

FLT_MAX = torch.finfo(torch.float32).max
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TE_SIGNS = [
    1.0,
    1.0,
    1.0,
    -1.0,
    1.0,
    -1.0,
    -1.0,
    -1.0,
    -1.0,
    -1.0,
    -1.0,
    1.0,
    -1.0,
    1.0,
    -1.0,
    -1.0,
]


# ------------------------------------------------------------------ TE's reference, transcribed
def te_fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """TE's cast_to_fp4x2 thresholds (RNE onto E2M1 of a value already clamped to +-6), one code
    per element (not packed)."""
    r = torch.zeros_like(v, dtype=torch.uint8)
    pos = [(0.0, 0.25, True, True, 0), (0.25, 0.75, False, False, 1), (0.75, 1.25, True, True, 2),
           (1.25, 1.75, False, False, 3), (1.75, 2.5, True, True, 4), (2.5, 3.5, False, False, 5),
           (3.5, 5.0, True, True, 6)]  # fmt: skip
    for lo, hi, lo_in, hi_in, c in pos:
        a = (v >= lo) if lo_in else (v > lo)
        b = (v <= hi) if hi_in else (v < hi)
        r[a & b] = c
    r[v > 5.0] = 7
    for lo, hi, lo_in, hi_in, c in pos:
        a = (v <= -lo) if lo_in else (v < -lo)
        b = (v >= -hi) if hi_in else (v > -hi)
        if c == 0:
            a = v < -0.0
        r[a & b] = c + 8
    r[v < -5.0] = 15
    return r


def te_fp4_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32)
    return table[codes.long()]


def te_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def te_quantize_rows(x, tile_y, g_amax, *, fos=None, bound=448.0):
    """TE's _quantize_blockwise_reference on a 2-D float32 x (multiple of the tile): (codes
    [m, n], E4M3 block scales [m, n/16] as float8, global decode scale). ``g_amax``: a 0-d
    tensor, or [m] per row (row-scaled)."""
    m, n = x.shape
    nb = n // 16
    if tile_y == 16:
        t = x.unfold(0, 16, 16).unfold(1, 16, 16)
        vec_max = t.abs().amax(dim=(-1, -2)).repeat_interleave(16, dim=0).unsqueeze(-1)
    else:
        vec_max = x.view(m, nb, 16).abs().amax(dim=-1, keepdim=True)
    x3 = x.view(m, nb, 16)
    six = torch.tensor(6.0)
    gmax = torch.tensor(bound if fos else 448.0)
    ga = g_amax.view(m, 1, 1) if g_amax.dim() else g_amax
    g_enc = torch.min(torch.div(gmax * six, ga), torch.tensor(FLT_MAX))
    # TE: a 0 encode scale becomes 1; fp8lab also takes 1 at amax 0 (TE: FLT_MAX), see module doc
    g_enc = torch.where((g_enc == 0) | (ga == 0), torch.ones_like(g_enc), g_enc)
    g_dec = torch.div(1.0, g_enc)
    if fos is None:
        dec = vec_max * (g_enc * torch.reciprocal(six))
        sf = te_e4m3(torch.min(dec, torch.tensor(FLT_MAX)))
        enc = torch.min(torch.div(1.0, sf.float() * g_dec), torch.tensor(FLT_MAX))
        codes = te_fp4_codes(torch.clamp(x3 * enc, -6.0, 6.0)).view(m, n)
        return codes, sf.squeeze(-1), g_dec
    base = torch.div(vec_max, six) * g_enc
    cands = []
    for dec in (base * 1.5, base):  # map-to-4, map-to-6
        sf = te_e4m3(dec)
        enc = torch.min(torch.div(1.0, sf.float() * g_dec), torch.tensor(FLT_MAX))
        codes = te_fp4_codes(torch.clamp(x3 * enc, -6.0, 6.0))
        vals = te_fp4_values(codes)
        err = torch.zeros_like(vec_max)
        denom = six * gmax
        e_amax = ga.squeeze(-1) if ga.dim() else ga
        for i in range(16):
            v = vals[:, :, i] * sf.float().squeeze(-1)
            v = v * e_amax
            v = v / denom
            d = v - x3[:, :, i]
            err = err + ((d * d) if fos == "mse" else d.abs()).unsqueeze(-1)
        cands.append((sf, codes, err))
    (sf4, c4, e4), (sf6, c6, e6) = cands
    if tile_y == 1:
        pick4 = e4 < e6
    else:

        def tree(e):
            r = e.view(m // 16, 16, nb)
            r = r[:, 0:8] + r[:, 8:16]
            r = r[:, 0:4] + r[:, 4:8]
            r = r[:, 0:2] + r[:, 2:4]
            return (r[:, 0] + r[:, 1]).unsqueeze(-1)

        pick4 = (tree(e4) < tree(e6)).repeat_interleave(16, dim=0)
    codes = torch.where(pick4, c4, c6).view(m, n)
    sf = torch.where(pick4, sf4.float(), sf6.float()).to(torch.float8_e4m3fn)
    return codes, sf.squeeze(-1), g_dec


def te_quantize(x, tile_y=1, *, fos=None, bound=448.0, row_scaled=False):
    g_amax = x.abs().amax(dim=1) if row_scaled else x.abs().amax()
    codes, sf, g_dec = te_quantize_rows(x, tile_y, g_amax, fos=fos, bound=bound)
    # TE repeats a 16x16 tile's scale on each of its 16 rows: one per tile here
    return codes, sf[::tile_y], g_dec


def te_rht(x_bf16: torch.Tensor) -> torch.Tensor:
    """TE's _apply_rht: x.view(-1, 16) @ (sign-masked Sylvester H in x's dtype * 1/4)."""
    h = torch.ones((1, 1))
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    h = (torch.tensor(TE_SIGNS) * torch.eye(16)) @ h
    transform = h.to(x_bf16.dtype) * (1.0 / 16**0.5)
    return (x_bf16.contiguous().view(-1, 16) @ transform).view(x_bf16.shape)


# ------------------------------------------------------------------ fp8lab's side, as bytes
def fp8lab_codes(q) -> torch.Tensor:
    """Codes of fp8lab's E2M1 values by table lookup (sign bit + index of |v|)."""
    v = q.values.reshape(q.values.shape[0], -1)
    idx = torch.zeros_like(v, dtype=torch.uint8)
    for i, e in enumerate(E2M1):
        idx[v.abs() == e] = i
    return idx + 8 * torch.signbit(v).to(torch.uint8)


def check_same(q, ref, *, transpose=False):
    codes, sf, g_dec = ref
    got_codes = fp8lab_codes(q)
    got_sf = q.scales.to(torch.float8_e4m3fn)
    assert torch.equal(q.scales.to(torch.float8_e4m3fn).float(), q.scales)  # on the E4M3 grid
    g = q.global_scale
    if transpose:
        got_codes, got_sf = got_codes.t(), got_sf.t()
        g = g.t() if g.dim() == 2 else g
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_sf.view(torch.uint8), sf.view(torch.uint8))
    assert torch.equal(g.reshape(-1).view(torch.int32), g_dec.reshape(-1).view(torch.int32))


def tensors():
    g = torch.Generator().manual_seed(7)
    rnd = torch.randn(32, 32, generator=g) * torch.exp(torch.randn(32, 32, generator=g))
    huge = torch.randn(32, 32, generator=g)
    huge[5, 7] = 1e30  # every other block's E4M3 scale underflows
    sub = torch.randn(32, 32, generator=g)
    sub[:16, :16] = torch.randn(16, 16, generator=g) * 1e-40  # FP32 subnormal blocks
    sub[16:, 16:32] = 2.0**-149
    equal = torch.full((32, 32), 0.37)
    equal[:, 16:32] = -2.5
    # ties between the maps: blocks whose map-to-6 and map-to-4 errors are equal (both exact)
    ties = torch.zeros(32, 32)
    ties[:, 0::16] = 6.0
    ties[:, 1::16] = 3.0
    ties[:, 2::16] = -1.5
    ties[::2, 16:32] *= 0.5
    # values on E2M1's rounding midpoints after scaling by 1
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4).repeat(32, 1)
    mids[1::2] *= -1
    # block amaxes where the two orders of the pre-cast block scale, fl32(amax / 6) * g_enc
    # (4over6) and amax * fl32(g_enc * fl32(1/6)) (plain), give different E4M3 scales
    order = torch.randn(32, 32, generator=g) * 1e-6
    order[0, 0] = 7.0  # the tensor amax
    # candidates: a few FP32 ulps around each amax whose scale lands on an E4M3 midpoint
    e, j = torch.meshgrid(torch.arange(-6, 9.0), torch.arange(8.0), indexing="ij")
    mid = (torch.exp2(e) * (1 + (2 * j + 1) / 16)).reshape(-1)
    hits = []
    for bound in (256.0, 448.0, 448.0 * 1.5):
        g_enc = torch.tensor(bound * 6) / torch.tensor(7.0)
        a0 = (mid * 6 / g_enc).view(torch.int32)
        a = (a0[:, None] + torch.arange(-3, 4)).reshape(-1).view(torch.float32)
        a = a[a < 7.0]
        one = (torch.div(a, 6.0) * g_enc).clamp(max=448).to(torch.float8_e4m3fn).float()
        two = (a * (g_enc * torch.reciprocal(torch.tensor(6.0)))).clamp(max=448)
        hits.append(a[one != two.to(torch.float8_e4m3fn).float()][:21])
    hits = torch.cat(hits)[:63]
    assert len(hits) > 30
    order.view(-1, 16)[1 : 1 + len(hits), 3] = hits
    return {"random": rnd, "huge": huge, "orders": order, "subnormal": sub, "equal": equal,
            "ties": ties, "midpoints": mids, "zeros": torch.zeros(32, 32)}  # fmt: skip


TENSORS = tensors()


@pytest.mark.parametrize("name", list(TENSORS))
def test_plain_1x16_and_16x16(name):
    x = TENSORS[name]
    check_same(quantize(x, "e2m1", "nvfp4", "nvfp4"), te_quantize(x))
    check_same(quantize(x, "e2m1", (16, 16), "nvfp4"), te_quantize(x, 16))


@pytest.mark.parametrize("name", list(TENSORS))
def test_four_over_six(name):
    x = TENSORS[name]
    combos = [("mae", True), ("mse", False), ("mse", True), ("mae", False)]
    for i, (mode, use_256) in enumerate(combos):
        bound = 256.0 if use_256 else 448.0
        kw = {"four_over_six": mode, "four_over_six_use_256": use_256}
        ref = te_quantize(x, fos=mode, bound=bound)
        check_same(quantize(x, "e2m1", "nvfp4", "nvfp4", **kw), ref)
        if i >= 2:
            continue  # 16x16 and the column-wise copy: both modes, both bounds, once each
        check_same(quantize(x, "e2m1", (16, 16), "nvfp4", **kw),
                   te_quantize(x, 16, fos=mode, bound=bound))  # fmt: skip
        # the column-wise copy: TE quantizes the transpose with 1x16 blocks
        q = quantize(x, "e2m1", "nvfp4_col", "nvfp4", **kw)
        check_same(q, te_quantize(x.t().contiguous(), fos=mode, bound=bound), transpose=True)


@pytest.mark.parametrize("name", ["random", "huge", "subnormal", "zeros"])
def test_row_scaled(name):
    x = TENSORS[name].clone()
    x[3] = 0.0  # a zero row
    check_same(
        quantize(x, "e2m1", "nvfp4", "nvfp4", row_scaled=True), te_quantize(x, row_scaled=True)
    )
    q = quantize(x, "e2m1", "nvfp4_col", "nvfp4", row_scaled=True)  # per-column amaxes
    check_same(q, te_quantize(x.t().contiguous(), row_scaled=True), transpose=True)
    ref = te_quantize(x, fos="mse", bound=256.0, row_scaled=True)
    check_same(quantize(x, "e2m1", "nvfp4", "nvfp4", row_scaled=True, four_over_six="mse"), ref)
    # the QTensor dequantizes with its per-row scale, and its transpose keeps them aligned
    q = quantize(x, "e2m1", "nvfp4", "nvfp4", row_scaled=True)
    assert q.global_scale.shape == (32, 1)
    assert torch.equal(q.t().dequantize(), q.dequantize().t())


def test_all_zero_tensor_scale_is_one_where_te_takes_flt_max():
    q = quantize(torch.zeros(16, 32), "e2m1", "nvfp4", "nvfp4", four_over_six="mae")
    assert float(q.global_scale) == 1.0 and not q.values.any() and not q.scales.any()


# ------------------------------------------------------------------ RHT
def exact_blocks(seed=0, shape=(8, 64)) -> torch.Tensor:
    """BF16 blocks whose FP32 sums are exact in any order: small integers times a power of two
    per block (|sum| < 2**24 units)."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-127, 128, shape, generator=g).float()
    exps = torch.randint(-130, 100, (shape[0], shape[1] // 16), generator=g).float()
    return (ints * torch.exp2(exps).repeat_interleave(16, dim=1)).to(torch.bfloat16)


def test_rht16_bit_identical_to_the_matmul_reference_where_the_fp32_sum_is_exact():
    xb = exact_blocks()
    # the precondition: every partial sum of the products is exact in FP32 (checked in float64)
    m = fp8lab.qtensor.transforms.hadamard_matrix(16).double()
    prods = xb.double().view(-1, 16)[:, :, None] * m[None]
    partial = prods.cumsum(dim=1)
    assert torch.equal(partial.float().double(), partial)
    got = fp8lab.rht16(xb)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), te_rht(xb).view(torch.int16))


def test_rht16_within_one_bf16_ulp_of_the_reference_elsewhere():
    g = torch.Generator().manual_seed(3)
    xb = (torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 128, generator=g))).to(
        torch.bfloat16
    )
    got, ref = fp8lab.rht16(xb).float(), te_rht(xb).float()
    ulp = torch.where(
        ref == 0, torch.tensor(2.0**-133), torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)
    )
    assert ((got - ref).abs() <= ulp).all()


def test_rht16_hand_derived():
    # 4 * e_3: row 3 of the Sylvester matrix times sign[3] = -1, times 1/4 * 4
    x = torch.zeros(16)
    x[3] = 4.0
    assert fp8lab.rht16(x).float().tolist() == [-1.0, 1.0, 1.0, -1.0] * 4
    # all ones: y_0 = (sum of the signs) / 4 = (6 - 10) / 4
    assert float(fp8lab.rht16(torch.ones(16))[0]) == -1.0
    # the input is rounded to BF16 first: 1 + 2**-9 is a BF16 tie, rounding to 1
    assert torch.equal(fp8lab.rht16(torch.full((16,), 1 + 2**-9)), fp8lab.rht16(torch.ones(16)))
    # the products stay exact down to BF16's smallest subnormal, and the result keeps subnormals
    x = torch.zeros(16)
    x[0] = 2.0**-131
    assert float(fp8lab.rht16(x)[0]) == 2.0**-133


def test_quantize_with_rht_is_the_plain_path_on_the_transformed_tensor():
    x = TENSORS["random"]
    t = fp8lab.rht16(x).float()
    q = quantize(x, "e2m1", "nvfp4", "nvfp4", rht=True)
    check_same(q, te_quantize(t))  # global amax after the transform
    assert torch.equal(q.dequantize(), quantize(t, "e2m1", "nvfp4", "nvfp4").dequantize())
    # the wgrad operands' column-wise copy: transformed along the first axis, as TE transforms
    # the transpose along its rows
    q = quantize(x, "e2m1", "nvfp4_col", "nvfp4", rht=True, row_scaled=False)
    tc = fp8lab.rht16(x.t().contiguous()).float()
    check_same(q, te_quantize(tc), transpose=True)
    assert QuantSpec("e2m1", "nvfp4", "nvfp4", rht=True) == q.spec.transposed()
    # values in the transformed domain: no straight-through gradient back to x
    xg = x.clone().requires_grad_(True)
    assert not quantize(xg, "e2m1", "nvfp4", "nvfp4", rht=True).dequantize().requires_grad
    assert quantize(xg, "e2m1", "nvfp4", "nvfp4").dequantize().requires_grad


# ------------------------------------------------------------------ 4over6 by hand
def test_four_over_six_hand_derived():
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([6.0, 5.0])
    # bound 256: g_enc = 1536 / 6 = 256; sf6 = 256, sf4 = 384. map-to-6: 5 -> 4 (tie to even),
    # error 1; map-to-4: 6 * (1/1.5) -> 4, 5 * (1/1.5) = 3.33 -> 3, dequantized 4.5, error 0.5
    q = quantize(x, "e2m1", "nvfp4", "nvfp4", four_over_six="mae")
    assert q.values[0, :2].tolist() == [4.0, 3.0] and float(q.scales[0, 0]) == 384.0
    assert float(q.global_scale) == 1 / 256
    # [6, 3]: both maps exact, errors tie at 0: map-to-6
    x[0, 1] = 3.0
    q = quantize(x, "e2m1", "nvfp4", "nvfp4", four_over_six="mse")
    assert q.values[0, :2].tolist() == [6.0, 3.0] and float(q.scales[0, 0]) == 256.0
    # bound 448: sf6 = 448, sf4 = clamp(672) = 448: one candidate, map-to-6
    x[0, 1] = 5.0
    q = quantize(x, "e2m1", "nvfp4", "nvfp4", four_over_six="mae", four_over_six_use_256=False)
    assert q.values[0, :2].tolist() == [6.0, 4.0] and float(q.scales[0, 0]) == 448.0


# ------------------------------------------------------------------ Quartet: hadamard=32, QuEST
def test_hadamard32_and_quest_rule():
    h = fp8lab.qtensor.transforms.hadamard_matrix(32)
    assert h.dtype == torch.bfloat16 and float(h[0, 0]) == 0.1767578125  # bf16(1/sqrt(32))
    x = torch.zeros(1, 32)
    x[0, 1] = 1.0
    assert fp8lab.hadamard_transform(x).float().tolist()[0] == [0.1767578125, -0.1767578125] * 16
    xb = exact_blocks(1, (4, 64))  # exact sums: any order
    sylv = torch.ones((1, 1))
    while sylv.shape[0] < 32:
        sylv = torch.cat([torch.cat([sylv, sylv], 1), torch.cat([sylv, -sylv], 1)], 0)
    ref = (xb.view(-1, 32) @ (sylv.to(torch.bfloat16) * 0.1767578125)).view(xb.shape)
    assert torch.equal(fp8lab.hadamard_transform(xb).view(torch.int16), ref.view(torch.int16))
    # QuEST (Quartet's forward): X = 2**floor(log2(fl32(2.92247856/6) * std + 1e-8))
    blk = torch.tensor([1.0, -1.0] * 16)  # std 1: 0.487 -> X = 2**-2, elements x / X = +-4
    x = torch.stack([blk, torch.zeros(32), torch.full((32,), 5.0), blk * 3])
    q = quantize(x, "e2m1", "mx", "quest")
    assert q.scales[:, 0].tolist() == [2.0**-2, 2.0**-27, 2.0**-27, 1.0]  # 3 * 0.487 = 1.46
    assert q.values[0].abs().unique().tolist() == [4.0]
    assert q.values[2].unique().tolist() == [6.0]  # std 0: everything clips (trust region)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=g).double()
    q = quantize(x.float(), "e2m1", "mx", "quest", hadamard=32)
    t = fp8lab.hadamard_transform(x.float()).double().view(8, 2, 32)
    std = (t.pow(2).mean(-1) - t.mean(-1).pow(2)).sqrt().float()
    s = torch.tensor(2.92247856 / 6, dtype=torch.float32) * std + torch.tensor(1e-8)
    assert torch.equal(q.scales, torch.exp2(torch.floor(torch.log2(s))))


# ------------------------------------------------------------------ bad input
@pytest.mark.no_arithmetic
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"format": "e4m3", "rht": True}, "rht=True"),
        ({"scaling": "mx_floor", "four_over_six": "mae"}, "four_over_six='mae'"),
        ({"format": "e4m3", "row_scaled": True}, "row_scaled=True"),
        ({"rht": True, "four_over_six": "mae"}, "not combine"),
        ({"granularity": (16, 16), "rht": True}, "16x1"),
        ({"granularity": (16, 16), "row_scaled": True}, "row_scaled=True"),
        ({"four_over_six": "l2"}, "'l2'"),
        ({"four_over_six_use_256": True}, "without four_over_six"),
        ({"hadamard": 24}, "24"),
        ({"two_level": False, "rht": True}, "two_level"),
    ],
)
def test_spec_errors_name_the_field_and_value(kw, words):
    args = {"format": "e2m1", "granularity": "nvfp4", "scaling": "nvfp4", **kw}
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        QuantSpec(**args)


@pytest.mark.no_arithmetic
def test_transform_dimension_errors():
    with pytest.raises(ValueError, match=r"rht=True.*columns.*40.*multiple of 16"):
        quantize(torch.ones(4, 40), "e2m1", "nvfp4", "nvfp4", rht=True)
    with pytest.raises(ValueError, match=r"rht=True.*rows.*24.*multiple of 16"):
        quantize(torch.ones(24, 32), "e2m1", "nvfp4_col", "nvfp4", rht=True)
    with pytest.raises(ValueError, match=r"hadamard=32.*48.*multiple of 32"):
        quantize(torch.ones(2, 48), "e2m1", "mx", "quest", hadamard=32)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8lab.rht16(torch.ones(3, 8))
    q = quantize(torch.ones(16, 16), "e2m1", "nvfp4", "nvfp4", rht=True)
    with pytest.raises(ValueError, match=r"retile: .*rht=True"):
        fp8lab.retile(q)


def test_spec_round_trips_and_old_dicts_stay():
    for kw in ({"rht": True}, {"four_over_six": "mse", "four_over_six_use_256": False},
               {"row_scaled": True}, {"four_over_six": "mae"}):  # fmt: skip
        s = QuantSpec("e2m1", "nvfp4", "nvfp4", **kw)
        assert QuantSpec.from_dict(s.to_dict()) == s
        assert all(f"{k}=" in s.describe() for k in kw)
    s = QuantSpec("e2m1", "mx", "quest", hadamard=32)
    assert s.to_dict()["hadamard"] == 32 and QuantSpec.from_dict(s.to_dict()) == s
    plain = QuantSpec("e2m1", "nvfp4", "nvfp4").to_dict()
    assert not {"rht", "four_over_six", "four_over_six_use_256", "row_scaled", "hadamard"} & set(
        plain
    )
    assert QuantSpec("e2m1", "nvfp4", "nvfp4", four_over_six="MAE").four_over_six_bound == 256.0
    assert math.isclose(QuantSpec("e2m1", "nvfp4", "nvfp4").epsilon, 0.0)
