"""Fixed-width SIMD vectors inside numba code, for the accumulator kernels' register tiles.

LLVM's loop vectorizer, as numba drives it, vectorises a kernel's inner loop over output columns
but keeps its running sums in memory (a load and a store per vector per K element), and its SLP
vectorizer left a register-blocked micro-kernel scalar. These intrinsics give numba code LLVM
vector values (``<4 x double>``, ``<8 x float>``) that live in registers across a K loop: the
GEMM libraries' register tile, written in numba.

Every operation is one LLVM instruction per lane with the scalar operation's IEEE semantics
(no fast-math flag except ``contract`` on `vfma`, which the scalar kernels allow too), so a
kernel written with them computes each lane exactly as the scalar loop it replaces.

Loads and stores take a C-contiguous 2-D array and (row, column) of the first lane; the lanes
are the following columns. No bounds check: the caller keeps ``column + lanes`` within the row.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

__all__ = [
    "F32X8",
    "F64X4",
    "vadd",
    "vand_bits",
    "vcut",
    "vdiv",
    "vfma",
    "vload",
    "vmask_outside",
    "vmax",
    "vmul",
    "vsplat",
    "vstore",
    "vtrunc_i32",
]


class Vec(types.Type):
    """A numba type: an LLVM vector of ``lanes`` elements of the numba scalar ``dtype``."""

    def __init__(self, dtype: types.Float, lanes: int) -> None:
        self.dtype, self.lanes = dtype, lanes
        super().__init__(name=f"vec{lanes}x{dtype}")


F64X4 = Vec(types.float64, 4)
F32X8 = Vec(types.float32, 8)
_BY_DTYPE = {types.float64: F64X4, types.float32: F32X8}


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = ir.DoubleType() if fe_type.dtype == types.float64 else ir.FloatType()
        super().__init__(dmm, fe_type, ir.VectorType(elem, fe_type.lanes))


def _ptr(context, builder, aryty, ary, i, j):
    """Pointer to ``ary[i, j]`` as a pointer to the vector type."""
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [i, j], wraparound=False)
    vt = context.get_value_type(_BY_DTYPE[aryty.dtype])
    return builder.bitcast(p, vt.as_pointer())


def _splat(builder, x, ty: ir.VectorType):
    """LLVM: the vector of type ``ty`` with every lane the scalar ``x``."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, cgutils.int32_t(0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), ty.count), [0] * ty.count)
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), zeros)


def _c2d(ary) -> bool:
    return (
        isinstance(ary, types.Array)
        and ary.ndim == 2
        and ary.layout == "C"
        and ary.dtype in _BY_DTYPE
    )


@intrinsic
def vload(typingctx, ary, i, j):  # pragma: no cover - compiled by numba
    """The vector ``ary[i, j : j + lanes]`` (float64 arrays: 4 lanes; float32: 8)."""
    if not _c2d(ary):
        return None
    vt = _BY_DTYPE[ary.dtype]

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], args[2])
        return builder.load(p, align=vt.dtype.bitwidth // 8)

    return vt(ary, i, j), codegen


@intrinsic
def vstore(typingctx, ary, i, j, v):  # pragma: no cover - compiled by numba
    """``ary[i, j : j + lanes] = v``."""
    if not (_c2d(ary) and v == _BY_DTYPE[ary.dtype]):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], args[2])
        builder.store(args[3], p, align=v.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(ary, i, j, v), codegen


@intrinsic
def vsplat(typingctx, x):  # pragma: no cover - compiled by numba
    """A vector of every lane ``x`` (float64: `F64X4`, float32: `F32X8`)."""
    if x not in _BY_DTYPE:
        return None
    vt = _BY_DTYPE[x]

    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], context.get_value_type(vt))

    return vt(x), codegen


def _binary(op: str, flags: tuple[str, ...] = ()):
    def typer(typingctx, a, b):
        if not (isinstance(a, Vec) and a == b):
            return None

        def codegen(context, builder, sig, args):
            x, y = args
            if op == "max":  # y where y > x, else x: the scalar kernels' max(x, y) off NaN
                return builder.select(builder.fcmp_ordered(">", y, x), y, x)
            r = getattr(builder, op)(x, y)
            r.flags.extend(flags)
            return r

        return a(a, b), codegen

    return typer


vadd = intrinsic(_binary("fadd"))
vadd.__doc__ = "Lane-wise ``a + b`` (IEEE, round to nearest even)."
vmul = intrinsic(_binary("fmul"))
vmul.__doc__ = "Lane-wise ``a * b`` (IEEE, round to nearest even)."
vdiv = intrinsic(_binary("fdiv"))
vdiv.__doc__ = "Lane-wise ``a / b`` (IEEE, round to nearest even)."
vmax = intrinsic(_binary("max"))
vmax.__doc__ = "Lane-wise ``b if b > a else a`` (the scalar kernels' ``max(a, b)`` off NaN)."


@intrinsic
def vfma(typingctx, a, b, c):  # pragma: no cover - compiled by numba
    """Lane-wise ``a * b + c`` with LLVM's ``contract`` flag, as scalar code under numba's
    ``fastmath={"contract"}``: fused where the CPU has FMA. The accumulator kernels call it only
    where the product is exact, so fused or not gives the same bits."""
    if not (isinstance(a, Vec) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        p = builder.fmul(args[0], args[1])
        p.flags.append("contract")
        r = builder.fadd(p, args[2])
        r.flags.append("contract")
        return r

    return a(a, b, c), codegen


@intrinsic
def vtrunc_i32(typingctx, v):  # pragma: no cover - compiled by numba
    """Lane-wise ``float32(int32(v))``: truncation toward zero (an exact zero comes back +0).
    Lanes must lie within int32's range (elsewhere LLVM leaves the lane undefined)."""
    if v != F32X8:
        return None

    def codegen(context, builder, sig, args):
        it = ir.VectorType(ir.IntType(32), v.lanes)
        return builder.sitofp(builder.fptosi(args[0], it), context.get_value_type(v))

    return v(v), codegen


@intrinsic
def vand_bits(typingctx, v, mask):  # pragma: no cover - compiled by numba
    """Lane-wise float32 whose bit pattern is ``v``'s AND the uint32 ``mask``."""
    if v != F32X8 or not isinstance(mask, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        it = ir.VectorType(ir.IntType(32), v.lanes)
        m = context.cast(builder, args[1], sig.args[1], types.uint32)
        u = builder.and_(builder.bitcast(args[0], it), _splat(builder, m, it))
        return builder.bitcast(u, context.get_value_type(v))

    return v(v, mask), codegen


@intrinsic
def vmask_outside(typingctx, v, lo, hi):  # pragma: no cover - compiled by numba
    """int64 bit mask of the lanes of ``v`` with ``v <= lo`` or ``v >= hi`` (bit ``l``: lane
    ``l``; a NaN lane is neither)."""
    if v != F32X8 or lo != types.float32 or hi != types.float32:
        return None

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(v)
        out = builder.or_(
            builder.fcmp_ordered("<=", args[0], _splat(builder, args[1], ty)),
            builder.fcmp_ordered(">=", args[0], _splat(builder, args[2], ty)),
        )
        bits = builder.bitcast(out, ir.IntType(v.lanes))
        return builder.zext(bits, ir.IntType(64))

    return types.int64(v, lo, hi), codegen


@intrinsic
def vcut(typingctx, v, drop, rne):  # pragma: no cover - compiled by numba
    """Lane-wise cut of float64 ``v`` to ``52 - drop`` fraction bits (0 < drop < 52) on the
    bit pattern: truncation (RZ) or, with ``rne``, round to nearest even (`limited`'s ``_cut``).
    """
    if v != F64X4 or not isinstance(drop, types.Integer) or not isinstance(rne, types.Boolean):
        return None

    def codegen(context, builder, sig, args):
        it = ir.VectorType(ir.IntType(64), 4)
        i64 = ir.IntType(64)

        def splat(x):
            return _splat(builder, x, it)

        d = context.cast(builder, args[1], sig.args[1], types.uint64)
        one = ir.Constant(i64, 1)
        half_m1 = builder.sub(builder.shl(one, builder.sub(d, one)), one)
        mask = builder.not_(builder.sub(builder.shl(one, d), one))
        u = builder.bitcast(args[0], it)
        lsb = builder.and_(builder.lshr(u, splat(d)), ir.Constant(it, [1] * 4))
        ur = builder.add(builder.add(u, splat(half_m1)), lsb)
        u = builder.select(args[2], ur, u)
        return builder.bitcast(builder.and_(u, splat(mask)), context.get_value_type(F64X4))

    return F64X4(v, drop, rne), codegen
