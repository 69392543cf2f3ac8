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
from fp8lab.kernels import use_torch
from fp8lab.scaling import rules
from fp8lab.scaling.rules import max_scale

__all__ = ["MX_RULES", "max_rule_args", "max_rule_scales", "mx_rule_args", "mx_rule_scales",
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
