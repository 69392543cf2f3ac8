"""Deprecated module path: the GEMM epilogue (``epilogue(out, scale, bias)``: the output scale
and the bias in one serial numba pass) lives in `fp8lab.gemm.matmul`, beside the GEMM that runs
it."""

from fp8lab.gemm.matmul import epilogue

__all__ = ["epilogue"]
