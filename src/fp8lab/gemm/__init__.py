"""Emulated low-precision GEMMs: `Accumulator` models and `qmatmul`.

``qmatmul(a, b)`` computes ``a @ b`` for ``a`` ``[M, K]`` and ``b`` ``[K, N]`` quantized operands
(`fp8lab.QTensor`; float tensors are quantized first under ``spec``). Element values are exact on
their grids, so every product of two FP8 values is exact; what differs between the models is how
the products are summed and where the scales are applied.

Accumulator models
------------------
``fp32`` (`Accumulator(kind="fp32")`): products exact, sums in FP32 (a BLAS sgemm over the
    element values). Scales that are constant along K (per tensor, per row of ``a``, per column
    of ``b``) are applied once to the output, as cuBLAS applies ``scale_a * scale_b``: the
    output is ``(A @ B) * (sa * sb)`` with ``sa * sb`` rounded to FP32 first. Scales that vary
    along K (1x128 x 128x128, MX, NVFP4) are applied by dequantizing both operands and then
    multiplying: mathematically the same as promoting every K group into FP32 with that group's
    scales, equal up to FP32 summation order.

``limited`` (`Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=None)`): a fast
    approximation of the Hopper FP8 tensor core (the exact model is ``fused``/``"h100"``; on the
    published H100 outputs ``limited`` disagrees on about 1 in 5 E4M3 results). For each output element, per MMA group of ``group`` consecutive
    products (the WGMMA K = 32 for FP8) the group sum is added to the running accumulator and the
    result is cut to ``mantissa_bits`` fraction bits (``rounding="toward_zero"``: truncation, as
    measured on H100 by huweim/emulation_sys: 13 bits RZ; DeepSeek-V3 §3.3 "around 14 bits",
    counting the leading one; "FP22 = e8m13" per PyTorch). The group sum itself is computed
    exactly (a float64 GEMM over the group: exact for E4M3 operands, whose products span < 2^45;
    for E5M2 exact unless the group's products span more than 2^53). Every ``promote_every``
    K elements (DeepSeek's N_C = 128, four WGMMAs) the accumulator is added into an FP32
    accumulator with the K group's scales, ``total += (scale_a * scale_b) * acc`` (DeepGEMM's
    ``final_accum += scale * accum``), and restarts at 0. ``promote_every=None`` never promotes
    (TE's fprop "fast accumulation", cuBLASLt FAST_ACCUM): the scales are applied to the
    output, so they must be constant along K.
    ``per_product=True`` follows DeepSeek §3.5.2's wording instead: "after aligning 32 mantissa
    products by right-shifting based on the maximum exponent, the Tensor Core only uses the
    highest 14 bits of each mantissa product": each product of the group is truncated (toward
    zero) to the quantum ``2**(e_max - mantissa_bits)`` of the group's largest product, the
    truncated products are summed exactly and the accumulator update is truncated as above. It is
    a per-element numba loop, much slower.
    It sums each group exactly where the hardware truncates every term to 13 bits below the
    group's largest exponent (accumulator included): its error is a truncation of the running sum
    only, biased toward zero, so it grows with K. The hardware's per-term truncation instead
    cuts every small product (toward zero, both signs): nearly unbiased for zero-mean operands,
    strongly biased when all products share a sign (docs/gemm.md: "Accumulator models" and the DeepSeek
    table).

``fused`` (`Accumulator("fused", group=G, align_bits=F, out_bits=F_out, out_rounding=
    "toward_zero", c_entry="aligned", promote_every=None)`, or a GPU name: ``"h100"``, ``"h200"``,
    ``"ada"``, ``"l40s"``, ``"b200"``, ``"b200-tcgen05"``): the tensor cores' fused block FMA, bit
    for bit (`fp8lab.gemm.fused` documents the algorithm; `fp8lab.accumulators` lists the GPU
    rows with their sources). A GPU name picks its row for the operands' formats when the GEMM
    runs (``Accumulator.parse(name, formats)``); formats without a row (``e4m3-ieee``, e2m1, MX
    or NVFP4 block-scaled operands) raise ValueError. It matches every published real-GPU output
    it is tested on (H100/L40S/B200; tests/gemm/test_fused.py). ``fused_dot`` runs a batch of
    single dot products through it (the numerics lab's SNR study).

Native path: ``native=True`` calls ``torch._scaled_mm`` (per-tensor E4M3/E5M2 operands, FP32
accumulator). On CPU (torch 2.13) it dequantizes the operands and runs an FP32 matmul; see
``tests/test_gemm.py`` for how it compares with the emulation. On CUDA it needs FP8 tensor cores
(compute capability 8.9+).

Devices: the ``limited`` and ``fused`` models and the epilogue have numba kernels (CPU) and
device-generic torch kernels (`fp8lab.gemm.fused_torch`, `fp8lab.gemm.limited_torch`) that give
the same bits; `fp8lab.kernels` picks one (CUDA tensors always take torch). The ``fp32`` model
is torch's GEMM, on CUDA with TF32 off (`fp8lab.gemm.matmul.fp32_matmul`). docs/gemm.md, "GPU
semantics".

``c`` (``qmatmul(..., c=)``): an FP32 addend, ``D = A·B + C``; ``bias``: added after the scales
in one serial epilogue pass (`fp8lab.gemm.matmul.epilogue`), bit for bit ``out.mul_(s).add_(bias)``.

Output: FP32, or rounded to ``out_format`` ``"bf16"`` / ``"fp16"`` (round to nearest even, as
the epilogue's conversion; overflow to inf as IEEE).
"""

from fp8lab.gemm.accumulator import ACCUMULATOR_KINDS, HARDWARE, Accumulator, accumulators
from fp8lab.gemm.fused import fused_dot
from fp8lab.gemm.matmul import qmatmul

__all__ = ["ACCUMULATOR_KINDS", "HARDWARE", "Accumulator", "accumulators", "fused_dot", "qmatmul"]
