"""Element storage: how each floating dtype is read into and written from the accumulator.

Numba has no float16 or bfloat16 type on the CPU, so 16-bit arrays reach the kernels as
integer views of their bits: float16 as ``int16`` and bfloat16 as ``uint16``.  The element
type of the view is what selects the conversion, at compile time, with no branch in the loop.

* ``widen(v)``: float32 and float64 as they are; float16 through the hardware conversion
  (``fpext half``, F16C on x86); bfloat16 by a 16-bit shift into the high half of a float32.
* ``put(out, j, v)``: the reverse, rounding to nearest even (NaN stays NaN).
* ``like(v, c)``: the constant ``c`` in the accumulator type of element or array ``v``
  (float64 only for float64 storage, float32 otherwise).

The integer work is written as LLVM IR so it stays 32-bit and vectorizes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)


@intrinsic
def half_to_f32(typingctx, v):
    """float16 bits (int16) -> float32, exactly."""
    if v != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)

    return types.float32(types.int16), codegen


@intrinsic
def f32_to_half(typingctx, v):
    """float32 -> float16 bits (int16), rounded to nearest even."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.int16(types.float32), codegen


@intrinsic
def bf16_to_f32(typingctx, v):
    """bfloat16 bits (uint16) -> float32, exactly (the bits are the float32's high half)."""
    if v != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_bf16(typingctx, v):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays a quiet NaN."""
    if v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], _I32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(_I32, 0x7FFF)), odd)
        quiet = builder.or_(bits, ir.Constant(_I32, 0x00400000))
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        chosen = builder.select(isnan, quiet, rounded)
        return builder.trunc(builder.lshr(chosen, ir.Constant(_I32, 16)), _I16)

    return types.uint16(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, v):
    """The float32 whose bit pattern is the low 32 bits of integer ``v``."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], _I32), _F32)

    return types.float32(v), codegen


@intrinsic
def maxnum(typingctx, a, b):
    """``llvm.maxnum``: the larger of two floats, the other one when one is NaN.

    Unlike a compare-and-select in Python, it is recognised as a reduction and vectorized.
    """
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        t = args[0].type
        name = "llvm.maxnum.f32" if t == _F32 else "llvm.maxnum.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t]), name)
        return builder.call(fn, args)

    return a(a, b), codegen


def _scale_codegen(width: int, bias: int, mant: int, low: int, lift: int):
    fty = _F32 if width == 32 else ir.DoubleType()
    ity = ir.IntType(width)

    def codegen(context, builder, signature, args):
        p, nf = args
        n = builder.fptosi(nf, ity)
        small = builder.icmp_signed("<", n, ir.Constant(ity, low))
        lifted = builder.select(small, ir.Constant(ity, lift), ir.Constant(ity, 0))
        e = builder.add(builder.add(n, ir.Constant(ity, bias)), lifted)
        s = builder.bitcast(builder.shl(e, ir.Constant(ity, mant)), fty)
        back = builder.select(small, ir.Constant(fty, 2.0 ** -lift), ir.Constant(fty, 1.0))
        return builder.fmul(builder.fmul(p, s), back)

    return codegen


@intrinsic
def scale_pow2(typingctx, p, nf):
    """``p * 2**nf`` for an integral ``nf`` in [-160, 0] (float32) or [-1100, 0] (float64).

    ``2**nf`` is written into the exponent field; below the normal range the scale is lifted
    by ``2**lift`` and the product brought back by one multiplication, so a subnormal result
    is rounded once.
    """
    if p == types.float32 and nf == types.float32:
        return types.float32(types.float32, types.float32), _scale_codegen(32, 127, 23, -125, 64)
    if p == types.float64 and nf == types.float64:
        return types.float64(types.float64, types.float64), _scale_codegen(
            64, 1023, 52, -1021, 128
        )
    return None


def widen(v):  # pragma: no cover - replaced by the overload inside compiled code
    """Read one stored element into the accumulator type."""
    raise NotImplementedError


def put(out, j, v):  # pragma: no cover
    """Store accumulator value ``v`` at ``out[j]`` in ``out``'s storage."""
    raise NotImplementedError


def like(v, c):  # pragma: no cover
    """The constant ``c`` in the accumulator type of stored element (or array) ``v``."""
    raise NotImplementedError


@overload(widen, jit_options={"cache": True})
def _widen(v):
    if v == types.float32 or v == types.float64:
        return lambda v: v
    if v == types.int16:
        return lambda v: half_to_f32(v)
    if v == types.uint16:
        return lambda v: bf16_to_f32(v)
    return None


@overload(put, jit_options={"cache": True})
def _put(out, j, v):
    dtype = out.dtype
    if dtype == types.float32:
        def impl(out, j, v):
            out[j] = np.float32(v)
    elif dtype == types.float64:
        def impl(out, j, v):
            out[j] = np.float64(v)
    elif dtype == types.int16:
        def impl(out, j, v):
            out[j] = f32_to_half(np.float32(v))
    elif dtype == types.uint16:
        def impl(out, j, v):
            out[j] = f32_to_bf16(np.float32(v))
    else:
        return None
    return impl


@overload(like, jit_options={"cache": True})
def _like(v, c):
    if v == types.float64 or (isinstance(v, types.Array) and v.dtype == types.float64):
        return lambda v, c: np.float64(c)
    return lambda v, c: np.float32(c)


def scratch(x, n):  # pragma: no cover
    """A new 1-D array of ``n`` elements in the accumulator type of array ``x``."""
    raise NotImplementedError


@overload(scratch, jit_options={"cache": True})
def _scratch(x, n):
    if x.dtype == types.float64:
        return lambda x, n: np.empty(n, dtype=np.float64)
    return lambda x, n: np.empty(n, dtype=np.float32)
