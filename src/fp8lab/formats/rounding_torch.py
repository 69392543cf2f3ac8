"""Device-generic kernels of `fp8lab.cast`: torch tensor operations on integer bit patterns.

The same bits as the numba kernels of `fp8lab.formats.rounding` (which are the specification,
element for element), on any device torch runs on. Each numba kernel has its twin here:

* `cast_f32_fast`: `_det_one` (nearest_even, nearest_away, toward_zero) and `_sr_one`
  (stochastic, hybrid) on float32 bits, int32 arithmetic only;
* `cast_generic`: `_generic_one` (integer significand times a power of two, the grid as a table
  ``binade -> exponent of the spacing``) on float32 or float64 bits, int64 arithmetic; used for
  float64 input (rounded once, from its own 53-bit significand) and formats the fast kernel
  cannot describe;
* `rand32`: the counter-based splitmix64 hash of (seed, element index) that stochastic rounding
  draws from, so both implementations round the same elements up.

Why integers only: a GPU may flush float32 subnormals to zero in fused float ops; integer ops and
exact int -> float64 conversions do not depend on that. Signed int32/int64 stand in for numba's
unsigned types: every magnitude is below 2**31 (2**63), the one wrap-around that matters (the
splitmix64 products) is two's complement on every torch device, and a logical right shift of an
int64 is an arithmetic shift followed by a mask (`_srl64`). Shift amounts are clamped to the
type's width, so no result depends on how a device treats an oversized shift. Every temporary is
allocated on the input's device; a stochastic seed comes from the caller (drawn from a CPU
generator), never from a device generator.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fp8lab.formats._grid import (
    HYB_OVF_BITS,
    INF_BITS,
    NAN_BITS,
    TAB_LO,
    TAB_N,
    FastGrid,
    GenericGrid,
    fast_grid,
)

__all__ = ["cast_f32_fast", "cast_generic", "rand32"]

_I32 = torch.int32
_I64 = torch.int64
_SIGN32 = -(2**31)  # 0x80000000 as int32


def _s64(v: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _srl64(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits by ``k`` (1..63): arithmetic shift, then clear the
    copies of the sign bit."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _hash32(seed: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """splitmix64 of ``seed + i * golden`` for i = 0..n-1, top 32 bits: int64 in [0, 2**32).

    ``seed`` is a 0-d int64 tensor (a tensor, so a compiled kernel is not specialised on it).
    """
    z = torch.arange(n, dtype=_I64, device=device) * _GOLDEN + seed
    z = (z ^ _srl64(z, 30)) * _MIX1
    z = (z ^ _srl64(z, 27)) * _MIX2
    z = z ^ _srl64(z, 31)
    return _srl64(z, 32)


def rand32(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """``rounding._rand32(seed, i)`` for i = 0..n-1: int64 in [0, 2**32) on ``device``.

    splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014)
    of ``seed + i * golden``; ``seed`` is the int64 the caller drew (its bits as uint64).
    """
    return _hash32(torch.tensor(seed, dtype=_I64, device=device), n, device)


# The per-format constants of the float32 kernel travel as ONE small int32 tensor on the device
# (positions below), not as Python numbers: a compiled kernel is then the same for every format
# and overflow rule (one compile per rounding family, see `cast_f32_fast`).
(
    _K_HIF8,
    _K_SNORM,
    _K_EMINF,
    _K_LOWQ150,
    _K_SE0,
    _K_MAXB,
    _K_OVFB,
    _K_INFB,
    _K_TINYB,
    _K_NOZERO,
    _K_SIGNED,
    _K_SZERO,
    _K_RNE,
    _K_AWAY,
    _K_HYB16,
) = range(15)

_CONSTS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _consts(g: FastGrid, mode: int, hyb16: int, device: torch.device) -> torch.Tensor:
    """The constants tensor of grid ``g``, rounding ``mode`` and input rule (cached per device)."""
    values = (
        int(g.is_hif8),
        int(g.s_norm),
        int(g.emin_field),
        int(g.lowq150),
        int(g.s_e0),
        int(g.maxb),
        int(g.ovfb),
        int(g.infb),
        int(g.tinyb),
        int(g.no_zero),
        int(g.signed),
        int(g.signed_zero),
        int(mode == 0),
        int(mode == 1),
        hyb16,
    )
    key = (values, device)
    hit = _CONSTS.get(key)
    if hit is None:
        hit = _CONSTS[key] = torch.tensor(values, dtype=_I32, device=device)
    return hit


# ------------------------------------------------------------------------------ finishing
def _finish(
    r: torch.Tensor,
    neg: torch.Tensor,
    zero_in: torch.Tensor,
    inf_in: torch.Tensor,
    nan_in: torch.Tensor,
    k: torch.Tensor,
) -> torch.Tensor:
    """`rounding._finish_bits`: overflow, zero, Inf/NaN and sign of a rounded magnitude ``r``
    (float32 bits, int32; above max means overflow). The flags describe the input; ``k`` holds
    the constants (`_consts`)."""
    o = torch.where(r > k[_K_MAXB], k[_K_OVFB], r)
    rounded_away = (r == 0) & (k[_K_NOZERO] != 0)  # a format without zero
    o = torch.where(rounded_away, torch.where(zero_in, NAN_BITS, k[_K_TINYB]), o)
    o = torch.where(inf_in, k[_K_INFB], o)
    o = torch.where(nan_in, NAN_BITS, o)
    keep_sign = neg & ((o != 0) | (k[_K_SZERO] != 0))
    signed = torch.where(keep_sign, o | _SIGN32, o)
    signed = torch.where((signed & 0x7FFFFFFF) > INF_BITS, NAN_BITS, signed)
    unsigned = torch.where((o > INF_BITS) | neg, NAN_BITS, o)
    return torch.where(k[_K_SIGNED] != 0, signed, unsigned)


# --------------------------------------------------------------------------- float32 fast
def _shift_of(ex: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`rounding._shift_of`: float32 bits below the grid spacing, from the exponent field."""
    eb = ex - 127
    ab = eb.abs()
    tapered = 20 + (ab >= 4).to(_I32) + (ab >= 8).to(_I32)  # HiF8: 3, 2, 1 mantissa bits
    s_hif8 = torch.where(eb < -15, (1 - eb).clamp(min=23), tapered)
    s = torch.where(ex >= k[_K_EMINF], k[_K_SNORM], k[_K_LOWQ150] - ex)
    s = torch.where(ex == 0, k[_K_SE0], s)
    return torch.where(k[_K_HIF8] != 0, s_hif8, s)


def _increment(
    a: torch.Tensor,
    ex: torch.Tensor,
    sc: torch.Tensor,
    low: torch.Tensor,
    family: int,
    rnd: torch.Tensor | None,
    k: torch.Tensor,
) -> torch.Tensor:
    """The rounding increment added to the bits before the low ``sc`` bits are cleared."""
    half = low >> 1
    if family == 0:  # nearest_even, nearest_away or toward_zero, by the constants
        odd = ((a >> sc) & 1) | ((sc == 23) & (ex != 0)).to(_I32)
        away = torch.where(k[_K_AWAY] != 0, half + 1, 0)
        return torch.where(k[_K_RNE] != 0, half + odd, away)
    if family == 3:
        # the low bits of the draw (low < 2**23, so the int32 conversion is exact)
        return (rnd & 0x7FFFFF).to(_I32) & low
    # hybrid: TA for binades 2^-3..2^3, SSR elsewhere; an exact remainder stays
    eb = ex - 127
    rem = a & low
    up32 = (rem >> (sc - 14)) >= (a & 0x3FFF)
    lsb = torch.where(eb >= -14, 13, (-1 - eb).clamp(0, 31))
    up16 = (rem >> (sc - 2)) >= ((a >> lsb) & 1) * 2 + 1
    up = torch.where(k[_K_HYB16] != 0, up16, up32) & (rem != 0)
    return torch.where((eb >= -3) & (eb <= 3), half + 1, torch.where(up, low + 1, 0))


def _below_half_step(
    a: torch.Tensor,
    ex: torch.Tensor,
    s: torch.Tensor,
    family: int,
    rnd: torch.Tensor | None,
    k: torch.Tensor,
) -> torch.Tensor:
    """Result bits where ``s >= 24`` (|x| below half a grid step): 0 or one step."""
    q = (s + ex.clamp(min=1) - 150).clamp(-149, 127)
    # one step as float32 bits: normal, or subnormal (no shift of a negative number)
    qb = torch.where(q >= -126, (q.clamp(min=-126) + 127) << 23, 1 << (q + 149).clamp(0, 30))
    sig = torch.where(ex == 0, a, (a & 0x7FFFFF) | 0x800000)
    if family == 0:
        rne = (k[_K_RNE] != 0) & ((a & 0x7FFFFF) != 0)
        up = (s == 24) & (ex != 0) & ((k[_K_AWAY] != 0) | rne)
    elif family == 3:
        wide = sig.to(_I64)
        thresh = torch.where(s <= 32, wide << (32 - s).clamp(0, 32), wide >> (s - 32).clamp(0, 63))
        up = rnd < torch.where(s >= 56, 0, thresh)
    else:
        up = (ex == 104) & ((sig >> 10) >= (a & 0x3FFF))  # binade 2^-23
    return torch.where(up, qb, 0)


def _fast_kernel(u: torch.Tensor, k: torch.Tensor, seed: torch.Tensor, family: int) -> torch.Tensor:
    """`rounding._det_one` (family 0) / `_sr_one` (3: stochastic, 4: hybrid) on int32 bits."""
    a = u & 0x7FFFFFFF
    ex = a >> 23
    s = _shift_of(ex, k)
    sc = s.clamp(1, 23)
    low = (1 << sc) - 1
    rnd = _hash32(seed, u.shape[0], u.device) if family == 3 else None
    fin = a.clamp(max=INF_BITS)  # Inf/NaN are replaced below; keeps a + add inside int32
    r = (fin + _increment(a, ex, sc, low, family, rnd, k)) & ~low
    r = torch.where(s <= 0, a, r)
    r = torch.where(s >= 24, _below_half_step(a, ex, s, family, rnd, k), r)
    if family == 4:
        r = torch.where(a >= HYB_OVF_BITS, INF_BITS, r)
    return _finish(r, u < 0, a == 0, a == INF_BITS, a > INF_BITS, k)


#: below this many elements the kernels run eagerly (a compiled call costs ~0.1 ms of guards)
COMPILE_MIN = 1 << 16
#: elements of the check a compiled kernel passes before it is used (`verified`)
PROBE_N = 1 << 17
_compiled: dict[object, object] = {}


def compiled_kernel(name: str, fn: Callable[..., Any], n: int, device: torch.device):
    """``torch.compile(fn)`` (inductor's C++ on the CPU, Triton on CUDA: one fused pass instead
    of dozens of tensor ops), built once and kept under ``name``, for a call on ``n`` elements on
    ``device``; None where the eager ops run instead: below `COMPILE_MIN` elements, on another
    device type, inside a compile, or once a compile has failed (`compile_failed`).

    The compiled kernel may be used only after `verified` (the same bits as the eager one)."""
    if n < COMPILE_MIN or device.type not in ("cpu", "cuda"):
        return None
    if torch.compiler.is_compiling() or _compiled.get("failed"):
        return None
    hit = _compiled.get(name)
    if hit is None:
        hit = _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return hit


def compile_failed() -> None:
    """Remember that compiling failed (no compiler, an old torch): eager kernels from now on."""
    _compiled["failed"] = True


def call_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` without torch's own DeprecationWarnings from importing inductor, and always
    without grad: dynamo guards on the grad mode, so a caller's mode other than the probe's would
    compile a second, unprobed kernel (the kernels take no tensor that needs grad)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args)


def verified(
    compiled: Callable[..., Any],
    eager: Callable[..., Any],
    key: tuple[object, ...],
    what: str,
    check: Callable[[Callable[..., Any]], torch.Tensor],
    device: torch.device,
) -> bool:
    """Does the compiled kernel give the eager kernel's bits: ``check(compiled)`` equal to
    ``check(eager)`` (``check`` runs a kernel on a probe, e.g. `probe`, and returns its result as
    an integer tensor)? Checked once per ``key`` (device type first) and remembered; a kernel that
    fails gets a RuntimeWarning naming ``what`` and is not used. The kernels run without grad
    (`call_compiled`); inference mode and deterministic algorithms extend the key.

    Why: inductor's C++ for AVX2 (ATEN_CPU_CAPABILITY=avx2) gave wrong bits for about 3 in 4
    random inputs of the cast kernel with torch 2.13 (measured 2026-11-27), while the AVX-512 code
    and the eager ops were exact. A compiled kernel is used only where it is shown to be exact.
    """
    # dynamo also guards on these global modes: another mode compiles another kernel, probed anew
    modes = (torch.is_inference_mode_enabled(), torch.are_deterministic_algorithms_enabled())
    vkey = ("verified", *key) if modes == (False, False) else ("verified", *key, modes)
    ok = _compiled.get(vkey)
    if ok is None:
        want = check(eager)
        got = call_compiled(check, compiled)
        ok = _compiled[vkey] = bool(torch.equal(got, want))
        if not ok:
            warnings.warn(
                f"fp8lab: torch.compile's kernel for {what} gave different bits than the eager "
                f"torch ops on {device.type} (CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}); fp8lab uses the eager kernel "
                "there (same bits as numba, slower)",
                RuntimeWarning,
                stacklevel=4,
            )
    return ok


def probe(device: torch.device) -> torch.Tensor:
    """`PROBE_N` float32 bit patterns (int32): every bf16 pattern (the top 16 bits), then random
    bits."""
    gen = torch.Generator().manual_seed(0x5EED)
    rand = torch.randint(-(2**31), 2**31, (PROBE_N - (1 << 16),), dtype=_I64, generator=gen)
    every = torch.arange(-(2**15), 2**15, dtype=_I64) << 16
    return torch.cat([every, rand]).to(_I32).to(device)


def canonical_bits(t: torch.Tensor) -> torch.Tensor:
    """The int32 bits of float32 ``t``, flat, every NaN as one pattern: how a probe compares two
    kernels' results (a NaN's payload and sign are not part of fp8lab's arithmetic)."""
    return torch.where(torch.isnan(t), float("nan"), t).view(torch.int32).reshape(-1)


def cast_f32_fast(u: torch.Tensor, g: FastGrid, mode: int, seed: int, hyb16: int) -> torch.Tensor:
    """`rounding._det_one` / `_sr_one` on every element of ``u`` (float32 bits as int32, flat):
    the result's float32 bits (int32, ``u``'s device).

    Args:
        u: 1-D int32 tensor, the bits of float32 inputs.
        g: the format's `FastGrid` for this overflow rule.
        mode: index into `fp8lab.formats.ROUNDING_MODES` (0..4).
        seed: the stochastic seed (mode 3), drawn by the caller.
        hyb16: 1 when the input was float16 (the fp16 SSR rule of ``hybrid``).
    """
    k = _consts(g, mode, hyb16, u.device)
    seed_t = torch.tensor(seed, dtype=_I64, device=u.device)
    family = 0 if mode <= 2 else mode
    fn = compiled_kernel("fast", _fast_kernel, u.shape[0], u.device)
    if fn is None:
        return _fast_kernel(u, k, seed_t, family)

    def check(kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
        pseed = torch.tensor(0x243F6A8885A308D3, dtype=_I64, device=u.device)
        return kernel(probe(u.device), k, pseed, family)

    try:
        key = (u.device.type, family)
        if not verified(fn, _fast_kernel, key, f"cast (rounding family {family})", check, u.device):
            return _fast_kernel(u, k, seed_t, family)
        return call_compiled(fn, u, k, seed_t, family)
    except Exception:  # any compiler failure: the eager kernel gives the same bits
        compile_failed()
        return _fast_kernel(u, k, seed_t, family)


# ------------------------------------------------------------------------------- generic
def _fast_bits_of(g: GenericGrid) -> FastGrid:
    """The bit constants `_finish` needs, from a generic grid (its floats as float32 bits)."""
    return _finish_grid(g.maxval, g.ovfval, g.infval, g.tinyval, g.flags)


_finish_grid = functools.lru_cache(maxsize=256)(fast_grid)


_QTABS: dict[tuple[int, torch.device], tuple[np.ndarray, torch.Tensor]] = {}


def _qtab_on(g: GenericGrid, device: torch.device) -> torch.Tensor:
    """The grid's binade table as an int64 tensor on ``device`` (copied once per device)."""
    key = (id(g.qtab), device)
    hit = _QTABS.get(key)
    if hit is None or hit[0] is not g.qtab:  # the array is kept in the entry: ids stay unique
        hit = (g.qtab, torch.from_numpy(g.qtab).to(device))
        _QTABS[key] = hit
    return hit[1]


def _bits_f64_to_f32(b: torch.Tensor) -> torch.Tensor:
    """float32 bits (int32) of float64 values (int64 bits, positive, non-zero, finite) that are
    exactly representable in float32, normal or subnormal; integer ops only."""
    e = (b >> 52) - 1023
    frac = b & ((1 << 52) - 1)
    normal = ((e + 127) << 23) | (frac >> 29)
    sub = (frac | (1 << 52)) >> (e.neg() - 97).clamp_(0, 63)  # 29 + (-126 - e)
    return torch.where(e >= -126, normal, sub).to(_I32)


def _round_up(
    sig: torch.Tensor,
    kept: torch.Tensor,
    rem: torch.Tensor,
    shift: torch.Tensor,
    shc: torch.Tensor,
    eb: torch.Tensor,
    mode: int,
    rnd: torch.Tensor | None,
    hyb16: int,
) -> torch.Tensor:
    """`rounding._round_mag`'s decision to round ``kept`` up by one step (bool tensor)."""
    half = 1 << (shc - 1)
    deep = shift > 62  # nothing kept: the nearest modes never round up from there
    if mode == 0:
        up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    elif mode == 1:
        up = rem >= half
    elif mode == 2:
        return torch.zeros_like(sig, dtype=torch.bool)
    elif mode == 3:
        thresh = torch.where(
            shift <= 32, rem << (32 - shift).clamp(0, 32), rem >> (shift - 32).clamp(0, 63)
        ).masked_fill_(shift - 32 >= 63, 0)
        return rnd < thresh
    else:
        if hyb16 == 0:
            ssr = (rem >> (shc - 14).clamp(min=0)) >= (sig & 0x3FFF)
        else:
            lsb = torch.where(eb < -14, -1 - eb, 13).clamp_(0, 63)
            t2 = ((sig >> lsb) & 1) * 2 + 1
            ssr = (rem >> (shc - 2).clamp(min=0)) >= t2
        up = torch.where((eb >= -3) & (eb <= 3), rem >= half, ssr)
        return up & (rem != 0)
    return up & ~deep


def cast_generic(
    bits: torch.Tensor,
    g: GenericGrid,
    mode: int,
    seed: int,
    hyb16: int,
    inf_bits: int,
    mbits: int,
) -> torch.Tensor:
    """`rounding._generic_one` on every element: float32 (``bits`` int32, ``mbits`` 23,
    ``inf_bits`` 0x7F800000) or float64 (int64, 52, 0x7FF0000000000000) input bits, flat;
    returns the result's float32 bits (int32, the input's device).

    The rounded magnitude is ``m * 2**e`` with integers ``m < 2**53`` and ``e``: its float64
    bits are those of ``float(m)`` (exact) with ``e`` added to the exponent field, compared with
    max as integers and narrowed to float32 bits by `_bits_f64_to_f32`.
    """
    u = bits.to(_I64)
    a = u & (inf_bits | ((1 << (inf_bits.bit_length())) - 1))  # |x|: clear the sign bit
    bias = inf_bits >> (mbits + 1)
    ex = a >> mbits
    sub = ex == 0
    sig = torch.where(sub, a, (a & ((1 << mbits) - 1)) | (1 << mbits))
    e0 = torch.where(sub, 1 - bias - mbits, ex - bias - mbits)
    # floor(log2 sig) of a subnormal input: the exponent of float(sig), exact for sig < 2**53
    lg = (sig.to(torch.float64).view(_I64) >> 52) - 1023
    eb = torch.where(sub, e0 + lg, ex - bias)
    k = (eb - TAB_LO).clamp_(0, TAB_N - 1)
    q = _qtab_on(g, bits.device)[k]
    shift = q - e0
    shc = shift.clamp(1, 62)
    kept = sig >> shc
    rem = sig - (kept << shc)
    deep = shift > 62
    kept = kept.masked_fill_(deep, 0)
    rem = torch.where(deep, sig, rem)
    rnd = rand32(seed, bits.numel(), bits.device) if mode == 3 else None
    kept += _round_up(sig, kept, rem, shift, shc, eb, mode, rnd, hyb16)
    on_grid = shift <= 0
    m = torch.where(on_grid, sig, kept)
    e = torch.where(on_grid, e0, q)
    if mode == 4:  # hybrid: |x| < 2**-23 gives 0 (and |x| >= 40960 overflows, below)
        m = m.masked_fill_(eb < -23, 0)
    b64 = m.to(torch.float64).view(_I64) + (e << 52)
    maxb64 = int(np.array([g.maxval]).view(np.int64)[0])
    over = (b64 > maxb64) & (m != 0)
    if mode == 4:
        over |= (eb > 15) | ((eb == 15) & (sig >= 0xA00000))
    r = torch.where(m == 0, 0, _bits_f64_to_f32(b64.clamp(max=maxb64)))
    r = torch.where(over, INF_BITS, r)  # above maxb: `_finish` turns it into the overflow value
    k = _consts(_fast_bits_of(g), mode, hyb16, bits.device)
    return _finish(r, u < 0, a == 0, a == inf_bits, a > inf_bits, k)
