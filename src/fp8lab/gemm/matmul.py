"""`qmatmul`: the emulated GEMM entry point, dispatching to the accumulator models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from numba import njit

from fp8lab.gemm.accumulator import Accumulator
from fp8lab.gemm.fused import fused
from fp8lab.gemm.limited import limited
from fp8lab.gemm.operands import as_qtensors, check_pair, k_constant_scales
from fp8lab.kernels import use_torch
from fp8lab.qtensor import QTensor, QuantSpec

__all__ = ["OUT_FORMATS", "epilogue", "fp32_matmul", "matmul", "qmatmul"]

OUT_FORMATS = ("fp32", "bf16", "fp16")
_NATIVE_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def qmatmul(
    a: QTensor | torch.Tensor,
    b: QTensor | torch.Tensor,
    accumulator: str | Accumulator | dict[str, Any] | None = "fp32",
    out_format: str | None = None,
    *,
    bias: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    spec: QuantSpec | None = None,
    spec_b: QuantSpec | None = None,
    native: bool = False,
) -> torch.Tensor:
    """Emulated ``a @ b``: ``a`` ``[M, K]``, ``b`` ``[K, N]`` -> float32 ``[M, N]``.

    Args:
        a, b: `QTensor` operands, or float tensors quantized here with ``spec`` (``a``) and
            ``spec_b`` (``b``; default: ``spec`` with its block transposed, so that a (1, 128)
            activation spec gives (128, 1) for ``b``).
        accumulator: an `Accumulator`, its kind or a GPU name as a string (``"fp32"``,
            ``"limited"``, ``"h100"``, ``"ada"``, ...: the GPU's row for the operands' formats)
            or a dict.
        out_format: ``None``/``"fp32"``, ``"bf16"`` or ``"fp16"``: the output's rounding.
        bias: ``[N]``, added to the scaled FP32 result (before ``out_format``), bit for bit
            ``out.mul_(scale).add_(bias)``: one FP32 rounding for the scale, one for the bias.
        c: FP32 ``[M, N]`` addend, ``D = A·B + C`` as the accumulator model adds it: the ``fp32``
            model adds it to the scaled product with one FP32 addition; the tensor-core models
            start their promoted FP32 sum with it (``promote_every``) or, never promoted, feed
            it to the first MMA step (which needs unit K-constant scales: the MMA instruction
            sees unscaled operands).
        native: use ``torch._scaled_mm`` (per-tensor E4M3/E5M2 operands, fp32 accumulator).

    Raises:
        ValueError: non-2-D operands, mismatched K, scale blocks along K that do not line up
            (e.g. ``b`` tiled along N instead of K: retile it), a tensor-core accumulator without
            promotion over K-varying scales, a GPU name without a row for the operands'
            formats, or ``native`` where it does not apply.
    """
    qa, qb = as_qtensors(a, b, spec, spec_b)
    acc = Accumulator.parse(accumulator, (qa.spec.format, qb.spec.format))
    if acc.hardware is not None:
        for q in (qa, qb):
            gran = q.spec.granularity
            if isinstance(gran, str) and gran.startswith(("mx", "nvfp4")):
                raise ValueError(
                    f"accumulator {acc.hardware!r} has no model for {gran} block-scaled "
                    "operands (its rows are per-tensor/per-block FP8 and bf16/fp16 MMAs)"
                )
    kb = check_pair(qa, qb)
    m, n = qa.shape[0], qb.shape[1]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"qmatmul: bias must have shape [{n}], got {tuple(bias.shape)}")
    if c is not None:
        if tuple(c.shape) != (m, n):
            raise ValueError(f"qmatmul: c must have shape [{m}, {n}], got {tuple(c.shape)}")
        if native:
            raise ValueError("qmatmul: native=True takes no c")
        c = c.detach().to(torch.float32)
    if native:
        out = _native(qa, qb, acc)
        epilogue(out, None, bias)
        return _round_out(out, out_format)
    return _round_out(_run(qa, qb, acc, kb, c, bias), out_format)


def matmul(
    a: QTensor, b: QTensor, acc: Accumulator, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`qmatmul` of two QTensors made by quantizers (`QTensor.block_shape` set) under an
    accumulator already resolved for their formats (`Accumulator.resolve`): the per-step entry
    of `fp8lab.nn.Linear`, whose plan resolved and checked everything else once. float32
    ``[M, N]``; ``bias`` ``[N]`` added in the epilogue."""
    k = a.values.shape[1]
    ka, kb = a.block_shape, b.block_shape
    if ka is None or kb is None or k != b.values.shape[0]:
        return qmatmul(a, b, acc, bias=bias)  # not from a quantizer: the checked path
    ka, kb = min(ka[1], k), min(kb[0], k)
    if not (k in (ka, kb) or ka == kb):
        return qmatmul(a, b, acc, bias=bias)  # raises, naming the mismatch
    return _run(a, b, acc, min(ka, kb), None, bias)


def _run(
    a: QTensor,
    b: QTensor,
    acc: Accumulator,
    kb: int,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The accumulator model's product of checked operands (scales constant over ``kb`` of K),
    plus ``c``, the scales and ``bias``."""
    if acc.kind == "fp32":  # scales and bias in _fp32's own epilogue
        return _fp32(a, b, kb, c, bias)
    out = limited(a, b, acc, kb, c) if acc.kind == "limited" else fused(a, b, acc, kb, c)
    epilogue(out, None, bias)
    return out


# ------------------------------------------------------------------ the epilogue
# out = fl32(out * scale) then fl32(out + bias), the same two roundings as
# out.mul_(scale).add_(bias) (no FMA), bit for bit, in one serial numba pass. Serial on purpose:
# torch's threaded elementwise ops stall on a busy 2-core box, and the pass runs between two
# threaded GEMM calls.
@njit(cache=True)
def _scale_bias_rows(o, n, s, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = np.float32(r[j] * s) + b[j]


@njit(cache=True)
def _scale_all(o, s):  # pragma: no cover - numba
    for i in range(o.shape[0]):
        o[i] = o[i] * s


@njit(cache=True)
def _bias_rows(o, n, b):  # pragma: no cover - numba
    for i in range(o.shape[0] // n):
        r = o[i * n : (i + 1) * n]
        for j in range(n):
            r[j] = r[j] + b[j]


def epilogue(
    out: torch.Tensor,
    scale: np.ndarray | np.float32 | torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    """In place on a float32 [M, N] GEMM output: ``out = fl32(out * scale)`` (a float32 scalar,
    or a 0-d float32 tensor) then ``fl32(out + bias)`` (``bias`` [N]); either may be None.
    Non-contiguous outputs and the torch kernels (`fp8lab.kernels`) take torch's ``mul_`` and
    ``add_``: separate kernels, so the same two roundings (no FMA)."""
    if (scale is None and bias is None) or out.numel() == 0:
        return
    generic = use_torch(out, bias, what="qmatmul epilogue")
    if generic or not out.is_contiguous() or out.dtype != torch.float32:
        if scale is not None:
            out.mul_(torch.as_tensor(scale, dtype=torch.float32, device=out.device))
        if bias is not None:
            out.add_(bias)
        return
    o = out.view(-1).numpy()
    n = out.shape[1]
    if bias is not None:
        b = bias.detach().to(torch.float32).contiguous().numpy()
        if scale is None:
            _bias_rows(o, n, b)
        else:
            _scale_bias_rows(o, n, np.float32(scale), b)
    else:
        _scale_all(o, np.float32(scale))


@contextmanager
def fp32_matmul(device: torch.device) -> Iterator[None]:
    """Run a block's FP32 matmuls in IEEE FP32 on ``device``: on CUDA, TF32 off (cuBLAS would
    otherwise be allowed to round the operands to 10 fraction bits), restored afterwards, so
    the process's global setting is never left changed. Elsewhere a no-op."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    try:  # torch >= 2.9: the fp32_precision API (mixing it with allow_tf32 is refused)
        old = m.fp32_precision
        m.fp32_precision = "ieee"
    except (AttributeError, RuntimeError):
        old = None
    old_tf32 = None
    if old is None:
        old_tf32 = m.allow_tf32
        m.allow_tf32 = False
    try:
        yield
    finally:
        if old is not None:
            m.fp32_precision = old
        else:
            m.allow_tf32 = old_tf32


def _fp32(
    a: QTensor, b: QTensor, kb: int, c: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """FP32 accumulation; per-tensor scales and the bias in one serial epilogue pass."""
    k = a.shape[1]
    k_constant = kb >= k or (a.scales.shape[1] == 1 and b.scales.shape[0] == 1)
    with fp32_matmul(a.values.device):
        if k_constant:
            out = torch.mm(a.values.float(), b.values.float())
        else:
            out = torch.mm(a.dequantize(), b.dequantize())
    if k_constant:
        if (
            a.scales.numel() == 1
            and b.scales.numel() == 1
            and a.global_scale is None
            and (b.global_scale is None)
        ):
            scale = (a.scales.reshape(()) * b.scales.reshape(())).float()
            if c is None:
                epilogue(out, scale, bias)
                return out
            epilogue(out, scale, None)
        else:
            out.mul_(k_constant_scales(a, "a") * k_constant_scales(b, "b"))
    if c is not None:
        out.add_(c)
    epilogue(out, None, bias)
    return out


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
    if a.values.device.type == "cuda":
        return _native_cuda(a, b)
    a8 = a.values.to(_NATIVE_FORMATS[a.spec.format])
    b8 = b.values.to(_NATIVE_FORMATS[b.spec.format]).t().contiguous().t()  # column-major
    return torch._scaled_mm(
        a8,
        b8,
        scale_a=a.scales.reshape(()).float(),
        scale_b=b.scales.reshape(()).float(),
        out_dtype=torch.float32,
    )


def _native_cuda(a: QTensor, b: QTensor) -> torch.Tensor:
    """``torch._scaled_mm`` on the GPU's FP8 tensor cores (compute capability 8.9+: Ada,
    Hopper, Blackwell). cuBLASLt wants every dimension a multiple of 16: the operands are
    zero-padded (zero products add nothing) and the result cropped."""
    dev = a.values.device
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise ValueError(
            f"native=True needs FP8 tensor cores (compute capability 8.9+); {dev} is "
            f"{torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]}): use an emulated accumulator"
        )
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = (-(-x // 16) * 16 for x in (m, k, n))
    va = torch.nn.functional.pad(a.values, (0, kp - k, 0, mp - m))
    vb = torch.nn.functional.pad(b.values, (0, np_ - n, 0, kp - k))
    out = torch._scaled_mm(
        va.to(_NATIVE_FORMATS[a.spec.format]),
        vb.to(_NATIVE_FORMATS[b.spec.format]).t().contiguous().t(),  # column-major
        scale_a=a.scales.reshape(()).float(),
        scale_b=b.scales.reshape(()).float(),
        out_dtype=torch.float32,
    )
    return out[:m, :n].contiguous()


def _round_out(out: torch.Tensor, out_format: str | None) -> torch.Tensor:
    if out_format is None or out_format in ("fp32", "float32"):
        return out
    if out_format in ("bf16", "bfloat16"):
        return out.to(torch.bfloat16).to(torch.float32)
    if out_format in ("fp16", "float16", "half"):
        return out.to(torch.float16).to(torch.float32)
    raise ValueError(f"out_format must be one of {OUT_FORMATS} or None, got {out_format!r}")
