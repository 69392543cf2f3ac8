"""Fused numba kernels of the `max` and MX scale rules: one pass over the block amaxes.

Each kernel computes exactly what its rule function in `fp8lab.scaling.rules` computes (the same
float32 operations / integer steps), plus the reciprocal, in one loop: a dozen small threaded torch
ops over the block scales cost more than the data pass itself on a busy 2-core machine. The rule
functions are the definition; tests/scaling/test_rule_kernels.py checks every kernel equal to its
rule over the whole float32 range.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab._bits import f32_to_u32 as _f32_to_u32
from fp8lab._bits import u32_to_f32 as _u32_to_f32
from fp8lab.formats import FloatFormat, get_format
from fp8lab.formats import rounding as _rounding
from fp8lab.kernels import use_torch
from fp8lab.scaling import rules
from fp8lab.scaling.rules import max_scale

__all__ = ["MX_RULES", "max_rule_args", "max_rule_scales", "mx_rule_args", "mx_rule_scales",
           "nvfp4_fast_ok", "nvfp4_rule_scales",
           "run_rule"]  # fmt: skip

MX_RULES = ("mx_floor", "mx_ceil", "mx_even", "mx_rceil")
_MAX_SCALE = inspect.signature(max_scale)  # max_rule_scales' options are max_scale's
_MX_MODE = {rule: i for i, rule in enumerate(MX_RULES)}  # the kernels' mode numbers


def max_rule_scales(
    amax: torch.Tensor, fmt: str | FloatFormat, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1/scale)`` of `fp8lab.scaling.rules.max_scale` (float32, ``amax``'s shape);
    ``options``: max_scale's keywords (``margin``, ``epsilon``, ``value_for_inf``), bound to its
    signature (its defaults; an unknown keyword is a TypeError)."""
    o = _MAX_SCALE.bind(amax, fmt, **options)
    o.apply_defaults()
    kernel, args = max_rule_args(fmt, o.arguments["margin"], o.arguments["epsilon"])
    return run_rule(kernel, (*args, np.float32(o.arguments["value_for_inf"])), amax)


def max_rule_args(
    fmt: str | FloatFormat, margin: int = 0, epsilon: float = 0.0
) -> tuple[Callable[..., None], tuple[Any, ...]]:
    """The `max` rule's kernel and its constant arguments (the format max times
    ``2**-margin``, ``epsilon``); `run_rule` takes them with ``value_for_inf`` appended."""
    f = get_format(fmt)
    return _max_rule_scales, (np.float32(f.max * 2.0 ** (-int(margin))), np.float32(epsilon))


def mx_rule_scales(
    amax: torch.Tensor, rule: str, fmt: str | FloatFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` of the MX rule ``rule`` (`MX_RULES`) for float32 block amaxes:
    ``e8m0_to_scale`` and ``e8m0_to_scale_inv`` of `fp8lab.scaling.rules.mx_exponent`."""
    return run_rule(*mx_rule_args(rule, fmt), amax)


def mx_rule_args(rule: str, fmt: str | FloatFormat) -> tuple[Callable[..., None], tuple[Any, ...]]:
    """The MX rule ``rule``'s kernel and its constant arguments, for `run_rule`."""
    if rule not in _MX_MODE:
        raise ValueError(f"unknown MX rule {rule!r}; valid: {', '.join(MX_RULES)}")
    f = get_format(fmt)
    recip = np.float32(1.0) / np.float32(f.max)  # TE's fl32(1/fmt_max), correctly rounded
    return _mx_rule_scales, (_MX_MODE[rule], f.emax, f.mbits, recip)


def run_rule(
    kernel: Callable[..., None], args: tuple[Any, ...], amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel(amax, *args, scale, scale_inv)`` (a kernel of `max_rule_args` / `mx_rule_args`)
    into fresh float32 tensors of ``amax``'s shape and device; the MX kernels read the amax
    bits. On another device (`fp8lab.kernels.use_torch`) the rule functions run instead."""
    if use_torch(amax, what="scale rule"):
        return _run_rule_torch(kernel is _mx_rule_scales, args, amax)
    a = np.ascontiguousarray(amax.to(torch.float32).numpy()).reshape(-1)
    if kernel is _mx_rule_scales:
        a = a.view(np.uint32)
    s_np = np.empty(a.shape[0], dtype=np.float32)
    inv_np = np.empty(a.shape[0], dtype=np.float32)
    kernel(a, *args, s_np, inv_np)
    shape = amax.shape
    return torch.from_numpy(s_np).reshape(shape), torch.from_numpy(inv_np).reshape(shape)


def _run_rule_torch(
    mx: bool, args: tuple[Any, ...], amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_rule` with the rule functions of `fp8lab.scaling.rules` (any device): the `max` rule
    from ``(scaled_max, epsilon, value_for_inf)``, an MX rule from ``(mode, emax, mbits,
    fl32(1/fmt_max))``."""
    a = amax.to(torch.float32)
    if not mx:
        scaled_max, eps, vinf = (float(v) for v in args)
        s = rules.scale_from_max(a, scaled_max, eps, vinf)
        return s, torch.reciprocal(s)
    mode, emax, mbits, recip = args
    if MX_RULES[mode] == "mx_rceil":
        r = torch.tensor(float(recip), dtype=torch.float32, device=a.device)
        code = rules.rceil_code(a.abs() * r)  # fl32(amax * fl32(1/fmt_max)), as TE
    else:
        code = rules.mx_code(a, MX_RULES[mode].removeprefix("mx_"), int(emax), int(mbits))
    # codes are 0..255 here: gather from the conversions applied to all 256 codes (two passes
    # over the block scales instead of the conversions' dozen)
    codes = torch.arange(256, dtype=torch.int32, device=a.device)
    idx = code.reshape(-1)
    s, inv = (lut.index_select(0, idx).view(code.shape) for lut in
              (rules.e8m0_to_scale(codes), rules.e8m0_to_scale_inv(codes)))  # fmt: skip
    return s, inv


@njit(cache=True, error_model="numpy")  # IEEE division: x / 0 -> inf, no exception
def _max_rule_scales(amax, scaled_max, eps, value_for_inf, s_out, inv_out):  # pragma: no cover
    """`fp8lab.scaling.rules.max_scale` and its reciprocal in one pass over the block amaxes.

    Same float32 operations as the torch version: ``amax = max(amax, eps)`` (eps > 0 only),
    one correctly rounded division, amax of 0/inf/NaN -> 1, an infinite scale -> value_for_inf;
    ``inv = 1 / scale`` correctly rounded (``torch.reciprocal``).
    """
    one = np.float32(1.0)
    for i in range(amax.shape[0]):
        a = amax[i]
        if eps > np.float32(0.0) and a < eps:
            a = eps
        sc = np.float32(scaled_max / a)
        if not (np.isfinite(a) and a > np.float32(0.0)):
            sc = one
        if np.isinf(sc):
            sc = value_for_inf
        s_out[i] = sc
        inv_out[i] = np.float32(one / sc)


@njit(cache=True, inline="always")
def _pow2(e):  # pragma: no cover - numba
    """2**e as float32 for integer e in [-149, 127] (exact; subnormal below -126)."""
    if e >= -126:
        return _u32_to_f32(np.uint32((e + 127) << 23))
    return _u32_to_f32(np.uint32(1 << (e + 149)))


@njit(cache=True)
def _mx_rule_scales(amax_bits, mode, emax, mbits, fmax_recip, s_out, inv_out):  # pragma: no cover
    """The MX rules of `fp8lab.scaling.rules` (`mx_exponent` then `e8m0_to_scale` and
    `e8m0_to_scale_inv`) in one pass over the block amaxes' bits, with the same integer steps.

    mode: 0 floor, 1 ceil, 2 even, 3 rceil (``fl32(amax * fmax_recip)``). Code 255 -> NaN.
    """
    nan = _u32_to_f32(np.uint32(0x7FC00000))
    for i in range(amax_bits.shape[0]):
        b = np.int64(amax_bits[i] & np.uint32(0x7FFFFFFF))  # |amax|
        finite = (b & 0x7F800000) != 0x7F800000
        if mode == 3:
            r = _f32_to_u32(np.float32(_u32_to_f32(np.uint32(b)) * fmax_recip))
            e = np.int64((r >> np.uint32(23)) & np.uint32(0xFF))
            mant = np.int64(r & np.uint32(0x007FFFFF))
            code = e
            if mant > 0 and e != 0xFE and not (e == 0 and mant <= 0x400000):
                code = e + 1
            if e == 0xFF:
                code = 0xFE if mant == 0 else 0xFF  # inf -> 0xFE, NaN -> 0xFF
            if r == np.uint32(0):
                code = 0
        else:
            if mode == 0:
                e = ((b >> 23) & 0xFF) - 127
            elif mode == 1:
                e = ((b >> 23) & 0xFF) - 127 + (1 if (b & 0x007FFFFF) != 0 else 0)
            else:
                # a carry past the largest exponent (amax near FLT_MAX) gives e = 128: the
                # finite code 128 - emax + 127 (rules.mx_exponent); only inf/NaN amax -> 255
                d = 23 - mbits
                bb = (b + (1 << (d - 1))) & 0x7F800000 if d > 0 else b & 0x7F800000
                e = ((bb >> 23) & 0xFF) - 127
            code = min(max(e - emax, -127), 128) + 127
            if not finite:
                code = 255
        if code == 255:
            s_out[i] = nan
            inv_out[i] = nan
        else:
            s_out[i] = _pow2(127 - code)
            inv_out[i] = _pow2(code - 127)


# ------------------------------------------------------------------------------------ NVFP4
# second-level modes of `_nvfp4_rule_scales`: the tensor's amax, one amax per block row or per
# block column (``row_scaled``), a static tensor_scale
_NV_TENSOR, _NV_ROWS, _NV_COLS, _NV_STATIC = 0, 1, 2, 3


def nvfp4_fast_ok(spec_format: str, scale_format: str, two_level: bool) -> bool:
    """Whether `nvfp4_rule_scales` computes a spec's NVFP4 rule: E2M1 elements, E4M3 block
    scales, the two-level rule (the default NVFP4 spec); other variants take
    `fp8lab.scaling.rules.nvfp4_scales`."""
    return spec_format == "e2m1" and scale_format == "e4m3" and two_level


def nvfp4_rule_scales(
    amax: torch.Tensor,
    block: tuple[int, int],
    row_scaled: bool = False,
    tensor_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8lab.scaling.rules.nvfp4_scales` (E2M1, E4M3 block scales, ``block_order="kernel"``)
    with its second-level amax (`fp8lab.qtensor.nvfp4.second_level_amax`: the tensor's, or per
    row / column when ``row_scaled``) or the static ``tensor_scale``, in one numba pass over the
    float32 block amaxes ``[nr, nc]`` (``block``: the resolved block, whose first side decides
    rows (1) or columns (> 1) when row-scaled).

    Returns ``(enc, s_blk, s_dec)``: the per-block multiplier and E4M3 scale ``[nr, nc]`` and
    the FP32 second-level dequantization scale (0-d, or ``[nr, 1]`` / ``[1, nc]`` when
    row-scaled), bit for bit the torch rule's. CPU tensors only."""
    a = np.ascontiguousarray(amax.to(torch.float32).numpy())
    nr, nc = a.shape
    if tensor_scale is not None:
        mode, ng = _NV_STATIC, 1
    elif row_scaled:
        mode, ng = (_NV_ROWS, nr) if block[0] == 1 else (_NV_COLS, nc)
    else:
        mode, ng = _NV_TENSOR, 1
    ts = np.float32(0.0 if tensor_scale is None else tensor_scale)  # fl32, as torch.tensor(ts)
    enc = np.empty((nr, nc), dtype=np.float32)
    s_blk = np.empty((nr, nc), dtype=np.float32)
    dec = np.empty(ng, dtype=np.float32)
    _nvfp4_rule_scales(a, mode, ts, _e4m3_grid(), enc, s_blk, dec)
    s_dec = torch.from_numpy(dec)
    s_dec = s_dec.reshape(()) if mode in (_NV_TENSOR, _NV_STATIC) else (
        s_dec.reshape(nr, 1) if mode == _NV_ROWS else s_dec.reshape(1, nc))  # fmt: skip
    return torch.from_numpy(enc), torch.from_numpy(s_blk), s_dec


def _e4m3_grid() -> Any:
    """The fast-cast record of E4M3, nearest even, saturating (`fp8lab.cast`'s own)."""
    return _rounding._grids(get_format("e4m3"), True, 0)[1]


@njit(cache=True, error_model="numpy")  # IEEE division: 1 / 0 -> inf
def _nvfp4_rule_scales(amax, mode, tensor_scale, g, enc, s_blk, dec):  # pragma: no cover
    """`fp8lab.scaling.rules.nvfp4_scales` over ``amax [nr, nc]`` with the same float32
    operations (each rounded once; `_det_one` is `fp8lab.cast`'s E4M3 rounding):

    1. second-level amax ``ga`` (`_NV_*` modes), ``s_enc = min(fl32(448 * 6) / ga, FLT_MAX)``, 1
       where ``ga`` is 0 or ``s_enc`` is 0, ``s_dec = 1 / s_enc``; static: ``s_dec =
       tensor_scale``, ``s_enc = min(1 / s_dec, FLT_MAX)``;
    2. ``s_blk = e4m3(clamp(amax * fl32(s_enc * fl32(1/6)), +-448))`` (RNE, saturating);
    3. ``enc = min(1 / fl32(s_blk * s_dec), FLT_MAX)``.
    """
    nr, nc = amax.shape
    flt_max = np.float32(3.4028234663852886e38)
    one = np.float32(1.0)
    inv6 = np.float32(one / np.float32(6.0))
    top = np.float32(2688.0)  # fl32(448) * fl32(6), exact
    smax = np.float32(448.0)
    # the second-level amaxes
    if mode == 3:
        dec[0] = tensor_scale
    else:
        for i in range(dec.shape[0]):
            dec[i] = np.float32(0.0)
        for br in range(nr):
            for cb in range(nc):
                j = 0 if mode == 0 else (br if mode == 1 else cb)
                dec[j] = max(dec[j], amax[br, cb])
    # dec holds the amaxes (or the static scale); becomes s_dec, with s_enc kept per entry
    encs = np.empty(dec.shape[0], dtype=np.float32)
    for j in range(dec.shape[0]):
        if mode == 3:
            se = min(np.float32(one / dec[j]), flt_max)
        else:
            ga = dec[j]
            se = min(np.float32(top / ga), flt_max)
            if ga == np.float32(0.0) or se == np.float32(0.0):
                se = one
            dec[j] = np.float32(one / se)
        encs[j] = np.float32(se * inv6)
    for br in range(nr):
        for cb in range(nc):
            j = 0 if (mode == 0 or mode == 3) else (br if mode == 1 else cb)
            pre = np.float32(amax[br, cb] * encs[j])
            pre = min(max(pre, -smax), smax)
            sb = _u32_to_f32(np.uint32(_rounding._det_one(_f32_to_u32(pre), g, 0)))
            sd = dec[j]
            s_blk[br, cb] = sb
            enc[br, cb] = min(np.float32(one / np.float32(sb * sd)), flt_max)
