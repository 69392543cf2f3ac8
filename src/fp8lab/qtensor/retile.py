"""`retile`: the same quantized tensor in the other GEMM direction's tiles (explicit, counted)."""

from __future__ import annotations

import torch

from fp8lab.qtensor.kernels import max_abs_diff
from fp8lab.qtensor.quantize import quantize
from fp8lab.qtensor.quantizer import _RETILE_COUNTS, check_retile_from_quantized, retile_counts
from fp8lab.qtensor.spec import QuantSpec
from fp8lab.qtensor.tensor import QTensor
from fp8lab.scaling.granularity import GranularityLike, transpose_granularity

__all__ = ["retile", "retile_counts"]


def retile(
    q: QTensor,
    to: GranularityLike | None = None,
    *,
    source: torch.Tensor | None = None,
    spec: QuantSpec | None = None,
    measure_error: bool = True,
    dequantized: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dequantized_out: torch.Tensor | None = None,
) -> QTensor:
    """Re-tile a quantized tensor for the other GEMM direction. Explicit and counted.

    Returns a `QTensor` of the *same* logical tensor (same shape) with granularity ``to``
    (default: the block transposed, (1, 128) -> (128, 1), ``mx`` -> ``mx_col``).

    * ``source=None``: from the quantized values, as DeepSeek-V3 does (dequantize, re-quantize
      into the new tiles). Power-of-two scales keep this nearly lossless; other rules add a second
      rounding, which `QTensor.meta["retile_added_error"]` reports (max |new - old dequantized|,
      NaN ignored). ``measure_error=False`` skips that extra pass over the tensor (the entry is
      then ``None``; the re-tiling is still counted). ``dequantized``: ``q.dequantize()`` if
      the caller already has it (saves recomputing it; it must be exactly that tensor's values).
    * ``source=x``: from the high-precision tensor, as TE's MXFP8 does (rowwise and columnwise
      copies quantized independently from the same source).

    ``spec`` overrides the whole target spec (default: ``q.spec`` with the new granularity).
    ``out`` / ``dequantized_out``: buffers for the new values and their dequantized copy, as in
    `quantize`.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"retile expects a QTensor, got {type(q).__name__}")
    target = spec or q.spec.replace(
        granularity=to if to is not None else transpose_granularity(q.spec.granularity)
    )
    if target.is_delayed:
        raise ValueError("retile does not apply to DelayedScaling (per-tensor) QTensors")
    if source is not None:
        if tuple(source.shape) != tuple(q.shape):
            raise ValueError(
                f"source shape {tuple(source.shape)} does not match the QTensor {tuple(q.shape)}"
            )
        res = quantize(source, target, out=out, dequantized_out=dequantized_out)
        _RETILE_COUNTS["from_source"] += 1
        res.meta["retile_source"] = "source"
    else:
        check_retile_from_quantized(q.spec, target)
        if dequantized is None:
            deq = q.dequantize()
        else:
            if tuple(dequantized.shape) != tuple(q.shape) or dequantized.dtype != torch.float32:
                raise ValueError(
                    f"dequantized must be float32 of shape {tuple(q.shape)}, got "
                    f"{dequantized.dtype} {tuple(dequantized.shape)}"
                )
            deq = dequantized
        res = quantize(deq, target, out=out, dequantized_out=dequantized_out)
        _RETILE_COUNTS["from_quantized"] += 1
        res.meta["retile_source"] = "quantized"
        err: float | None = None
        if measure_error:
            new = res.dequantize() if dequantized_out is None else dequantized_out
            err = max_abs_diff(new, deq)
        res.meta["retile_added_error"] = err
    res.retiled = q.retiled + 1
    return res
