"""`fp8lab.nn.DotProductAttention` against a plain-torch reference of TE's FP8 attention.

The reference is written here from TE's and cuDNN's documented algorithm, not from fp8lab:

* TE's per-tensor quantizers (``Float8Quantizer`` / ``Float8CurrentScalingQuantizer``): codes
  ``= satfinite_cast(x * scale)``; current scaling ``scale = fp8_max / amax`` (amax 0 -> 1);
  delayed scaling: scale 1 on the first step, then ``fp8_max / amax`` of the history (one
  step here, so ``max`` and ``most_recent`` agree); Q, K and V share one quantizer
  (``combine_and_quantize``), so one scale; dQ, dK, dV too.
* TE's MXFP8 quantizer: 32-element blocks along the reduced dimension, the E8M0 scale
  ``2**ceil(log2(fl32(amax * fl32(1/fp8_max))))`` (TE ``quantize_mxfp8``), codes
  ``satfinite_cast(x / scale)``.
* cuDNN's FP8 SDPA graphs (cudnn-frontend ``sdpa_fp8_bwd.h``): ``P = exp(logits - stats)``,
  S = quantize(P); O = S V; dS = P * (dO Vᵀ - rowsum(dO * O)) * attn_scale quantized by the dP
  quantizer; dQ = dS K, dK = dSᵀ Q, dV = Sᵀ dO.

Every quantization point is compared bit for bit (codes and scales) given the fp32 tensor the
module fed it; the fp32 tensors themselves (the GEMM and softmax results) are compared with a
float64 recomputation from the reference's quantized operands within the fp32 accumulation
bound ``gamma_n * sum |a_i b_i|`` (``gamma_n = n u / (1 - n u)``, ``u = 2**-24``; docs/attention.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8lab.nn import DotProductAttention, on_operand
from fp8lab.recipe import DPAConfig, Recipe, RecipeFileError, get_recipe

U = 2.0**-24


@pytest.fixture(autouse=True)
def _one_thread(threads):
    """These GEMMs are tiny: one torch thread is ~10x faster than two on a busy 2-core machine."""
    torch.set_num_threads(1)


F8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def gemm_gamma(n: int) -> float:
    """A length-``n`` fp32 dot product of operands dequantized in fp32 (``values * scale_inv``,
    one rounding each): ``gamma(n + 2)`` relative to ``sum |a_i b_i|`` of the exact operands."""
    return gamma(n + 2)


# --------------------------------------------------------------------------- reference quantizers
def ref_tensor(x: torch.Tensor, fmt: str, scale: torch.Tensor):
    """Per-tensor: (codes uint8, dequantized float64) for the float32 quantization multiplier."""
    dt, fmax = F8[fmt]
    codes = (x * scale).clamp(-fmax, fmax).to(dt)
    inv = torch.tensor(1.0, dtype=torch.float32) / scale
    return codes.view(torch.uint8), codes.double() * inv.double(), inv


def current_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    fmax = torch.tensor(F8[fmt][1], dtype=torch.float32)
    return torch.where(amax > 0, fmax / amax, torch.tensor(1.0))


def ref_mx(x: torch.Tensor, fmt: str):
    """Blocks of 32 along the last dim (ragged end zero-padded): (codes, dequantized, scale_inv
    per block as [rows, blocks], amax per block)."""
    dt, fmax = F8[fmt]
    r = x.reshape(-1, x.shape[-1])
    n = r.shape[1]
    nb = -(-n // 32)
    pad = torch.zeros(r.shape[0], nb * 32, dtype=torch.float32)
    pad[:, :n] = r
    blocks = pad.view(r.shape[0], nb, 32)
    amax = blocks.abs().amax(-1)
    q = amax * (torch.tensor(1.0) / torch.tensor(fmax))  # fl32(amax * fl32(1/fmax))
    m, e = torch.frexp(q)
    e = torch.where(m == 0.5, e - 1, e).clamp(-127, 127)  # ceil(log2 q), exact
    inv = torch.ldexp(torch.ones_like(q), e)
    codes = (blocks / inv[..., None]).clamp(-fmax, fmax).to(dt)
    deq = (codes.double() * inv[..., None].double()).view(r.shape[0], nb * 32)[:, :n]
    flat_codes = codes.view(torch.uint8).view(r.shape[0], nb * 32)[:, :n]
    return flat_codes.reshape(x.shape), deq.reshape(x.shape), inv, amax


def codes_of(qt, fmt: str) -> torch.Tensor:
    return qt.values.to(F8[fmt][0]).view(torch.uint8)


# --------------------------------------------------------------------------- the run
MODES = {  # preset, [dpa], delayed slots, whether O and dQKV are quantized
    "delayed": ("te-delayed", DPAConfig(), {"QKV", "S", "O", "dO", "dP", "dQKV"}, True),
    "current": ("te-current", DPAConfig(), {"S", "dP"}, False),
    "current_mha": ("te-current", DPAConfig(fp8_mha=True), {"S", "dP"}, True),
    "mxfp8": ("mxfp8", DPAConfig(), set(), False),
}
SLOT = {"Q": "QKV", "K": "QKV", "V": "QKV", "S": "S", "O": "O", "dO": "dO", "dP": "dP",
        "dQKV": "dQKV"}  # fmt: skip

# 20 shapes: (batch, heads, seq_q, seq_kv, head_dim, causal); head dims 64/128, ragged lengths
SHAPES = [
    (1, 1, 5, 5, 64, True), (1, 2, 17, 17, 64, False), (2, 1, 33, 33, 64, True),
    (1, 1, 7, 40, 64, False), (1, 2, 40, 7, 64, True), (2, 2, 9, 9, 128, True),
    (1, 1, 31, 31, 128, False), (1, 1, 3, 65, 128, True), (1, 1, 65, 3, 128, False),
    (2, 1, 12, 12, 64, False), (1, 3, 1, 1, 64, True), (1, 1, 1, 37, 128, False),
    (1, 2, 29, 29, 128, True), (3, 1, 6, 11, 64, True), (1, 1, 48, 48, 64, True),
    (1, 1, 20, 13, 128, True), (2, 1, 15, 15, 128, False), (1, 2, 8, 24, 64, False),
    (1, 1, 36, 36, 128, True), (1, 1, 2, 50, 64, True),
]  # fmt: skip


def _recorder(rows: dict):
    """An `on_operand` observer keeping each role's fp32 source and the QTensor it became."""

    def record(layer, gemm, role, src, used) -> None:
        assert (layer, gemm) == ("att", "dpa")
        rows[role] = (src.detach().clone(), used)

    return record


def _run(mode: str, shape, seed: int, steps: int = 2):
    preset, cfg, delayed, out_q = MODES[mode]
    rec = get_recipe(preset).replace(attention=True, dpa=cfg)
    b, h, sq, skv, d, causal = shape
    m = DotProductAttention(rec, name="att")
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(steps):
        q, k, v = (torch.randn(b, h, s, d, generator=gen) * 2 for s in (sq, skv, skv))
        g = torch.randn(b, h, sq, d, generator=gen)
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        rows: dict[str, tuple[torch.Tensor, object]] = {}
        handle = on_operand(_recorder(rows))
        out = m(q, k, v, is_causal=causal)
        out.backward(g)
        handle.remove()
        runs.append((q.detach(), k.detach(), v.detach(), g, out.detach(), rows,
                     (q.grad, k.grad, v.grad)))  # fmt: skip
    return rec, delayed, out_q, runs


def _check(mode: str, shape, seed: int) -> None:
    rec, delayed, out_q, runs = _run(mode, shape, seed)
    mx = mode == "mxfp8"
    fwd, bwd = rec.input.format, rec.grad_output.format
    fmt = {"QKV": fwd, "S": fwd, "O": fwd, "dO": bwd, "dP": bwd, "dQKV": bwd}
    d = shape[4]
    sm = 1.0 / math.sqrt(d)
    prev_amax: dict[str, torch.Tensor] = {}
    for step, (q, k, v, g, out, rows, grads) in enumerate(runs):
        expected = {"Q", "K", "V", "S", "dO", "dP"} | ({"O", "dQKV"} if out_q else set())
        assert set(rows) == expected
        amax = {s: torch.stack([rows[r][0].abs().max() for r in rows if SLOT[r] == s]).max()
                for s in set(SLOT[r] for r in rows)}  # fmt: skip
        deq: dict[str, torch.Tensor] = {}
        for role, (src, qt) in rows.items():
            slot = SLOT[role]
            f = fmt[slot]
            if mx and slot not in ("S", "dP"):
                codes, dq, inv, bam = ref_mx(src, f)
                assert torch.equal(codes_of(qt, f), codes), (mode, shape, step, role)
                ok = bam > 0  # an all-zero block: no scale to compare
                assert torch.equal(qt.scales.reshape(inv.shape)[ok], inv[ok]), (role, step)
            else:
                if slot in delayed:
                    sc = torch.tensor(1.0) if step == 0 else current_scale(prev_amax[slot], f)
                else:
                    sc = current_scale(amax[slot], f)
                codes, dq, inv = ref_tensor(src, f, sc)
                assert torch.equal(codes_of(qt, f), codes), (mode, shape, step, role)
                assert torch.equal(qt.scale_multipliers.reshape(()), sc), (role, step)
                assert torch.equal(qt.scales.reshape(()), inv), (role, step)
            deq[role] = dq
        prev_amax = amax
        _check_chain(rows, deq, q, k, v, g, out, grads, shape, sm, mx, mode, fmt)


def _close(x: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (x.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"{what}: max excess {(err - bound).max():.3g}"


def _check_chain(rows, deq, q, k, v, g, out, grads, shape, sm, mx, mode, fmt) -> None:
    """The fp32 tensors between the quantization points, recomputed in float64 from the
    reference's dequantized operands, within the fp32 accumulation bound."""
    _, _, sq, skv, d, causal = shape
    qd, kd = deq["Q"], deq["K"]
    vd = deq["V"].transpose(-1, -2) if mx else deq["V"]
    mask = torch.ones(sq, skv, dtype=torch.bool).triu(1) if causal else None
    logit = (qd @ kd.transpose(-1, -2)) * sm
    dl = gemm_gamma(d) * (qd.abs() @ kd.abs().transpose(-1, -2)) * sm + U * logit.abs()
    if mask is not None:
        logit = logit.masked_fill(mask, float("-inf"))
        dl = dl.masked_fill(mask, 0.0)
    p64 = torch.softmax(logit, dim=-1)
    lse = torch.logsumexp(logit, dim=-1, keepdim=True)
    big = logit.masked_fill(torch.isinf(logit), 0).abs().amax(-1, keepdim=True) + lse.abs() + 1
    rel = torch.expm1(2 * dl.amax(-1, keepdim=True) + gamma(skv + 4) + 4 * U * big)
    p = rows["S"][0]
    _close(p, p64, p64 * rel, f"{mode} {shape} S source (P)")
    # O = S V
    sd = deq["S"]
    _close(rows["O"][0] if "O" in rows else out, sd @ vd,
           gemm_gamma(skv) * (sd.abs() @ vd.abs()), f"{mode} {shape} O")  # fmt: skip
    if "O" in rows:
        assert torch.equal(out, deq["O"].float())  # fp32 dequantization: one rounding
    # backward: dO is the incoming gradient as is
    assert torch.equal(rows["dO"][0], g)
    dod = deq["dO"]
    if mx:  # the backward's other orientations, each quantized from the fp32 tensor (TE MXFP8)
        f_q, f_b = fmt["QKV"], fmt["dO"]
        q_b = ref_mx(q.transpose(-1, -2).contiguous(), f_q)[1].transpose(-1, -2)
        k_b = ref_mx(k.transpose(-1, -2).contiguous(), f_q)[1].transpose(-1, -2)
        v_b = ref_mx(v, f_q)[1]
        do_c = ref_mx(g.transpose(-1, -2).contiguous(), f_b)[1].transpose(-1, -2)
    else:
        q_b, k_b, v_b, do_c = qd, kd, vd, dod
    delayed = mode == "delayed"
    o_d = deq["O"] if delayed else (rows["O"][0] if "O" in rows else out).double()
    do_d = dod if delayed else g.double()
    dp_raw = dod @ v_b.transpose(-1, -2)
    dsum = (do_d * o_d).sum(-1, keepdim=True)
    p = p.double()
    ds64 = p * (dp_raw - dsum) * sm
    inner = gemm_gamma(d) * (dod.abs() @ v_b.abs().transpose(-1, -2)) + gemm_gamma(d) * (
        do_d * o_d
    ).abs().sum(-1, keepdim=True)
    # then the subtraction and the two products, one rounding each
    bound = p * sm * (inner * (1 + U) + U * (dp_raw - dsum).abs()) * (1 + 3 * U)
    _close(rows["dP"][0], ds64, bound + 3 * U * ds64.abs(), f"{mode} {shape} dP source (dS)")
    dsd = deq["dP"]
    dq64, dk64, dv64 = dsd @ k_b, dsd.transpose(-1, -2) @ q_b, sd.transpose(-1, -2) @ do_c
    bq = gemm_gamma(skv) * (dsd.abs() @ k_b.abs())
    bk = gemm_gamma(sq) * (dsd.abs().transpose(-1, -2) @ q_b.abs())
    bv = gemm_gamma(sq) * (sd.abs().transpose(-1, -2) @ do_c.abs())
    if "dQKV" in rows:
        src = rows["dQKV"][0]
        flat = [t.reshape(-1) if not mx else t.reshape(-1, d) for t in (dq64, dk64, dv64)]
        bflat = [t.reshape(-1) if not mx else t.reshape(-1, d) for t in (bq, bk, bv)]
        _close(src, torch.cat(flat), torch.cat(bflat), f"{mode} {shape} dQKV source")
        whole = deq["dQKV"].reshape(-1)
        n1, n2 = dq64.numel(), dq64.numel() + dk64.numel()
        for gr, part in zip(grads, (whole[:n1], whole[n1:n2], whole[n2:]), strict=True):
            assert torch.equal(gr.reshape(-1), part.float())
    else:
        for gr, ref, bd, name in zip(grads, (dq64, dk64, dv64), (bq, bk, bv), "qkv", strict=True):
            _close(gr, ref, bd, f"{mode} {shape} d{name}")


@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_quantization_points_match_te_reference(i: int) -> None:
    """Each of the 20 shapes under one of the scalings (in turn: every scaling on 5 shapes),
    two steps (delayed scales from the first step's amaxes on the second)."""
    _check(list(MODES)[i % len(MODES)], SHAPES[i], seed=i)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_quantization_points_every_scaling_larger(mode: str, i: int) -> None:
    b, h, sq, skv, d, causal = SHAPES[i]
    _check(mode, (b + 1, h + 1, sq * 4 + 3, skv * 4 + 5, d, causal), seed=100 + i)


# --------------------------------------------------------------------------- FA-3 style path
def _hot_and_diffuse(seq: int, gap: float = 8.0, d: int = 64) -> tuple[torch.Tensor, ...]:
    """Rows with one key at logit ``gap`` and ``seq - 1`` keys at logit 0 (diffuse mass)."""
    q = torch.zeros(1, 1, 2, d)
    q[..., 0] = math.sqrt(d)  # q·k * 1/sqrt(d) = k[..., 0]
    k = torch.zeros(1, 1, seq, d)
    k[..., 0, 0] = gap
    v = torch.randn(1, 1, seq, d, generator=torch.Generator().manual_seed(3))
    return q, k, v


@pytest.mark.parametrize("log2", [0, 8])
def test_fa_path_casts_p_with_the_offset_only(log2: int) -> None:
    rec = get_recipe("te-current").replace(
        attention=True, dpa=DPAConfig(path="fa", p_prescale_log2=log2)
    )
    q, k, v = _hot_and_diffuse(1024)
    rows = {}
    handle = on_operand(_recorder(rows))
    DotProductAttention(rec, name="att")(q, k, v)
    handle.remove()
    e, qt = rows["S"]
    # the unnormalised exp(logits - rowmax): its row max is exactly 1
    assert torch.equal(e.amax(-1), torch.ones_like(e.amax(-1)))
    codes, _, _ = ref_tensor(e, "e4m3", torch.tensor(2.0**log2))
    assert torch.equal(codes_of(qt, "e4m3"), codes)
    assert float(qt.scale_multipliers.reshape(())) == 2.0**log2
    # the cold keys' weight exp(-8) < 2**-10 rounds to 0 in E4M3 without the offset: their whole
    # mass, 1023 e^-8 / (1 + 1023 e^-8) ~ 0.26 of each row, is lost; with 2**8 it is kept
    lost = 1 - (qt.dequantize() / e.sum(-1, keepdim=True)).sum(-1)
    cold = 1023 * math.exp(-8) / (1 + 1023 * math.exp(-8))
    if log2 == 0:
        assert torch.allclose(lost, torch.full_like(lost, cold), rtol=1e-3)
    else:
        assert float(lost.abs().max()) < 0.01 * cold


def test_fa_path_backward_is_fp32_attention() -> None:
    rec = get_recipe("te-current").replace(attention=True, dpa=DPAConfig(path="fa"))
    q, k, v = (t.clone().requires_grad_() for t in _hot_and_diffuse(40, gap=2.0))
    DotProductAttention(rec)(q, k, v, is_causal=True).sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- module behaviour
def test_off_without_attention_and_gqa() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 64, generator=gen)
    k, v = torch.randn(2, 1, 2, 9, 64, generator=gen)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    plain = DotProductAttention("te-current")(q, k, v, is_causal=True)  # attention = false
    assert torch.allclose(plain, ref, atol=1e-6)
    rec = get_recipe("te-current").replace(attention=True)
    fp8 = DotProductAttention(rec)(q, k, v, is_causal=True)
    assert 0 < float((fp8 - ref).abs().max()) < 0.5


def test_delayed_state_resumes_bit_for_bit() -> None:
    rec = get_recipe("te-delayed").replace(attention=True)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(1, 2, 12, 64, generator=gen) for _ in range(4)) for _ in range(4)]

    def step(m, batch):
        q, k, v, g = (t.clone().requires_grad_(i < 3) for i, t in enumerate(batch))
        out = m(q, k, v, is_causal=True)
        out.backward(g)
        return out.detach(), q.grad

    a = DotProductAttention(rec)
    for bt in batches[:2]:
        step(a, bt)
    saved = {k: t.clone() for k, t in a.state_dict().items()}
    assert "fp8_dpa_S_amax_history" in saved and saved["fp8_dpa_S_amax_history"].numel() == 1024
    b = DotProductAttention(rec)
    b.load_state_dict(saved)
    assert set(b.state_dict()) == set(saved)  # not yet run: saved back as loaded
    for bt in batches[2:]:
        oa, ga = step(a, bt)
        ob, gb = step(b, bt)
        assert torch.equal(oa, ob) and torch.equal(ga, gb)
    other = DotProductAttention(get_recipe("te-current").replace(attention=True))
    other.load_state_dict(saved)
    with pytest.raises(ValueError, match="another recipe"):
        step(other, batches[0])


def test_eval_does_not_move_delayed_scales() -> None:
    rec = get_recipe("te-delayed").replace(attention=True)
    m = DotProductAttention(rec)
    q = torch.randn(1, 1, 8, 64)
    with torch.no_grad():
        m(q, q, q)
    assert all(float(t) == 1.0 for k, t in m.state_dict().items() if k.endswith("_scale"))
    m(q, q, q)
    assert float(m.state_dict()["fp8_dpa_QKV_scale"]) != 1.0


@pytest.mark.no_arithmetic
def test_mxfp8_head_size_must_tile_the_block() -> None:
    m = DotProductAttention(get_recipe("mxfp8").replace(attention=True), name="blk.attn")
    q = torch.zeros(1, 1, 4, 48)
    with pytest.raises(ValueError, match=r"blk\.attn: head size 48 does not tile the MXFP8 block"):
        m(q, q, q)


@pytest.mark.no_arithmetic
def test_dpa_table_in_recipe_files(tmp_path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('base = "te-current"\nattention = true\n[dpa]\nscaling = "delayed"\n'
                 'fp8_mha = true\namax_history_len = 16\n')  # fmt: skip
    r = Recipe.load(p)
    assert r.dpa == DPAConfig(scaling="delayed", fp8_mha=True, amax_history_len=16)
    assert Recipe.from_toml(r.to_toml()) == r and Recipe.from_json(r.to_json()) == r
    assert "dpa" not in get_recipe("te-current").replace(attention=True).to_dict()
    p.write_text('base = "te-current"\n[dpa]\npath = "fa"\n')
    with pytest.raises(RecipeFileError, match=r"r\.toml.*\[dpa\].*attention = false"):
        Recipe.load(p)
    p.write_text('base = "te-current"\nattention = true\n[dpa]\np_prescale_log2 = 3\n')
    with pytest.raises(RecipeFileError, match=r"r\.toml.*\[dpa\].*p_prescale_log2"):
        Recipe.load(p)
    p.write_text('base = "te-current"\n[[layer]]\nmatch = "a.*"\nattention = true\n'
                 '[layer.dpa]\nscaling = "mxfp8"\n')  # fmt: skip
    r = Recipe.load(p)
    assert r.for_layer("a.x").dpa.scaling == "mxfp8" and r.for_layer("b").dpa == DPAConfig()
