"""The study through a GEMM accumulator model of `fp8lab.gemm` (``--accumulator h100``, ...).

Where the sequential accumulator rounds a running sum after every product, a tensor core sums the
products of one output element in MMA groups (`fp8lab.gemm` documents the models: ``limited``,
and the hardware-exact fused models named after GPUs). Here every chunk of a dot product (a
scaling block, or a promotion interval, or the whole vector) is one output element of an emulated
GEMM, summed by the model from a zero accumulator on the unscaled element values; the engine then
de-scales the chunk sums and promotes them into float64 as it does for the sequential accumulator
(DeepSeek-V3 promotes into FP32 on the CUDA cores: the float64 sum differs from it by at most the
FP32 rounding of the few promoted partials, far below the tensor core's own truncation).

The plug point is `row_dots`: the fused (hardware) models run through the gemm layer's batch of
independent dot products (`fp8lab.gemm.fused.fused_dot`, bit for bit what ``qmatmul`` computes
per output element); every other accumulator model of `fp8lab.qmatmul` runs through ``qmatmul``
itself, so a model added to it later works here unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from fp8lab.gemm import Accumulator, qmatmul
from fp8lab.gemm.fused import fused_dot
from fp8lab.lab.machine import torch_device
from fp8lab.qtensor import QuantSpec, quantize

__all__ = ["ROWS_PER_CALL", "chunk_sums", "row_dots"]

#: dot products per emulated GEMM call of a non-fused model: the call computes a [g, g] output of
#: which the diagonal is used (g times the needed work, but far fewer calls than one [1, K] x
#: [K, 1] GEMM per dot product)
ROWS_PER_CALL = 64


def row_dots(va: np.ndarray, vb: np.ndarray, accumulator: str, fmt: str) -> np.ndarray:
    """``sum_k va[r, k] * vb[r, k]`` for every row ``r``, as ``accumulator`` sums one output
    element of ``qmatmul`` (zero initial accumulator, unit scales, FP32 output).

    va, vb: [R, K] element values already on ``fmt``'s grid (float64 or float32). Returns float64
    [R]. A fused (hardware) model runs `fp8lab.gemm.fused.fused_dot`, the gemm layer's batch of
    independent dot products; other models run ``qmatmul`` on [g, K] x [K, g] blocks of rows
    and keep the diagonal. Raises ValueError (from `fp8lab.gemm`) where the model has no
    parameters for ``fmt``.
    """
    acc = Accumulator.parse(accumulator, (fmt, fmt))
    device = torch_device()  # the lab's device (--torch-device): the GEMM models run there
    ta = torch.from_numpy(np.ascontiguousarray(va)).float().to(device)
    tb = torch.from_numpy(np.ascontiguousarray(vb)).float().to(device)
    if acc.kind == "fused":
        return fused_dot(ta, tb, acc, (fmt, fmt)).double().cpu().numpy()
    rows = va.shape[0]
    out = np.empty(rows, dtype=np.float64)
    spec = QuantSpec(format=fmt, scaling=1.0)  # the values are on the grid: the cast is exact
    for r0 in range(0, rows, ROWS_PER_CALL):
        r1 = min(r0 + ROWS_PER_CALL, rows)
        qa = quantize(ta[r0:r1], spec)
        qb = quantize(tb[r0:r1].t().contiguous(), spec)  # [K, g]: column j is row r0 + j
        y = qmatmul(qa, qb, acc)
        out[r0:r1] = torch.diagonal(y).double().cpu().numpy()
    return out


def chunk_sums(
    qa: np.ndarray, qb: np.ndarray, chunk: int, accumulator: str, fmt: str
) -> np.ndarray:
    """Model sums of the products ``qa * qb`` over consecutive chunks of ``chunk`` elements.

    qa, qb: [samples, length] element values; returns float64 [samples, ceil(length / chunk)]
    (a shorter last chunk where ``chunk`` does not divide the length).
    """
    samples, length = qa.shape
    full = length // chunk
    out = np.empty((samples, -(-length // chunk)), dtype=np.float64)
    if full:
        n = full * chunk
        ra = qa[:, :n].reshape(samples * full, chunk)
        rb = qb[:, :n].reshape(samples * full, chunk)
        out[:, :full] = row_dots(ra, rb, accumulator, fmt).reshape(samples, full)
    if length % chunk:
        out[:, full] = row_dots(qa[:, full * chunk :], qb[:, full * chunk :], accumulator, fmt)
    return out
