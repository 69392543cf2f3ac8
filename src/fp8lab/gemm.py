"""Emulated low-precision GEMMs: `Accumulator` models and `qmatmul`.

``qmatmul(a, b)`` computes ``a @ b`` for ``a`` ``[M, K]`` and ``b`` ``[K, N]`` quantized operands
(`fp8lab.QTensor`; float tensors are quantized first under ``spec``). Element values are exact on
their grids, so every product of two FP8 values is exact; what differs between the models is how
the products are summed and where the scales are applied.

Accumulator models
------------------
``fp32`` (`Accumulator(kind="fp32")`): products exact, sums in FP32 (a BLAS sgemm over the
    element values). Scales that are constant along K (per tensor, per row of ``a``, per column
    of ``b``) are applied once to the output, as cuBLAS applies ``scale_a * scale_b``: the
    output is ``(A @ B) * (sa * sb)`` with ``sa * sb`` rounded to FP32 first. Scales that vary
    along K (1x128 x 128x128, MX, NVFP4) are applied by dequantizing both operands and then
    multiplying: mathematically the same as promoting every K group into FP32 with that group's
    scales, equal up to FP32 summation order.

``limited`` (`Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=None)`): the
    Hopper FP8 tensor-core model. For each output element, per MMA group of ``group`` consecutive
    products (the WGMMA K = 32 for FP8) the group sum is added to the running accumulator and the
    result is cut to ``mantissa_bits`` fraction bits (``rounding="toward_zero"``: truncation, as
    measured on H100 by huweim/emulation_sys: 13 bits RZ; DeepSeek-V3 §3.3 "around 14 bits",
    counting the leading one; "FP22 = e8m13" per PyTorch). The group sum itself is computed
    exactly (a float64 GEMM over the group: exact for E4M3 operands, whose products span < 2^45;
    for E5M2 exact unless the group's products span more than 2^53). Every ``promote_every``
    K elements (DeepSeek's N_C = 128, four WGMMAs) the accumulator is added into an FP32
    accumulator with the K group's scales, ``total += (scale_a * scale_b) * acc`` (DeepGEMM's
    ``final_accum += scale * accum``), and restarts at 0. ``promote_every=None`` never promotes
    (TE's fprop "fast accumulation", cuBLASLt FAST_ACCUM): the scales are applied to the
    output, so they must be constant along K.
    ``per_product=True`` follows DeepSeek §3.5.2's wording instead: "after aligning 32 mantissa
    products by right-shifting based on the maximum exponent, the Tensor Core only uses the
    highest 14 bits of each mantissa product": each product of the group is truncated (toward
    zero) to the quantum ``2**(e_max - mantissa_bits)`` of the group's largest product, the
    truncated products are summed exactly and the accumulator update is truncated as above. It is
    a per-element numba loop, much slower.
    Not modelled: accumulator exponent range (it is taken as unbounded; FP32's range in practice),
    the exact alignment point of the accumulator against the products, and extra alignment bits
    (Khattak & Mikaitis, arXiv 2512.07004, describe bit-exact models with those parameters).

Native path: ``native=True`` calls ``torch._scaled_mm`` (per-tensor E4M3/E5M2 operands, FP32
accumulator). On CPU (torch 2.13) it dequantizes the operands and runs an FP32 matmul; see
``tests/test_gemm.py`` for how it compares with the emulation.

Output: FP32, or rounded to ``out_format`` ``"bf16"`` / ``"fp16"`` (round to nearest even, as
the epilogue's conversion; overflow to inf as IEEE).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from fp8lab._bits import f64_to_u64 as _f64_to_u64
from fp8lab._bits import u64_to_f64 as _u64_to_f64
from fp8lab.qtensor import QTensor, QuantSpec, quantize
from fp8lab.scaling.granularity import resolve_block

__all__ = ["ACCUMULATOR_KINDS", "Accumulator", "qmatmul"]

ACCUMULATOR_KINDS = ("fp32", "limited")
ACC_ROUNDINGS = ("toward_zero", "nearest_even")
OUT_FORMATS = ("fp32", "bf16", "fp16")
_NATIVE_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_ROW_CHUNK = 64  # output rows per pass of the limited model
_BATCH_K = 512  # K elements per batched group-sum GEMM


@dataclass(frozen=True)
class Accumulator:
    """How a GEMM accumulates. Frozen; `to_dict`/`from_dict` round-trip through TOML/JSON.

    Attributes:
        kind: ``"fp32"`` (products exact, FP32 sums) or ``"limited"`` (Hopper FP8 tensor core).
        mantissa_bits: fraction bits kept by the limited accumulator (13 = DeepSeek's "about 14
            bits" counting the leading one; e8m13 per other measurements).
        group: products summed per MMA step before the accumulator is truncated (32 = WGMMA K).
        promote_every: K elements between promotions of the limited accumulator into FP32 with
            the K group's scales (DeepSeek N_C = 128); ``None`` never promotes (TE fast accum).
        rounding: how the limited accumulator drops bits: ``toward_zero`` (measured) or
            ``nearest_even``.
        per_product: DeepSeek §3.5.2's wording: each product aligned to the group's largest
            exponent and truncated before the sum (slower reference variant).
    """

    kind: str = "fp32"
    mantissa_bits: int = 13
    group: int = 32
    promote_every: int | None = None
    rounding: str = "toward_zero"
    per_product: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ACCUMULATOR_KINDS:
            raise ValueError(
                f"accumulator kind must be one of {ACCUMULATOR_KINDS}, got {self.kind!r}"
            )
        if not 1 <= int(self.mantissa_bits) <= 23:
            raise ValueError(f"mantissa_bits must be in [1, 23], got {self.mantissa_bits}")
        if int(self.group) < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")
        if self.promote_every is not None:
            pe = int(self.promote_every)
            if pe < 1 or pe % int(self.group):
                raise ValueError(
                    f"promote_every must be a positive multiple of group={self.group}, got {pe}"
                )
            object.__setattr__(self, "promote_every", pe)
        if self.rounding not in ACC_ROUNDINGS:
            raise ValueError(
                f"accumulator rounding must be one of {ACC_ROUNDINGS}, got {self.rounding!r}"
            )
        object.__setattr__(self, "mantissa_bits", int(self.mantissa_bits))
        object.__setattr__(self, "group", int(self.group))

    def to_dict(self) -> dict[str, Any]:
        """Plain data; ``promote_every=None`` is omitted (TOML has no null)."""
        d = dataclasses.asdict(self)
        if d["promote_every"] is None:
            del d["promote_every"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accumulator:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Accumulator keys: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def parse(cls, acc: str | Accumulator | dict[str, Any] | None) -> Accumulator:
        """An `Accumulator` from itself, a kind name, a dict, or None (fp32)."""
        if acc is None:
            return cls()
        if isinstance(acc, Accumulator):
            return acc
        if isinstance(acc, str):
            return cls(kind=acc)
        if isinstance(acc, dict):
            return cls.from_dict(acc)
        raise TypeError(f"accumulator must be a kind name, Accumulator or dict, got {type(acc)}")


def qmatmul(
    a: QTensor | torch.Tensor,
    b: QTensor | torch.Tensor,
    accumulator: str | Accumulator | dict[str, Any] | None = "fp32",
    out_format: str | None = None,
    *,
    spec: QuantSpec | None = None,
    spec_b: QuantSpec | None = None,
    native: bool = False,
) -> torch.Tensor:
    """Emulated ``a @ b``: ``a`` ``[M, K]``, ``b`` ``[K, N]`` -> float32 ``[M, N]``.

    Args:
        a, b: `QTensor` operands, or float tensors quantized here with ``spec`` (``a``) and
            ``spec_b`` (``b``; default: ``spec`` with its block transposed, so that a (1, 128)
            activation spec gives (128, 1) for ``b``).
        accumulator: an `Accumulator`, its kind as a string (``"fp32"``, ``"limited"``) or a dict.
        out_format: ``None``/``"fp32"``, ``"bf16"`` or ``"fp16"``: the output's rounding.
        native: use ``torch._scaled_mm`` (per-tensor E4M3/E5M2 operands, fp32 accumulator).

    Raises:
        ValueError: non-2-D operands, mismatched K, scale blocks along K that do not line up
            (e.g. ``b`` tiled along N instead of K: retile it), a limited accumulator without
            promotion over K-varying scales, or ``native`` where it does not apply.
    """
    acc = Accumulator.parse(accumulator)
    qa, qb = _operands(a, b, spec, spec_b)
    kb = _check_pair(qa, qb)
    if native:
        out = _native(qa, qb, acc)
    elif acc.kind == "fp32":
        out = _fp32(qa, qb, kb)
    else:
        out = _limited(qa, qb, acc, kb)
    return _round_out(out, out_format)


def _operands(
    a: QTensor | torch.Tensor,
    b: QTensor | torch.Tensor,
    spec: QuantSpec | None,
    spec_b: QuantSpec | None,
) -> tuple[QTensor, QTensor]:
    if isinstance(a, torch.Tensor):
        if spec is None:
            raise ValueError("qmatmul: float operand a needs spec= (a QuantSpec) to be quantized")
        a = quantize(a, spec)
    if isinstance(b, torch.Tensor):
        sb = spec_b or (spec.transposed() if spec is not None else None)
        if sb is None:
            raise ValueError("qmatmul: float operand b needs spec_b= or spec= to be quantized")
        b = quantize(b, sb)
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        raise TypeError(
            f"qmatmul operands must be QTensors or float tensors, got {type(a).__name__} and "
            f"{type(b).__name__}"
        )
    return a, b


def _blocks(q: QTensor) -> tuple[int, int]:
    return resolve_block(q.spec.block, (q.shape[0], q.shape[1]))


def _check_pair(a: QTensor, b: QTensor) -> int:
    """Validate shapes and scale geometry; return the K extent over which scales are constant."""
    if a.values.dim() != 2 or b.values.dim() != 2:
        raise ValueError(f"qmatmul needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    k = a.shape[1]
    if k != b.shape[0]:
        raise ValueError(
            f"qmatmul: mismatched K: a is {tuple(a.shape)} (K={k}), "
            f"b is {tuple(b.shape)} (K={b.shape[0]})"
        )
    ka = min(_blocks(a)[1], k)
    kb = min(_blocks(b)[0], k)
    if k in (ka, kb) or ka == kb:
        return min(ka, kb)
    raise ValueError(
        f"qmatmul: incompatible scale granularities along K: a has blocks {a.spec.granularity!r} "
        f"({ka} wide along K), b has blocks {b.spec.granularity!r} ({kb} tall along K). The scale "
        "groups of both operands must line up along the reduction axis (equal, or one of them "
        "spanning all of K); for b = x of shape [K, N] quantized row-wise, retile it to the "
        "transposed blocks first (fp8lab.retile)."
    )


def _k_constant_scales(q: QTensor, side: str) -> torch.Tensor:
    """Scales of an operand whose scales do not vary along K, broadcast to [M, 1] or [1, N]."""
    sc = q.scales
    if q.global_scale is not None:
        sc = sc * q.global_scale
    if side == "a":
        bm = _blocks(q)[0]
        return sc.repeat_interleave(bm, dim=0)[: q.shape[0]].reshape(-1, 1)
    bn = _blocks(q)[1]
    return sc.repeat_interleave(bn, dim=1)[:, : q.shape[1]].reshape(1, -1)


def _fp32(a: QTensor, b: QTensor, kb: int) -> torch.Tensor:
    k = a.shape[1]
    if kb >= k or (a.scales.shape[1] == 1 and b.scales.shape[0] == 1):
        out = torch.mm(a.values.float(), b.values.float())
        if (
            a.scales.numel() == 1
            and b.scales.numel() == 1
            and a.global_scale is None
            and (b.global_scale is None)
        ):
            return out.mul_(a.scales.reshape(()) * b.scales.reshape(()))
        return out.mul_(_k_constant_scales(a, "a") * _k_constant_scales(b, "b"))
    return torch.mm(a.dequantize(), b.dequantize())


def _native(a: QTensor, b: QTensor, acc: Accumulator) -> torch.Tensor:
    if acc.kind != "fp32":
        raise ValueError("native=True runs torch._scaled_mm: it has no limited-accumulator model")
    for name, q in (("a", a), ("b", b)):
        if (
            q.spec.format not in _NATIVE_FORMATS
            or q.scales.numel() != 1
            or q.global_scale is not None
        ):
            raise ValueError(
                f"native=True needs per-tensor e4m3/e5m2 operands; {name} is "
                f"{q.spec.format} with {q.scales.numel()} scales"
            )
    a8 = a.values.to(_NATIVE_FORMATS[a.spec.format])
    b8 = b.values.to(_NATIVE_FORMATS[b.spec.format]).t().contiguous().t()  # column-major
    return torch._scaled_mm(
        a8,
        b8,
        scale_a=a.scales.reshape(()).float(),
        scale_b=b.scales.reshape(()).float(),
        out_dtype=torch.float32,
    )


def _round_out(out: torch.Tensor, out_format: str | None) -> torch.Tensor:
    if out_format is None or out_format in ("fp32", "float32"):
        return out
    if out_format in ("bf16", "bfloat16"):
        return out.to(torch.bfloat16).to(torch.float32)
    if out_format in ("fp16", "float16", "half"):
        return out.to(torch.float16).to(torch.float32)
    raise ValueError(f"out_format must be one of {OUT_FORMATS} or None, got {out_format!r}")


# ------------------------------------------------------------------------------ limited model


@njit(cache=True, inline="always")
def _cut(v, drop, half_m1, mask, rne):
    """Keep ``52 - drop`` fraction bits of a float64: truncate (RZ) or round to nearest even."""
    u = _f64_to_u64(v)
    if rne:
        u = u + half_m1 + ((u >> drop) & np.uint64(1))
    return _u64_to_f64(np.uint64(u & mask))


@njit(cache=True)
def _acc_step(acc, buf, drop, rne, gpp, out, sa, sb):  # pragma: no cover - numba
    """For each group g of buf [G, rows, cols]: acc = cut(acc + buf[g]); after every ``gpp``
    groups (0 = never) promote: out += f32(sa[r, t] * sb[t, n]) * f32(acc), acc = 0, where t
    counts the promotions within this call.

    Serial on purpose: it runs between torch GEMM calls, and alternating two thread pools on two
    cores makes both spin.
    """
    ng, rows, cols = buf.shape
    dropu = np.uint64(drop)
    half_m1 = (np.uint64(1) << (dropu - np.uint64(1))) - np.uint64(1)
    mask = ~((np.uint64(1) << dropu) - np.uint64(1))
    for r in range(rows):
        for g in range(ng):
            for n in range(cols):
                acc[r, n] = _cut(acc[r, n] + buf[g, r, n], dropu, half_m1, mask, rne)
            if gpp > 0 and (g + 1) % gpp == 0:
                t = g // gpp
                s_r = sa[r, t]
                for n in range(cols):
                    out[r, n] += (s_r * sb[t, n]) * np.float32(acc[r, n])
                    acc[r, n] = 0.0


@njit(parallel=True, cache=True)
def _acc_per_product(a, b, k0, k1, group, drop, rne, acc):  # pragma: no cover - numba
    """DeepSeek §3.5.2 model over K range [k0, k1): per group align + truncate each product."""
    rows, cols = acc.shape
    dropu = np.uint64(drop)
    half_m1 = (np.uint64(1) << (dropu - np.uint64(1))) - np.uint64(1)
    mask = ~((np.uint64(1) << dropu) - np.uint64(1))
    keep = 52 - drop
    tile = 64
    ntiles = (cols + tile - 1) // tile
    for job in prange(rows * ntiles):
        r = job // ntiles
        n0 = (job % ntiles) * tile
        n1 = min(n0 + tile, cols)
        emax = np.zeros(tile, dtype=np.uint64)
        qinv = np.empty(tile, dtype=np.float64)
        q = np.empty(tile, dtype=np.float64)
        s = np.empty(tile, dtype=np.float64)
        for g0 in range(k0, k1, group):
            g1 = min(g0 + group, k1)
            for j in range(n1 - n0):
                emax[j] = np.uint64(0)
                s[j] = 0.0
            for k in range(g0, g1):
                av = a[r, k]
                for j in range(n1 - n0):
                    e = (_f64_to_u64(av * b[k, n0 + j]) >> np.uint64(52)) & np.uint64(0x7FF)
                    emax[j] = max(emax[j], e)
            for j in range(n1 - n0):
                # quantum 2**(e_max - keep) of the group's largest product (biased exponents)
                eq = np.int64(emax[j]) - keep
                eq = max(eq, np.int64(1))
                q[j] = _u64_to_f64(np.uint64(eq) << np.uint64(52))
                qinv[j] = _u64_to_f64(np.uint64(2046 - eq) << np.uint64(52))
            for k in range(g0, g1):
                av = a[r, k]
                for j in range(n1 - n0):
                    s[j] += np.trunc(av * b[k, n0 + j] * qinv[j]) * q[j]
            for j in range(n1 - n0):
                acc[r, n0 + j] = _cut(acc[r, n0 + j] + s[j], dropu, half_m1, mask, rne)


def _interval_scales(a: QTensor, b: QTensor, kp: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 scales of a per (row, promotion interval) [M, T] and of b per (interval, column)
    [T, N] for the intervals of ``span`` K elements up to ``kp`` (padding reuses the last)."""
    bma, bka = _blocks(a)
    bkb, bnb = _blocks(b)
    k = a.shape[1]
    starts = [min(p, k - 1) for p in range(0, kp, span)]
    ia = torch.tensor([s // bka for s in starts], dtype=torch.long)
    ib = torch.tensor([s // bkb for s in starts], dtype=torch.long)
    sa = a.scales[:, ia].repeat_interleave(bma, dim=0)[: a.shape[0]]
    sb = b.scales[ib, :].repeat_interleave(bnb, dim=1)[:, : b.shape[1]]
    return (
        np.ascontiguousarray(sa.float().numpy()),
        np.ascontiguousarray(sb.float().numpy()),
    )


def _limited(a: QTensor, b: QTensor, acc: Accumulator, kb: int) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    pe = acc.promote_every
    if pe is None and kb < k:
        raise ValueError(
            f"limited accumulation without promotion applies the scales to the output, but these "
            f"operands' scales change every {kb} elements along K: set promote_every to a "
            f"multiple of group={acc.group} dividing {kb} (DeepSeek: 128)"
        )
    if pe is not None and kb < k and kb % pe:
        raise ValueError(
            f"promote_every={pe} does not divide the operands' K scale block ({kb}): the "
            "promoted partial sums would straddle two scale groups"
        )
    drop = 52 - acc.mantissa_bits
    rne = acc.rounding == "nearest_even"
    out = torch.zeros((m, n), dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    grp = acc.group
    span = pe if pe is not None else grp  # K elements between promotions (or per group)
    # K elements per batched group-sum GEMM: up to _BATCH_K // span promotion intervals at once
    # (fewer, larger torch calls), as many per call as make the calls cover K evenly: K = 256
    # with span 128 is one call of 2 intervals, not a call of 4 with 2 all-zero ones (zero
    # padding is exact but its MACs cost as much as real ones)
    intervals = -(-k // span)
    calls = -(-intervals // max(1, _BATCH_K // span))
    step = span * -(-intervals // calls)
    kp = calls * step
    # exact float64 operands, zero-padded along K to whole steps: a zero group adds an exact 0,
    # cutting an already cut accumulator is a no-op and promoting 0 adds +0
    va, vb = a.values.double(), b.values.double()
    if kp > k:
        va = torch.nn.functional.pad(va, (0, kp - k))
        vb = torch.nn.functional.pad(vb, (0, 0, 0, kp - k))
    ng = step // grp
    gpp = span // grp if pe is not None else 0
    nst = step // span
    o_np = out.numpy()
    chunk = min(_ROW_CHUNK, m) if not acc.per_product else m
    accbuf = np.zeros((chunk, n), dtype=np.float64)
    zero = np.zeros((1, chunk, n), dtype=np.float64)  # a promotion pass without new sums
    if not acc.per_product:
        gbuf = torch.empty((ng, chunk, n), dtype=torch.float64)
    if pe is not None:
        sa_all, sb_all = _interval_scales(a, b, kp, span)
    else:
        unit_a = np.ones((chunk, max(nst, 1)), dtype=np.float32)
        unit_b = np.ones((max(nst, 1), n), dtype=np.float32)
    for r0 in range(0, m, chunk):
        r1 = min(r0 + chunk, m)
        rows = r1 - r0
        acc_np = accbuf[:rows]
        acc_np[:] = 0.0
        for p0 in range(0, kp, step):
            if pe is not None:
                t0 = p0 // span
                sa = np.ascontiguousarray(sa_all[r0:r1, t0 : t0 + nst])
                sb = np.ascontiguousarray(sb_all[t0 : t0 + nst])
            else:
                sa, sb = unit_a[:rows], unit_b
            if acc.per_product:
                for t in range(nst):
                    q0 = p0 + t * span
                    _acc_per_product(
                        va.numpy()[r0:r1], vb.numpy(), q0, q0 + span, grp, drop, rne, acc_np
                    )
                    _acc_step(acc_np, zero[:1, :rows], drop, rne, 1 if pe else 0, o_np[r0:r1],
                              np.ascontiguousarray(sa[:, t : t + 1]), np.ascontiguousarray(sb[t : t + 1]))  # fmt: skip
                continue
            # all group sums of this step in one batched GEMM: [ng, rows, grp] @ [ng, grp, n]
            a3 = va[r0:r1, p0 : p0 + step].reshape(rows, ng, grp).transpose(0, 1)
            b3 = vb[p0 : p0 + step].reshape(ng, grp, n)
            g_c = torch.bmm(a3, b3) if rows != chunk else torch.bmm(a3, b3, out=gbuf)
            _acc_step(acc_np, g_c.numpy(), drop, rne, gpp, o_np[r0:r1], sa, sb)
        if pe is None:  # never promoted: out = f32(acc), scales applied below
            _acc_step(acc_np, zero[:, :rows], drop, rne, 1, o_np[r0:r1], unit_a[:rows], unit_b)
    if pe is None:
        out.mul_(_k_constant_scales(a, "a") * _k_constant_scales(b, "b"))
    elif a.global_scale is not None or b.global_scale is not None:
        g = torch.ones(())
        for q in (a, b):
            if q.global_scale is not None:
                g = g * q.global_scale
        out.mul_(g)
    return out
