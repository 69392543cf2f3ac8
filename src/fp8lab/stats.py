"""Tensor error statistics: how much a quantization spec damages a tensor.

The one call most users need::

    stats.tensor_stats(x, spec) -> dict
        amax            max |x| (float; NaN ignored)
        dynamic_range   log2(amax / min nonzero |x|) in binades (NaN if x has no nonzero value)
        sqnr_db         10*log10(sum x^2 / sum (x - xq)^2); +inf when xq == x exactly
        cosine          cos(x, xq); 1.0 when both are all-zero, 0.0 when only one is
        rel_error       ||x - xq|| / ||x|| (Frobenius); 0.0 exact, +inf when x == 0 but xq != 0
        underflow_pct   % of the nonzero elements of x that quantize to 0 (0 when x has none)
        saturation_pct  % of all elements whose scaled magnitude exceeds the format's max
                        (clamped to +-max, or Inf/NaN without saturation)
        nonzero_pct     % of nonzero elements of x
        numel           number of elements

``x`` is any floating tensor (statistics computed in float64). ``spec`` is a spec string
(`parse_spec`), a `fp8lab.QuantSpec` (e.g. a recipe role: ``recipe.weight``) or a format name (a
plain cast, scale 1). SQNR can look fine while most small values underflow (the large values
carry the energy): read ``sqnr_db`` and ``underflow_pct`` together. Values are plain Python
floats and may be ``inf``/``nan`` (`json_safe` turns them into None for JSON).

A delayed-scaling spec (a recipe's configuration, or a spec bound to a `DelayedScaling`) is
measured at its steady state, `steady_spec`: the scale delayed scaling reaches on a tensor that
does not change, ``fmt_max * 2**-(margin + nguard) / amax``; no scaling state is read or
written. To measure what a live delayed scale did, quantize yourself and pass the pair:
``error_stats(x, q.dequantize(), fmt, q.values)``.

Spec strings (`parse_spec` -> `fp8lab.QuantSpec`; quantization itself is `fp8lab.quantize`):
``FORMAT`` (a plain cast, scale 1), ``FORMAT:GRAN`` with GRAN ``tensor``, ``row``, ``col``,
``MxK`` (e.g. ``e4m3:128x128``, ``e4m3:1x128``), ``mx`` or ``nvfp4`` (each granularity's natural
scale rule: amax -> format max, OCP MX floor for ``mx``), and the shorthands ``mxfp8``
(= ``e4m3:mx``), ``mxfp8_e5m2``, ``mxfp6``/``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp4``, ``nvfp4``.

Also here: the pair functions on ``(x, xq)`` (`sqnr_db`, `cosine`, `rel_error`, `underflow_pct`,
`saturation_pct`, `amax`, `dynamic_range`), `error_stats` (all of them for a pair),
`block_stats` (per-block tensors), `what_if` (one tensor under several specs) and
`quantized_pair` (the pair the statistics read; ``fake_quant`` is its deprecated name).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab.formats import FloatFormat, get_format
from fp8lab.kernels import use_torch

STAT_KEYS = (
    "amax",
    "dynamic_range",
    "sqnr_db",
    "cosine",
    "rel_error",
    "underflow_pct",
    "saturation_pct",
    "nonzero_pct",
    "numel",
)


# ----------------------------------------------------------------------------- pair statistics
def _f64_check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating tensor, got dtype {x.dtype}")


def _f64(x: torch.Tensor) -> torch.Tensor:
    _f64_check(x)
    return x.detach().to(torch.float64)


def _pair(x: torch.Tensor, xq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _f64(x), _f64(xq)
    if a.shape != b.shape:
        raise ValueError(f"x and xq shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a, b


def sqnr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; ``+inf`` when ``xq == x`` (also all-zero),
    ``-inf`` when ``x`` is all-zero and ``xq`` is not."""
    a, b = _pair(x, xq)
    noise = float(torch.sum((a - b) ** 2))
    signal = float(torch.sum(a * a))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine(x: torch.Tensor, xq: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors; 1.0 if both are all-zero, 0.0 if one is."""
    a, b = _pair(x, xq)
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.sum(a * b)) / (na * nb)


def rel_error(x: torch.Tensor, xq: torch.Tensor) -> float:
    """``||x - xq|| / ||x||``; 0.0 when exact, ``+inf`` when x is all-zero but xq is not."""
    a, b = _pair(x, xq)
    err = float(torch.linalg.vector_norm(a - b))
    if err == 0.0:
        return 0.0
    ref = float(torch.linalg.vector_norm(a))
    return math.inf if ref == 0.0 else err / ref


def underflow_pct(x: torch.Tensor, xq: torch.Tensor) -> float:
    """Percentage of the nonzero elements of ``x`` that became 0 in ``xq`` (0 if none nonzero)."""
    return _clip_percentages(x, xq, None, None)[0]


def saturation_pct(
    x: torch.Tensor,
    xq: torch.Tensor,
    fmt: str | FloatFormat,
    values: torch.Tensor | None = None,
) -> float:
    """Percentage of elements whose scaled magnitude exceeds ``fmt.max``.

    ``values`` are the on-grid values in the scaled domain (``xq`` = values * per-element
    dequantization scale); None means scale 1 (``values = xq``). An element counts when its grid
    value is ``+-max`` while ``|x| > |xq|`` (it was clamped), or when it overflowed to Inf/NaN
    from a finite input (non-saturating casts).
    """
    return _clip_percentages(x, xq, fmt, values)[1]


def clip_percentages(x: torch.Tensor, q: Any) -> tuple[float, float]:
    """``(underflow_pct, saturation_pct)`` of ``x`` quantized as ``q`` (a `fp8lab.QTensor` of
    ``x``'s shape: its dequantized values, scaled values and format) in one lean pass.

    fp8lab's one definition of both percentages: `underflow_pct`, `saturation_pct`,
    `error_stats` (the watch's records) and this function (the guard's) all count with one
    per-element function, `_clip_counts`."""
    return _clip_percentages(x, q.dequantize(), q.spec.fmt, q.values)


def _clip_percentages(x: Any, xq: Any, fmt: Any, values: Any) -> tuple[float, float]:
    """`clip_percentages` of a pair (saturation NaN without ``fmt``; ``values`` None: ``xq``)."""
    a, b, v = _flat_pair(x, xq, values)
    fmax = math.inf if fmt is None else float(get_format(fmt).max)
    if use_torch(a, b, v, what="clip percentages"):
        nnz, nuf, nsat = (int(c.sum()) for c in _clip_counts_torch(a, b, v, fmax))
    else:
        nnz, nuf, nsat = _count_kernel(a.numpy(), b.numpy(), v.numpy(), fmax, SATURATION_TOL)
    return _percent(nnz, nuf, nsat, a.numel(), fmt is not None)


def amax(x: torch.Tensor) -> float:
    """``max |x|`` ignoring NaN (0.0 for an empty tensor)."""
    a = _f64(x).abs()
    a = a[~torch.isnan(a)]
    return float(a.max()) if a.numel() else 0.0


def dynamic_range(x: torch.Tensor) -> float:
    """``log2(amax / min nonzero |x|)`` in binades over the finite values; NaN if none nonzero."""
    a = _f64(x).abs()
    a = a[torch.isfinite(a) & (a != 0)]
    if a.numel() == 0:
        return math.nan
    return math.log2(float(a.max()) / float(a.min()))


def error_stats(
    x: torch.Tensor,
    xq: torch.Tensor,
    fmt: str | FloatFormat | None = None,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every statistic of `STAT_KEYS` for a pair (saturation needs ``fmt``; else NaN).

    Same definitions as the pair functions, computed in one fused pass (numba, float64 sums)
    instead of one pass per statistic.
    """
    a, b, v = _flat_pair(x, xq, values)
    n = a.numel()
    fmax = math.inf if fmt is None else float(get_format(fmt).max)
    if use_torch(a, b, v, what="error stats"):
        sums = _pair_torch(a, b, v, fmax)
    else:
        sums = _pair_kernel(a.numpy(), b.numpy(), v.numpy(), fmax, SATURATION_TOL)
    sxx, sdd, sxq, sqq, nnz, nuf, nsat, amx, mn, mx = sums
    under, sat = _percent(nnz, nuf, nsat, n, fmt is not None)
    if sdd == 0.0:
        sq = math.inf
    elif sxx == 0.0 or sdd == math.inf:  # nothing left, or an overflow (fp16's inf)
        sq = -math.inf
    else:
        sq = 10.0 * math.log10(sxx / sdd)
    if sxx == 0.0 and sqq == 0.0:
        cos = 1.0
    elif sxx == 0.0 or sqq == 0.0:
        cos = 0.0
    else:
        cos = sxq / (math.sqrt(sxx) * math.sqrt(sqq))
    if sdd == 0.0:
        rel = 0.0
    elif sxx == 0.0:
        rel = math.inf
    else:
        rel = math.sqrt(sdd) / math.sqrt(sxx)
    return {
        "amax": float(amx),
        "dynamic_range": math.log2(mx / mn) if mx > 0 else math.nan,
        "sqnr_db": sq,
        "cosine": cos,
        "rel_error": rel,
        "underflow_pct": under,
        "saturation_pct": sat,
        "nonzero_pct": 100.0 * nnz / n if n else 0.0,
        "numel": n,
    }


#: an element counts as clamped when ``|x| > |xq| * (1 + SATURATION_TOL)``: 2^-20 relative is
#: above the float32 rounding noise of the de-scaling multiply (xq = v * s)
SATURATION_TOL = 2.0**-20


def _percent(nnz: int, nuf: int, nsat: int, n: int, with_fmt: bool) -> tuple[float, float]:
    """(underflow %, saturation %) from the counts of `_clip_counts` over ``n`` elements."""
    under = 100.0 * nuf / nnz if nnz else 0.0
    return under, (100.0 * nsat / n if n else 0.0) if with_fmt else math.nan


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D tensor (float32, or float64 for float64 input; bf16/fp16 exact)."""
    t = t.detach()
    if t.dtype != torch.float64:
        t = t.to(torch.float32)
    return t.contiguous().reshape(-1)


def _flat_pair(
    x: torch.Tensor, xq: torch.Tensor, values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``xq`` and ``values`` (default ``xq``) as flat arrays, checked (TypeError for
    anything but floating tensors, ValueError for differing shapes)."""
    for t in (x, xq) if values is None else (x, xq, values):
        _f64_check(t)
    if x.shape != xq.shape:
        raise ValueError(f"x and xq shapes differ: {tuple(x.shape)} vs {tuple(xq.shape)}")
    if values is not None and values.shape != x.shape:
        raise ValueError(f"values shape {tuple(values.shape)} differs from x {tuple(x.shape)}")
    b = _flat(xq)
    return _flat(x), b, (b if values is None else _flat(values))


def _clip_counts_torch(
    x: torch.Tensor, xq: torch.Tensor, v: torch.Tensor, fmax: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_clip_counts` over whole flat tensors on any device (float64, as the kernel): the bool
    tensors ``(nonzero, underflowed, saturated)``; their sums are the kernels' counts."""
    a, b, vv = (t.to(torch.float64) for t in (x, xq, v))
    nz = a != 0.0
    clamped = (vv.abs() == fmax) & (a.abs() > b.abs() * (1.0 + SATURATION_TOL))
    return nz, nz & (b == 0.0), torch.where(torch.isfinite(vv), clamped, torch.isfinite(a))


def _pair_torch(x: torch.Tensor, xq: torch.Tensor, v: torch.Tensor, fmax: float) -> tuple:
    """`_pair_kernel` on any device: the same float64 sums (in torch's summation order, so they
    may differ from the serial kernel's in the last bits), the same exact counts and extrema."""
    nnz, nuf, nsat = (int(c.sum()) for c in _clip_counts_torch(x, xq, v, fmax))
    a, b = x.to(torch.float64), xq.to(torch.float64)
    d = a - b
    sums = [float(torch.sum(p * q)) for p, q in ((a, a), (d, d), (a, b), (b, b))]
    aa = a.abs()
    amx = float(torch.nan_to_num(aa, nan=0.0, posinf=math.inf).amax()) if a.numel() else 0.0
    keep = (a != 0.0) & torch.isfinite(a)
    mn = float(torch.where(keep, aa, math.inf).amin()) if a.numel() else math.inf
    mx = float(torch.where(keep, aa, 0.0).amax()) if a.numel() else 0.0
    return (*sums, nnz, nuf, nsat, amx, mn, mx)


@njit(inline="always")
def _clip_counts(a, b, vv, fmax, tol):  # pragma: no cover - compiled
    """One element's ``(nonzero, underflowed, saturated)``, each 0 or 1: the one definition of
    both percentages. ``a`` high precision, ``b`` dequantized, ``vv`` its scaled value (float64).
    Underflowed: ``a`` nonzero (NaN counts) and ``b`` zero. Saturated: ``vv`` at +-``fmax`` while
    ``|a| > |b| * (1 + tol)`` (clamped), or ``vv`` Inf/NaN from a finite ``a`` (overflowed)."""
    nz = 1 if a != 0.0 else 0
    uf = 1 if nz == 1 and b == 0.0 else 0
    if np.isfinite(vv):
        sat = 1 if abs(vv) == fmax and abs(a) > abs(b) * (1.0 + tol) else 0
    else:
        sat = 1 if np.isfinite(a) else 0
    return nz, uf, sat


@njit(cache=True)
def _count_kernel(x, xq, v, fmax, tol):  # pragma: no cover - compiled
    """``(nonzero, underflowed, saturated)`` over flat arrays: `_clip_counts` summed, without
    `_pair_kernel`'s float64 sums (the guard's lean pass)."""
    nnz = 0
    nuf = 0
    nsat = 0
    for i in range(x.size):
        nz, uf, sat = _clip_counts(np.float64(x[i]), np.float64(xq[i]), np.float64(v[i]), fmax, tol)
        nnz += nz
        nuf += uf
        nsat += sat
    return nnz, nuf, nsat


@njit(cache=True)
def _pair_kernel(x, xq, v, fmax, tol):  # pragma: no cover - compiled
    sxx = 0.0
    sdd = 0.0
    sxq = 0.0
    sqq = 0.0
    nnz = 0
    nuf = 0
    nsat = 0
    amx = 0.0
    mn = np.inf
    mx = 0.0
    for i in range(x.size):
        a = np.float64(x[i])
        b = np.float64(xq[i])
        d = a - b
        sxx += a * a
        sdd += d * d
        sxq += a * b
        sqq += b * b
        aa = abs(a)
        if aa > amx:  # NaN never compares greater: ignored
            amx = aa
        if a != 0.0 and np.isfinite(a):
            mn = min(mn, aa)
            mx = max(mx, aa)
        nz, uf, sat = _clip_counts(a, b, np.float64(v[i]), fmax, tol)
        nnz += nz
        nuf += uf
        nsat += sat
    return sxx, sdd, sxq, sqq, nnz, nuf, nsat, amx, mn, mx


# --------------------------------------------------------------------------------------- specs
_SHORTHANDS: dict[str, tuple[str, str]] = {
    "mxfp8": ("e4m3", "mx"),
    "mxfp8_e4m3": ("e4m3", "mx"),
    "mxfp8_e5m2": ("e5m2", "mx"),
    "mxfp6": ("e2m3", "mx"),
    "mxfp6_e2m3": ("e2m3", "mx"),
    "mxfp6_e3m2": ("e3m2", "mx"),
    "mxfp4": ("e2m1", "mx"),
    "nvfp4": ("e2m1", "nvfp4"),
}
_BLOCK = re.compile(r"^(\d+|-1)x(\d+|-1)$")


def parse_spec(spec: Any) -> Any:
    """A `fp8lab.QuantSpec` from a spec string (see the module docstring); a QuantSpec passes
    through. A bare format name is a plain cast (fixed multiplier 1.0)."""
    from fp8lab.qtensor import QuantSpec

    if not isinstance(spec, str):
        if isinstance(spec, QuantSpec):
            return spec
        raise TypeError(f"spec must be a spec string or a QuantSpec, got {type(spec).__name__}")
    s = spec.strip().lower()
    if s in _SHORTHANDS:
        fmt, gran = _SHORTHANDS[s]
        return QuantSpec(format=fmt, granularity=gran)
    fmt_name, _, gran = s.partition(":")
    try:
        fmt = get_format(fmt_name).name
    except ValueError as exc:
        raise ValueError(f"bad spec {spec!r}: {exc}") from None
    if not gran:
        return QuantSpec(format=fmt, granularity="tensor", scaling=1.0)
    if gran in ("tensor", "row", "col", "mx", "mx_col", "nvfp4", "nvfp4_col"):
        return QuantSpec(format=fmt, granularity=gran)
    m = _BLOCK.match(gran)
    if not m or int(m.group(1)) == 0 or int(m.group(2)) == 0:
        raise ValueError(
            f"bad spec {spec!r}: the granularity after ':' must be tensor, row, col, mx, nvfp4 "
            "or MxK (e.g. 128x128, 1x128)"
        )
    return QuantSpec(format=fmt, granularity=(int(m.group(1)), int(m.group(2))))


def spec_name(spec: Any) -> str:
    """Printable name of a spec: the string itself, or `QuantSpec.describe` (the one text form:
    ``format:granularity:scaling`` plus the fields that differ from their defaults)."""
    return spec if isinstance(spec, str) else spec.describe()


def _blocks(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] -> zero-padded [nr, nc, m*k] block view."""
    from fp8lab.scaling.granularity import pad_to_blocks, resolve_block

    m, k = resolve_block(block, tuple(x2d.shape))
    xp = pad_to_blocks(x2d, (m, k))
    nr, nc = xp.shape[0] // m, xp.shape[1] // k
    return xp.reshape(nr, m, nc, k).permute(0, 2, 1, 3).reshape(nr, nc, m * k)


def steady_spec(spec: Any) -> Any:
    """The spec one-off statistics measure: a delayed-scaling spec (config or bound state)
    becomes current scaling (``"max"``) with its total margin ``margin + nguard`` -- delayed
    scaling's steady state on a tensor that does not change (step 0's scale of 1.0 would say
    nothing about the recipe); other specs pass through (`parse_spec`)."""
    spec = parse_spec(spec)
    if spec.is_delayed:
        return dataclasses.replace(spec, scaling="max", margin=spec.scaling.total_margin)
    return spec


def quantized_pair(x: torch.Tensor, spec: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Quantize-dequantize ``x`` under ``spec`` with `fp8lab.quantize` (delayed specs as
    `steady_spec`): the pair (and scaled values) the statistics read. Not `fp8lab.fake_quant`
    (which returns the dequantized tensor alone); ``stats.fake_quant`` is a deprecated alias.

    Returns ``(xq, values, format_name)``: ``xq`` the dequantized tensor (x's shape), ``values``
    the on-grid values in the scaled domain (same shape; used for the saturation count).
    """
    from fp8lab.qtensor import quantize

    spec = steady_spec(spec)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("quantized_pair expects a floating torch.Tensor")
    q = quantize(x.detach(), spec)
    return q.dequantize().reshape(x.shape), q.values.reshape(x.shape), spec.fmt.name


# ------------------------------------------------------------------------- tensor-level APIs
def tensor_stats(x: torch.Tensor, spec: Any = "e4m3:tensor") -> dict[str, float]:
    """Every statistic of `STAT_KEYS` for ``x`` quantized under ``spec`` (see the docstring)."""
    xq, values, fmt = quantized_pair(x, spec)
    return error_stats(x, xq, fmt, values)


def block_stats(
    x: torch.Tensor,
    xq: torch.Tensor,
    block: str | tuple[int, int] | Sequence[int] = (128, 128),
) -> dict[str, torch.Tensor]:
    """Per-block statistics over the ``[R, C]`` view of a pair, each a float64 ``[nr, nc]``
    tensor: ``amax``, ``sqnr_db`` (+inf exact), ``rel_error``, ``underflow_pct`` (NaN-free: 0
    for a block without nonzeros) and ``dynamic_range`` (NaN for an all-zero block)."""
    from fp8lab.scaling.granularity import as_2d, normalize_granularity

    a, b = _pair(x, xq)
    blk = normalize_granularity(block)
    ab = _blocks(as_2d(a), blk)
    bb = _blocks(as_2d(b), blk)
    sig = (ab * ab).sum(dim=2)
    noise = ((ab - bb) ** 2).sum(dim=2)
    with torch.no_grad():
        sq = 10.0 * torch.log10(sig / noise)
    sq = torch.where(noise == 0, torch.full_like(sq, math.inf), sq)
    rel = torch.where(noise == 0, torch.zeros_like(sig), torch.sqrt(noise / sig))
    nz = ab != 0
    n_nz = nz.sum(dim=2)
    uf = 100.0 * (nz & (bb == 0)).sum(dim=2) / n_nz.clamp(min=1)
    mag = ab.abs()
    bmax = mag.amax(dim=2) if mag.numel() else torch.zeros(sig.shape, dtype=sig.dtype)
    bmin = torch.where(nz, mag, torch.full_like(mag, math.inf)).amin(dim=2)
    dr = torch.where(n_nz > 0, torch.log2(bmax / bmin), torch.full_like(bmax, math.nan))
    return {
        "amax": bmax,
        "sqnr_db": sq,
        "rel_error": rel,
        "underflow_pct": uf.to(torch.float64),
        "dynamic_range": dr,
    }


def block_summary(per_block: dict[str, torch.Tensor]) -> dict[str, float]:
    """Worst / median of `block_stats` output: ``min_block_sqnr_db``, ``median_block_sqnr_db``,
    ``max_block_underflow_pct``, ``max_block_dynamic_range``."""
    sq = per_block["sqnr_db"].flatten()
    uf = per_block["underflow_pct"].flatten()
    dr = per_block["dynamic_range"].flatten()
    dr = dr[~torch.isnan(dr)]
    return {
        "min_block_sqnr_db": float(sq.min()) if sq.numel() else math.nan,
        "median_block_sqnr_db": float(sq.median()) if sq.numel() else math.nan,
        "max_block_underflow_pct": float(uf.max()) if uf.numel() else math.nan,
        "max_block_dynamic_range": float(dr.max()) if dr.numel() else math.nan,
    }


def what_if(x: torch.Tensor, specs: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per spec: ``{"spec": name, **tensor_stats(x, spec)}``, in the order given."""
    rows = []
    for spec in specs:
        rows.append({"spec": spec_name(spec), **tensor_stats(x, spec)})
    if not rows:
        raise ValueError("what_if needs at least one spec")
    return rows


def json_safe(obj: Any) -> Any:
    """Recursively replace non-finite floats by None (JSON has no NaN/Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def __getattr__(name: str) -> Any:
    # deprecated name of quantized_pair (fp8lab.fake_quant is the public quantize-dequantize)
    if name == "fake_quant":
        import warnings

        warnings.warn(
            "fp8lab.stats.fake_quant is deprecated: use fp8lab.stats.quantized_pair",
            DeprecationWarning,
            stacklevel=2,
        )
        return quantized_pair
    raise AttributeError(f"module 'fp8lab.stats' has no attribute {name!r}")
