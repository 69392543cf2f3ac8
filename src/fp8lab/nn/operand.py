"""`Operand`: one GEMM operand, and how the Linear Function obtains it.

An `Operand` is the high-precision ``source`` (natural layout), what the GEMM consumes (``used``:
a float32 tensor, possibly rounded to bf16/fp16, or a `QTensor`) and its dequantized view
(`Operand.dense`). `prepare` makes one from fp32 under an `OperandPlan`; `keep_for_backward` is
what the forward keeps for a backward GEMM and `from_forward` rebuilds the backward operand from it
(`Reuse`). `gemm` multiplies two operands under an accumulator.

Buffers come from the shared pool (`fp8lab.nn.buffers`) when a ``held`` list is given; where a
GEMM will run on the dequantized operand (fp32 accumulation with scales varying along K, or the
source of a re-tiling) the dequantized copy is written in the same pass as the quantized values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp8lab.gemm import Accumulator, qmatmul
from fp8lab.nn._kernels import round_bf16
from fp8lab.nn.buffers import POOL
from fp8lab.nn.plan import OperandPlan, Reuse
from fp8lab.qtensor import QTensor, QuantSpec, quantize, retile

__all__ = [
    "COLLECTORS",
    "Operand",
    "from_forward",
    "gemm",
    "keep_for_backward",
    "prepare",
    "round_high_precision",
]

_HP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def round_high_precision(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` rounded to ``precision`` (``fp32``: returned as is), as a float32 tensor.

    Round-to-nearest-even, overflowing to inf like real bf16/fp16 arithmetic, NaN kept: bf16 by a
    one-pass bit kernel (`fp8lab.nn._kernels.round_bf16`), fp16 through torch's conversion.
    """
    if precision == "fp32":
        return x
    if precision == "bf16" and x.dtype == torch.float32:
        return round_bf16(x)
    return x.to(_HP_DTYPES[precision]).to(torch.float32)


@dataclass(frozen=True, slots=True)
class Operand:
    """One GEMM operand: ``used``, what the GEMM consumes (a float32 tensor, possibly rounded to
    bf16/fp16, or a `QTensor`; None when only the source is kept), and ``source``, the
    high-precision tensor it was made from (natural layout; None once no longer needed).
    ``shadow``: a high-precision cell's nominal quantization, kept for a later GEMM
    (`fp8lab.nn.plan.OperandPlan.shadow`)."""

    used: torch.Tensor | QTensor | None
    source: torch.Tensor | None = None
    shadow: QTensor | None = None

    def dense(self) -> torch.Tensor:
        """The float32 tensor the operand stands for: the QTensor's memoised dequantized copy
        (written in the quantization pass where a GEMM needs it; shared with ``t()``)."""
        u = self.used
        return u.dequantize() if isinstance(u, QTensor) else u  # type: ignore[return-value]

    def t(self) -> Operand:
        """The transposed operand (2-D)."""
        return Operand(
            None if self.used is None else self.used.t(),
            None if self.source is None else self.source.t(),
        )


# --------------------------------------------------------------------------- collection hook
class _Collectors(threading.local):
    def __init__(self) -> None:
        self.active: list[Callable[[str, str, str, torch.Tensor, Any], None]] = []


#: callbacks of `fp8lab.nn.collect_operands` active on this thread
COLLECTORS = _Collectors()


def _record(op: OperandPlan, source: torch.Tensor, used: torch.Tensor | QTensor) -> None:
    # ``used``: the QTensor itself when quantized, so a sampler (fp8lab.observe) reads its
    # scaled values and scales instead of quantizing again; collect_operands dequantizes it
    for c in COLLECTORS.active:
        c(op.layer or "?", op.gemm, op.role, source, used)


# --------------------------------------------------------------------------- preparation
def _quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    held: list[torch.Tensor] | None,
    want_dense: bool,
    retile_from: QTensor | None = None,
) -> QTensor:
    """Quantize ``x`` (or re-tile ``retile_from``, whose dequantized tensor ``x`` is) into pooled
    buffers when ``held`` is given; with ``want_dense`` the dequantized copy is written in the
    same pass (the QTensor keeps it as its memoised `QTensor.dequantize`)."""
    if held is None:
        out = deq = None
    else:
        out = POOL.take(tuple(x.shape), held)
        deq = POOL.take(tuple(x.shape), held) if want_dense else None
    if retile_from is None:
        q = quantize(x, spec, out=out, dequantized_out=deq)
    else:
        # the added-error measurement is a diagnostic pass nn does not report: skip it
        q = retile(
            retile_from, spec=spec, measure_error=False, dequantized=x, out=out,
            dequantized_out=deq,
        )  # fmt: skip
    return q


def prepare(x: torch.Tensor, op: OperandPlan, held: list[torch.Tensor] | None) -> Operand:
    """The operand ``op`` made from the float32 tensor ``x`` (natural layout): rounded to the
    GEMM's high precision, quantized under ``op.spec``, or ``x`` itself.

    ``held``: take buffers from the pool and append them to this list (the caller returns them
    once the operand is dead); ``None`` allocates (also while operands are being collected)."""
    if COLLECTORS.active:
        held = None
    hp = op.high_precision
    if hp == "bf16" and x.dtype == torch.float32 and held is not None:
        used: torch.Tensor | QTensor = round_bf16(
            x.contiguous(), out=POOL.take(tuple(x.shape), held)
        )
    elif hp is not None:
        used = round_high_precision(x, hp)
    elif op.spec is None:
        used = x
    elif (pre := getattr(x, "fp8lab_gathered", None)) is not None and pre[0] == op.spec:
        used = pre[1]  # a weight FSDP gathered as FP8 codes under this spec (fp8lab.dist.fsdp)
    else:
        used = _quantize(x, op.spec, held, op.wants_dense(tuple(x.shape)))
    shadow = None
    if op.shadow is not None:  # the later GEMM's operand: as if this cell were not switched
        shadow = _quantize(x, op.shadow, held, want_dense=True)
    operand = Operand(used, x, shadow)
    if COLLECTORS.active:
        _record(op, x, operand.used)  # type: ignore[arg-type]
    return operand


def keep_for_backward(operand: Operand, later: OperandPlan) -> Operand:
    """What the forward keeps of ``operand`` for the backward GEMM ``later``: the operand when
    ``later`` reuses or re-tiles it, else only its fp32 source (the source is also kept while
    collecting, to report it)."""
    if later.reuse is Reuse.SOURCE:
        return Operand(None, operand.source)
    src = operand.source if COLLECTORS.active else None
    return Operand(operand.used if operand.shadow is None else operand.shadow, src)


def from_forward(kept: Operand, op: OperandPlan, held: list[torch.Tensor] | None = None) -> Operand:
    """The operand ``op`` of a backward GEMM from what `keep_for_backward` kept (new buffers
    from the pool when ``held`` is given, see `prepare`)."""
    if op.reuse is Reuse.SOURCE:
        return prepare(kept.source, op, held)  # type: ignore[arg-type]
    if COLLECTORS.active:
        held = None
    operand = kept
    if op.reuse is Reuse.RETILE:
        q: QTensor = kept.used  # type: ignore[assignment]
        deq = kept.dense()
        spec = op.spec
        want = op.wants_dense(tuple(q.shape))
        retile_from = None if spec.is_delayed else q  # type: ignore[union-attr]
        q2 = _quantize(deq, spec, held, want, retile_from=retile_from)  # type: ignore[arg-type]
        operand = Operand(q2, kept.source)
    if COLLECTORS.active:
        _record(op, kept.source if kept.source is not None else kept.dense(), operand.used)  # type: ignore[arg-type]
    return operand


# --------------------------------------------------------------------------- GEMM
def gemm(
    acc: Accumulator, a: Operand, b: Operand, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b (+ bias)``; a: [M, K], b: [K, N]. Two quantized operands go through
    `fp8lab.qmatmul` under ``acc`` (scales and bias in its epilogue; K-varying scales with fp32
    accumulation multiply the memoised dequantized operands); otherwise one fp32
    ``addmm``/``mm`` of the dense operands (torch's own linear for the ``fp32`` recipe)."""
    qa, qb = a.used, b.used
    if isinstance(qa, QTensor) and isinstance(qb, QTensor):
        return qmatmul(qa, qb, acc, bias=bias)
    if bias is not None:
        return torch.addmm(bias, a.dense(), b.dense())
    return a.dense() @ b.dense()
