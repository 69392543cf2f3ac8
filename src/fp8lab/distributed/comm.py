"""Numerics of low-precision gradient all-reduce: a ring all-reduce simulated in one process.

A pure-function study (not an engine): ``N`` simulated ranks each hold a float32 gradient;
`ring_allreduce` runs the ring schedule of NCCL/gloo (reduce-scatter then all-gather over ``N`` chunks) with every
message rounded onto the communication precision, and returns the averaged gradient (identical on
every rank by construction), the underflow/overflow of the partial sums and the bytes sent.

The schedule. The flat gradient (one bucket at a time, ``bucket_numel`` elements) is split into
``N`` chunks (`torch.tensor_split`: the first ``numel % N`` chunks are one element longer). Chunk
``c`` starts on rank ``c``; at hop ``k = 1..N-1`` rank ``c+k (mod N)`` receives the partial sum
of ranks ``c..c+k-1``, adds its own value and sends on. Rank ``c-1 (mod N)`` ends with the full sum
and sends it round the ring (``N-1`` hops of the all-gather). So a chunk's sum is formed in the
order ``c, c+1, ..., c-1``, and every rank sends ``2(N-1)`` chunk messages per bucket.

Precisions (``--grad-comm``):

``fp32``       DDP's default hook: ``g / N`` (one float32 division) on each rank, float32 partial
               sums.
``bf16``       ``g / N`` then bfloat16 buffers (PyTorch's ``bf16_compress_hook`` keeps the buffer in
               bf16): every partial sum ``bf16(float(recv) + float(local))``; the result is bf16.
``fp8``        E5M2 messages with per-message current scaling (TE ``max`` rule: ``scale =
               57344 / amax`` of the message, sent with it as one float32): ``g / N`` stays float32
               on the rank; every partial sum is quantized when sent (``cast(x * scale)``),
               dequantized on receipt (``code * (1/scale)``) and added to the local float32 value;
               the reduced chunk is quantized once more for the all-gather (every rank, its owner
               included, keeps that dequantized value, so all ranks agree bit for bit).
``fp8-msamp``  MS-AMP (Azure/MS-AMP ``msamp/common/tensor/meta.py``: ``compute_scaling_factor``;
               FP8-LM, arXiv 2310.18313): E4M3 with one scale per bucket for all ranks, from the
               global amax of the gradients (an all-reduce MAX of 4 bytes per rank); the scale is
               the power of two ``2**floor(log2(448 / amax))``. Each rank quantizes its gradient
               pre-divided by ``sqrt(N)`` (``cast((g / sqrt(N)) * scale)``), the ring sums E4M3
               values in the scaled domain (``cast(p + q)``: the sum of two E4M3 values is exact
               in float32, then one rounding),
               and the result is ``p / scale / sqrt(N)``. Splitting ``1/N`` into ``1/sqrt(N)``
               before and after keeps partial sums away from both underflow (``/N`` first) and
               overflow: a sum of ``N`` values of random signs grows like ``sqrt(N)``, but
               correlated gradients (all ranks agree) still saturate.

Counters (per message element, over all hops of the reduce-scatter and the all-gather):
``underflow`` = a nonzero value that rounds to zero on the wire; ``overflow`` = a value beyond the
format's range (saturated to its max: fp8 casts saturate, as TE's and NCCL's FP8 conversions
``__NV_SATFINITE`` do; bf16 overflows to inf). Bytes are counted from the message sizes and
formats: data ``2(N-1)/N`` of the bucket per rank, plus 4 bytes per fp8 message (its scale) or
the 4-byte amax all-reduce of ``fp8-msamp`` (counted as ``N-1`` messages of 4 bytes per rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from fp8lab.formats import cast, get_format
from fp8lab.scaling.rules import max_scale, scale_inv_of

GRAD_COMMS = ("fp32", "bf16", "fp8", "fp8-msamp")
#: element format on the wire
WIRE_FORMAT = {"fp32": "fp32", "bf16": "bf16", "fp8": "e5m2", "fp8-msamp": "e4m3"}
#: element bytes on the wire per precision
WIRE_BYTES = {p: get_format(f).bits // 8 for p, f in WIRE_FORMAT.items()}

__all__ = [
    "GRAD_COMMS",
    "WIRE_BYTES",
    "WIRE_FORMAT",
    "CommResult",
    "bytes_per_rank",
    "check_grad_comm",
    "msamp_scale",
    "ring_allreduce",
    "study",
    "synthetic_grads",
]


def check_grad_comm(name: str) -> str:
    """``name`` if it is one of `GRAD_COMMS`, else ValueError naming it."""
    if name not in GRAD_COMMS:
        raise ValueError(f"unknown gradient communication {name!r}: expected one of {GRAD_COMMS}")
    return name


@dataclass
class CommResult:
    """What one simulated all-reduce gives: the averaged gradient and its wire statistics.

    ``out`` is float32 of the input's per-rank shape. ``messages`` counts the message elements
    rounded onto the wire format (all ranks, all hops; 0 for fp32); ``underflow``/``overflow``
    count those of them that underflowed / overflowed (module doc).
    ``bytes_per_rank`` is the mean bytes one rank sends for the whole gradient.
    """

    out: torch.Tensor
    precision: str
    ranks: int
    messages: int = 0
    underflow: int = 0
    overflow: int = 0
    bytes_per_rank: float = 0.0
    scales: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The wire statistics (every field but ``out`` and ``scales``), in field order."""
        keys = ("precision", "ranks", "messages", "underflow", "overflow", "bytes_per_rank")
        return {k: getattr(self, k) for k in keys}


def msamp_scale(amax: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """MS-AMP's power-of-two multiplier ``2**floor(log2(fmt_max / amax))`` (float32 scalar);
    amax 0, inf or NaN -> 1. Computed on exact float64 values (no float ``log2`` rounding)."""
    a = float(amax)
    fmax = get_format(fmt).max
    if not (math.isfinite(a) and a > 0):
        return torch.ones((), dtype=torch.float32)
    q = Fraction(fmax) / Fraction(a)  # exact: floor(log2) of a rounded quotient can be off by one
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    e = max(min(e, 127), -126)
    return torch.tensor(2.0**e, dtype=torch.float32)


def _split(n: int, parts: int) -> list[int]:
    """Chunk lengths of `torch.tensor_split` of ``n`` elements into ``parts``."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def _chunks(grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``[N, numel]`` -> zero-padded ``[N ranks, N chunks, C]`` and the real-element mask."""
    n, numel = grads.shape
    sizes = _split(numel, n)
    width = max(sizes)
    out = torch.zeros((n, n, width), dtype=torch.float32, device=grads.device)
    mask = torch.zeros((n, width), dtype=torch.bool, device=grads.device)
    start = 0
    for c, s in enumerate(sizes):
        out[:, c, :s] = grads[:, start : start + s]
        mask[c, :s] = True
        start += s
    return out, mask, sizes


class _Wire:
    """Rounds messages ``[N chunks, C]`` onto the wire precision and counts what is lost."""

    def __init__(self, precision: str, mask: torch.Tensor) -> None:
        self.precision = precision
        self.mask = mask
        self.messages = 0
        self.underflow = 0
        self.overflow = 0

    def _count(self, x: torch.Tensor, q: torch.Tensor, unsat: torch.Tensor) -> None:
        self.messages += int(self.mask.sum())
        self.underflow += int(((x != 0) & (q == 0) & self.mask).sum())
        self.overflow += int((~torch.isfinite(unsat) & torch.isfinite(x) & self.mask).sum())

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        q = _bf16(x)
        self._count(x, q, q)
        return q

    def fp8_current(self, x: torch.Tensor) -> torch.Tensor:
        """Per-message current scaling (one scale per chunk row), quantize, dequantize."""
        amax = x.abs().amax(dim=1)
        scale = max_scale(amax, "e5m2").reshape(-1, 1)
        scaled = x * scale
        q = cast(scaled, "e5m2")
        self._count(scaled, q, cast(scaled, "e5m2", saturate=False))
        return q * scale_inv_of(scale)

    def e4m3(self, scaled: torch.Tensor) -> torch.Tensor:
        q = cast(scaled, "e4m3")
        self._count(scaled, q, cast(scaled, "e4m3", saturate=False))
        return q


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (nearest-even, overflow to inf: torch's conversion, the one gloo and NCCL
    buffers get) and back to float32."""
    return x.to(torch.bfloat16).to(torch.float32)


def _reduce_scatter(g: torch.Tensor, step: Any) -> torch.Tensor:
    """Ring reduce-scatter of ``g`` ``[N ranks, N chunks, C]``: chunk ``c`` summed in rank order
    ``c, c+1, ..., c-1``; ``step(sent, local)`` forms the next partial sum."""
    n = g.shape[0]
    chunk = torch.arange(n, device=g.device)
    acc = g[chunk, chunk].clone()  # chunk c starts on rank c
    for k in range(1, n):
        acc = step(acc, g[(chunk + k) % n, chunk])
    return acc


def ring_allreduce(
    grads: torch.Tensor | list[torch.Tensor],
    precision: str = "fp32",
    bucket_numel: int | None = None,
) -> CommResult:
    """The averaged gradient ``mean_r grads[r]`` of a ring all-reduce at ``precision``.

    Args:
        grads: ``[N, ...]`` float32 (or a list of ``N`` same-shape tensors), one gradient per
            simulated rank, ``N >= 1``.
        precision: one of `GRAD_COMMS` (module doc).
        bucket_numel: elements per bucket (DDP's buckets; each bucket is all-reduced alone and,
            for the fp8 modes, scaled alone); None = one bucket.
    """
    check_grad_comm(precision)
    g = torch.stack(list(grads)) if isinstance(grads, (list, tuple)) else grads
    if g.dtype != torch.float32:
        raise ValueError(f"grads must be float32, got {g.dtype}")
    if g.dim() < 1 or g.shape[0] < 1:
        raise ValueError(f"grads must be [N ranks, ...] with N >= 1, got shape {tuple(g.shape)}")
    n = g.shape[0]
    flat = g.reshape(n, -1)
    numel = flat.shape[1]
    if bucket_numel is None:
        bucket_numel = max(numel, 1)
    if int(bucket_numel) < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    res = CommResult(
        out=torch.empty(flat.shape[1:], dtype=torch.float32, device=flat.device),
        precision=precision,
        ranks=n,
    )
    for start in range(0, numel, int(bucket_numel)):
        stop = min(start + int(bucket_numel), numel)
        res.out[start:stop] = _bucket(flat[:, start:stop], precision, res)
    res.bytes_per_rank = bytes_per_rank(numel, n, precision, bucket_numel)
    res.out = res.out.reshape(g.shape[1:])
    return res


def _bucket(flat: torch.Tensor, precision: str, res: CommResult) -> torch.Tensor:
    """One bucket ``[N, b]`` through the ring; counters added to ``res``."""
    n = flat.shape[0]
    if n == 1:
        return _single(flat[0], precision, res)
    if precision == "fp8-msamp":
        root = torch.tensor(math.sqrt(n), dtype=torch.float32)
        # the scale maps the global amax of g itself to 448; dividing by sqrt(N) first leaves
        # sqrt(N) of headroom, which a sum of N values of random signs grows by
        scale = msamp_scale(flat.abs().amax())
        res.scales.append(float(scale))
        pre = flat / root
        g, mask, sizes = _chunks(pre * scale)  # power-of-two scale: exact unless subnormal
        wire = _Wire(precision, mask)
        q = torch.stack([wire.e4m3(g[r]) for r in range(n)])  # each rank's own codes
        acc = _reduce_scatter(q, lambda p, local: wire.e4m3(p + local))
        # the all-gather forwards E4M3 codes unchanged: nothing more is rounded
        out = acc / scale / root
    else:
        g, mask, sizes = _chunks(flat / n)
        wire = _Wire(precision, mask)
        if precision == "fp32":
            acc = _reduce_scatter(g, lambda p, local: p + local)
            out = acc
        elif precision == "bf16":
            g = _bf16(g)  # the bf16 gradient buffer
            # NCCL/gloo add two bf16 values in float32 and round the sum to bf16
            acc = _reduce_scatter(g, lambda p, local: wire.bf16(p + local))
            out = acc
        else:
            acc = _reduce_scatter(g, lambda p, local: wire.fp8_current(p) + local)
            out = wire.fp8_current(acc)
    res.messages += wire.messages
    res.underflow += wire.underflow
    res.overflow += wire.overflow
    return torch.cat([out[c, :s] for c, s in enumerate(sizes)])


def _single(x: torch.Tensor, precision: str, res: CommResult) -> torch.Tensor:
    """N = 1: no message is sent; the buffer precision still applies (as DDP's hooks do)."""
    return _bf16(x) if precision == "bf16" else x.clone()


def bytes_per_rank(
    numel: int, ranks: int, precision: str, bucket_numel: int | None = None
) -> float:
    """Mean bytes one rank sends to all-reduce ``numel`` gradient elements (module doc).

    Data: each of a bucket's ``N`` chunks makes ``2(N-1)`` hops, so a rank sends ``2(N-1)/N`` of
    the bucket. ``fp8`` adds a 4-byte scale per message (``2(N-1)`` per bucket and
    rank), ``fp8-msamp`` a 4-byte amax all-reduce (``N-1`` messages per bucket and rank).
    """
    check_grad_comm(precision)
    n = int(ranks)
    if n <= 1 or numel <= 0:
        return 0.0
    bucket = int(bucket_numel) if bucket_numel is not None else int(numel)
    buckets = -(-int(numel) // bucket)
    data = 2.0 * (n - 1) / n * numel * WIRE_BYTES[precision]
    extra = 0.0
    if precision == "fp8":
        extra = 2.0 * (n - 1) * 4 * buckets
    elif precision == "fp8-msamp":
        extra = (n - 1) * 4.0 * buckets
    return data + extra


def synthetic_grads(
    ranks: int, numel: int, *, spread: float = 2.0, shared: float = 0.5, seed: int = 0
) -> torch.Tensor:
    """``[ranks, numel]`` float32 gradients for the study: per element a log-normal magnitude
    ``exp(spread * z)`` (``spread`` in natural-log units: 2.0 spans ~12 binades at 2 sigma) times
    ``sqrt(shared) * common + sqrt(1 - shared) * own`` normal noise, so ranks agree to a degree
    ``shared`` in [0, 1] (data-parallel gradients of one model)."""
    if not 0.0 <= shared <= 1.0:
        raise ValueError(f"shared must be in [0, 1], got {shared}")
    if ranks < 1 or numel < 1:
        raise ValueError(f"ranks and numel must be >= 1, got {ranks}, {numel}")
    gen = torch.Generator().manual_seed(int(seed))
    mag = torch.exp(torch.randn(numel, generator=gen, dtype=torch.float64) * float(spread))
    common = torch.randn(numel, generator=gen, dtype=torch.float64)
    own = torch.randn(ranks, numel, generator=gen, dtype=torch.float64)
    g = mag * (math.sqrt(shared) * common + math.sqrt(1.0 - shared) * own)
    return g.to(torch.float32)


def study(
    ranks: list[int],
    precisions: list[str],
    numel: int,
    *,
    bucket_numel: int | None = None,
    spread: float = 2.0,
    shared: float = 0.5,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """`ring_allreduce` for every (ranks, precision) on `synthetic_grads`; one row each.

    Row fields: ``ranks``, ``grad_comm``, ``rel_error`` (``||out - fp32|| / ||fp32||`` against the
    fp32 ring all-reduce of the same gradients), ``max_rel_error`` (``max |out - fp32| /
    max |fp32|``), ``exact_rel_error`` (against the exact float64 mean), ``zeroed`` (fraction of
    elements nonzero in fp32 but 0 here), ``underflow``/``overflow`` (fractions of the rounded
    message elements), ``bytes_per_rank`` and ``bytes_vs_fp32``.
    """
    for p in precisions:
        check_grad_comm(p)
    rows = []
    for n in ranks:
        g = synthetic_grads(int(n), int(numel), spread=spread, shared=shared, seed=seed)
        exact = g.double().mean(0)
        base = ring_allreduce(g, "fp32", bucket_numel)
        ref = base.out.double()
        fp32_bytes = base.bytes_per_rank
        for p in precisions:
            r = base if p == "fp32" else ring_allreduce(g, p, bucket_numel)
            out = r.out.double()
            msgs = max(r.messages, 1)
            rows.append(
                {
                    "ranks": int(n),
                    "grad_comm": p,
                    "rel_error": _ratio((out - ref).norm(), ref.norm()),
                    "max_rel_error": _ratio((out - ref).abs().max(), ref.abs().max()),
                    "exact_rel_error": _ratio((out - exact).norm(), exact.norm()),
                    "zeroed": float(((ref != 0) & (out == 0)).double().mean()),
                    "underflow": r.underflow / msgs,
                    "overflow": r.overflow / msgs,
                    "bytes_per_rank": r.bytes_per_rank,
                    "bytes_vs_fp32": _ratio(r.bytes_per_rank, fp32_bytes),
                }
            )
    return rows


def _ratio(a: Any, b: Any) -> float:
    a, b = float(a), float(b)
    return a / b if b != 0 else (0.0 if a == 0 else math.inf)
