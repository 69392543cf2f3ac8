"""Bit casts between floats and unsigned integers inside numba kernels.

An LLVM bitcast of one scalar: array ``.view`` inside numba was unreliable, and a union-style
reinterpretation through memory costs a store and a load. Used by the fused kernels of
`fp8lab.qtensor` (float32) and `fp8lab.gemm` (float64).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types as nbt
from numba.extending import intrinsic


def _bitcast(src: nbt.Type, dst: nbt.Type, llvm_dst: ir.Type):
    @intrinsic
    def cast(typingctx, x):  # pragma: no cover - numba
        if x != src:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_dst)

        return dst(src), codegen

    return cast


f32_to_u32 = _bitcast(nbt.float32, nbt.uint32, ir.IntType(32))
u32_to_f32 = _bitcast(nbt.uint32, nbt.float32, ir.FloatType())
f64_to_u64 = _bitcast(nbt.float64, nbt.uint64, ir.IntType(64))
u64_to_f64 = _bitcast(nbt.uint64, nbt.float64, ir.DoubleType())
