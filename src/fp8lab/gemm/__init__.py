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

``limited`` (`Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=None)`): the
    Hopper FP8 tensor-core model. For each output element, per MMA group of ``group`` consecutive
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
    Not modelled: accumulator exponent range (it is taken as unbounded; FP32's range in practice),
    the exact alignment point of the accumulator against the products, and extra alignment bits
    (Khattak & Mikaitis, arXiv 2512.07004, describe bit-exact models with those parameters).

Native path: ``native=True`` calls ``torch._scaled_mm`` (per-tensor E4M3/E5M2 operands, FP32
accumulator). On CPU (torch 2.13) it dequantizes the operands and runs an FP32 matmul; see
``tests/test_gemm.py`` for how it compares with the emulation.

Output: FP32, or rounded to ``out_format`` ``"bf16"`` / ``"fp16"`` (round to nearest even, as
the epilogue's conversion; overflow to inf as IEEE).
"""

from fp8lab.gemm.accumulator import ACCUMULATOR_KINDS, Accumulator
from fp8lab.gemm.matmul import qmatmul

__all__ = ["ACCUMULATOR_KINDS", "Accumulator", "qmatmul"]
