"""The ``fused`` accumulator's FP8 fast domain as one Triton kernel (GPU), bit for bit the numba
and torch kernels (`fp8lab.gemm.fused`, `fp8lab.gemm.fused_torch`).

Why: on a GPU the torch kernel is a chain of small memory-bound ops per K group (many launches
per MMA step). This kernel keeps a [BM, BN] tile of output accumulators in registers and walks
the K groups: per group it loads A [BM, G] and B [G, BN], forms the products [BM, G, BN], the
step's alignment exponent ``E``, the truncated terms and their exact sum, rounds the result to
``out_bits`` and, every ``gpp`` groups and at the last, promotes it into the FP32 output with the
block scales (``out += (sa * sb) * run``, two roundings).

Domain: `fast_path_applies` (finite FP8 operands, aligned c, RZ output, F and G such that every
term is below ``2**(F + 2)`` and ``G + 1`` of them sum below ``2**24``): the H100/H200/Ada/L40S
and b200-tcgen05 FP8 rows, deepseek-v3-h100 included.

The arithmetic is chosen so a GPU compiler cannot change a bit:

* exponents are integers read from float32 bits (``e = max(floor(log2|x|), emin)``), never
  ``log2``/``exp2``; ``E = max(e_a + e_b over nonzero pairs, e_c, exp_floor)``;
* a product of FP8 values is exact in float32 and so is its scaling by the power of two
  ``2**(F - E)`` (built from bits); the float->int32 conversion truncates toward zero, as the
  model does (a scaled product below 1, subnormal or flushed, truncates to 0 either way);
* the accumulator's term ``trunc(c * 2**(F - E))`` is an integer shift of its significand, and
  the terms are summed in int32 (exact), so no float addition rounds and no FMA can form;
* rounding to ``out_bits`` toward zero and the FP32 exponent floor -126 are integer shifts, and
  the float32 result (normal, subnormal, signed zero or inf) is assembled from its bits, so
  flush-to-zero anywhere cannot touch it;
* the promotion is the one floating-point step: the kernel is launched with
  ``enable_fp_fusion=False`` so ``(sa * sb) * run`` and the addition round separately.

Before its first use on a device (and model) the kernel must reproduce the torch kernel's bits on
an edge-dense probe (`verified_kernel`); otherwise a RuntimeWarning and the torch kernel. Tests
run it through Triton's interpreter on the CPU (tests/gemm/test_fused_triton.py).
``FP8LAB_TRITON=0`` (read once) or `set_triton("0")` / `using_triton("0")` turns it off.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from fp8lab.formats import get_format
from fp8lab.formats.rounding_torch import canonical_bits
from fp8lab.gemm.accumulator import Accumulator
from fp8lab.gemm.fused_torch import fused_gemm_torch, pow2_exponents
from fp8lab.kernels import ProcessChoice

__all__ = [
    "TRITON_CHOICES", "fits", "fused_gemm_triton", "get_triton", "set_triton", "triton_available",
    "triton_mode", "triton_status", "using_triton", "verified_kernel",
]  # fmt: skip

_BM, _BN = 16, 16  # output tile: BM * G * BN products live in registers per group
#: compile options of every launch: no a*b+c contraction into FMA (the promotion rounds twice)
COMPILE_OPTIONS = {"enable_fp_fusion": False}


#: the values of `set_triton` and ``FP8LAB_TRITON``: "1" (the default: the Triton kernel on
#: CUDA), "0" (off) or "interpret" (also Triton's interpreter on CPU tensors, for tests)
TRITON_CHOICES: tuple[str, ...] = ("1", "0", "interpret")
_TRITON = ProcessChoice("FP8LAB_TRITON", TRITON_CHOICES, "1", "Triton mode", "set_triton")


def get_triton() -> str:
    """The Triton choice for the whole process: ``"1"``, ``"0"`` or ``"interpret"``, read once
    from ``FP8LAB_TRITON`` (default "1") and changed with `set_triton` / `using_triton`.

    Raises:
        ValueError: ``FP8LAB_TRITON`` holds another value (naming the variable and the value),
            rather than silently leaving the kernel on.
    """
    return _TRITON.get()


def set_triton(mode: str) -> str:
    """Choose the Triton mode for the whole process (``"1"``, ``"0"`` or ``"interpret"``);
    returns the previous one. ValueError on another value."""
    return _TRITON.set(mode)


@contextmanager
def using_triton(mode: str) -> Iterator[None]:
    """Run a block under the Triton ``mode``, then restore the previous one."""
    with _TRITON.using(mode):
        yield


def triton_available() -> bool:
    """Is Triton importable and not turned off (`get_triton` is "0")?"""
    if get_triton() == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_mode(device: torch.device) -> str | None:
    """How the fused fast domain runs on ``device``: ``"jit"`` (compiled Triton, CUDA),
    ``"interpret"`` (Triton's interpreter on CPU tensors: only with ``FP8LAB_TRITON=interpret``,
    for tests), or None (the torch / numba kernels)."""
    if not triton_available():
        return None
    if device.type == "cuda":
        return "jit"
    if device.type == "cpu" and get_triton() == "interpret":
        return "interpret"
    return None


def fits(m: int, k: int, n: int, group: int) -> bool:
    """Do the kernel's int32 element offsets reach every element of [M, K] x [K, N] -> [M, N],
    masked overhangs of a tile and a K group included? Larger GEMMs take the torch kernel."""
    kg = k + 2 * group
    return max((m + _BM) * kg, kg * (n + _BN), (m + _BM) * (n + _BN)) < 2**31


@cache
def _jit(interpret: bool) -> Any:
    """The jitted kernel; ``interpret``: Triton's interpreter (numpy on the CPU, for tests).
    Built on first use: triton picks the interpreter when the function is decorated."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from fp8lab.gemm.fused_triton_kernel import fused_tile

    return InterpretedFunction(fused_tile) if interpret else triton.jit(fused_tile)


def fused_gemm_triton(
    va: torch.Tensor,
    vb: torch.Tensor,
    accbuf: torch.Tensor,
    out: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    acc: Accumulator,
    gpp: int,
    formats: tuple[str, str],
    interpret: bool = False,
    kernel: Any = None,
) -> None:
    """`fused_gemm_torch` with ``fast=True`` as one Triton kernel, in place: ``va`` [M, K] and
    ``vb`` [K, N] float32 finite FP8 values of ``formats``; ``accbuf`` [M, N] float32 c in and
    the chain's last result out; with ``gpp`` > 0 the step results are promoted into ``out``
    [M, N] with ``sa`` [M, T], ``sb`` [T, N]. ``interpret``: through Triton's interpreter (CPU
    tensors); ``kernel``: another jitted kernel of the same signature (tests)."""
    m, k = va.shape
    n = vb.shape[1]
    if m == 0 or n == 0:
        return
    g = acc.group
    fn = _jit(interpret) if kernel is None else kernel
    args = [x.contiguous() for x in (va, vb)]
    grid = (-(-m // _BM), -(-n // _BN))
    gp = 1 << max(0, (g - 1).bit_length())
    opts = {} if interpret else COMPILE_OPTIONS
    fn[grid](
        *args, accbuf, out, sa.contiguous(), sb.contiguous(), m, n, k, -(-k // g), max(gpp, 1),
        sa.shape[1], G=g, GP=gp, F=acc.align_bits, OUT_BITS=acc.out_bits,
        EXP_FLOOR=acc.exp_floor, EMIN_A=get_format(formats[0]).emin,
        EMIN_B=get_format(formats[1]).emin, PROMOTE=gpp > 0, BM=_BM, BN=_BN, **opts,
    )  # fmt: skip


def _fp8(shape: tuple[int, int], fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Every kind of finite ``fmt`` value (random bytes: zeros, subnormals, maxima, both signs)."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dt).float()
    return torch.where(torch.isfinite(x), x, 0.0)


def probe_case(acc: Accumulator, formats: tuple[str, str], gpp: int, device: torch.device):
    """An edge-dense fast-domain GEMM: ragged tiles and K, rows of maxima that cancel, zero rows,
    c of every kind (zero, -0, subnormal, tiny, huge, inf, NaN); returns (va, vb, c, sa, sb)."""
    gen = torch.Generator().manual_seed(0xF5ED)
    m, n = _BM * 2 + 3, _BN * 2 + 5
    k = acc.group * 5 + 7
    va, vb = _fp8((m, k), formats[0], gen), _fp8((k, n), formats[1], gen)
    hi_a, hi_b = get_format(formats[0]).max, get_format(formats[1]).max
    va[0, : k // 2], va[0, k // 2 :] = hi_a, -hi_a  # cancels against a constant column
    vb[:, 0] = hi_b
    va[1] = 0.0
    va[2, ::3] = float(get_format(formats[0]).min_subnormal)
    c = torch.randn(m, n, generator=gen) * torch.exp2(
        torch.randint(-140, 120, (m, n), generator=gen)
    )
    c.view(-1)[:9] = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-130), 3e38, -1e-30, 1.0, float("inf"), float("nan")])  # fmt: skip
    # the zero row: c alone, on FP32's subnormal grid of the output bits, normal, huge
    row = [
        2.0**-140,
        3 * 2.0**-139 + 2.0**-149,
        -(2.0**-130),
        1.5 * 2.0**-126,
        2.0**100,
        -(2.0**127),
    ]
    c[1] = torch.tensor(row).repeat(n)[:n]
    ng = -(-k // acc.group)
    t = -(-ng // gpp) if gpp else 1
    sa = torch.randn(m, t, generator=gen).exp()
    sb = torch.randn(t, n, generator=gen).exp()
    sa[0, 0] = 2.0**-70  # a product of scales in float32's subnormal range
    sb[0, 0] = 2.0**-60
    return tuple(x.to(device) for x in (va, vb, c, sa, sb))


def _run_probe(
    run: Callable[..., None], device: torch.device, acc: Accumulator, formats
) -> torch.Tensor:
    """The probe's results (int32 bits, flat; NaN canonical) without and with promotion."""
    outs = []
    for gpp in (0, 2):
        va, vb, c, sa, sb = probe_case(acc, formats, gpp, device)
        accbuf, out = c.clone(), torch.zeros_like(c)
        run(va, vb, accbuf, out, sa, sb, gpp)
        outs += [accbuf, out]
    return canonical_bits(torch.stack(outs))


def torch_reference(
    va, vb, accbuf, out, sa, sb, acc: Accumulator, gpp: int, formats: tuple[str, str]
) -> None:
    """`fused_gemm_torch` (fast) on the same arguments as `fused_gemm_triton`."""
    pa, pb = pow2_exponents(va, formats[0]), pow2_exponents(vb, formats[1])
    fused_gemm_torch(va, pa, vb, pb, accbuf, out, sa, sb, acc, gpp, True)


_verified: dict[tuple[object, ...], bool] = {}


def verified_kernel(
    acc: Accumulator, formats: tuple[str, str], device: torch.device, interpret: bool = False,
    kernel: Any = None,
) -> bool:  # fmt: skip
    """May the Triton kernel run ``acc`` on ``formats`` on ``device``: Triton is there, and the
    kernel gave the torch kernel's bits on `probe_case` (with and without promotion)? Checked
    once per device and model; a mismatch or a failing compile warns (RuntimeWarning) and the
    torch kernel is used there."""
    if not triton_available():
        return False
    key = (device.type, device.index, acc.group, acc.align_bits, acc.out_bits, acc.exp_floor,
           formats, interpret, kernel)  # fmt: skip
    ok = _verified.get(key)
    if ok is not None:
        return ok

    def tri(va, vb, accbuf, out, sa, sb, gpp):
        fused_gemm_triton(va, vb, accbuf, out, sa, sb, acc, gpp, formats, interpret, kernel)

    def ref(va, vb, accbuf, out, sa, sb, gpp):
        torch_reference(va, vb, accbuf, out, sa, sb, acc, gpp, formats)

    try:
        ok = bool(
            torch.equal(
                _run_probe(tri, device, acc, formats), _run_probe(ref, device, acc, formats)
            )
        )
        why = "gave different bits than the torch kernel"
    except Exception as e:  # a compile or launch failure: the torch kernel still works
        ok, why = False, f"failed ({type(e).__name__}: {e})"
    _verified[key] = ok
    if not ok:
        warnings.warn(
            f"fp8lab: the Triton fused-accumulator kernel for {acc.describe()} on "
            f"{formats[0]} x {formats[1]} {why} on {device}; fp8lab uses the torch kernel there "
            "(same bits as numba, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return ok


def triton_status(device: torch.device) -> dict[str, Any]:
    """For a report (scripts/gpu_check.py): the Triton version, whether the fused fast domain
    takes the Triton kernel on ``device`` (``mode``: "jit", "interpret" or None) and, per GPU
    model on E4M3 operands, whether it passed its probe there (and so is used): runs the probes
    (a compile per model on a GPU). JSON-ready."""
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = None
    mode = triton_mode(device)
    out: dict[str, Any] = {"triton": version, "mode": mode, "verified": {}}
    if mode is None:
        return out
    for hw in ("h100", "ada"):
        acc = Accumulator(hw).resolve("e4m3", "e4m3")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            ok = verified_kernel(acc, ("e4m3", "e4m3"), device, mode == "interpret")
        out["verified"][hw] = ok
        # fp8lab's own warnings only: the interpreter's numpy also warns (IEEE overflow to inf,
        # which the probe's huge accumulators are meant to produce)
        ours = [str(w.message) for w in caught if str(w.message).startswith("fp8lab:")]
        if ours:
            out.setdefault("warnings", []).extend(ours)
    return out
