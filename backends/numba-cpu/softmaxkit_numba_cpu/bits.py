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


@intrinsic
def pow2_lifted(typingctx, t):
    """``2**(n + LIFT)`` from ``t = n + 1.5 * 2**p``, the rounded sum of :mod:`.exp`.

    ``n`` sits in the low bits of ``t``: one integer add moves it to the biased exponent
    ``n + LIFT + bias`` and a shift puts that in the exponent field (p = 23, bias 127,
    LIFT 32 for float32; p = 52, bias 1023, LIFT 64 for float64).  Valid for ``n`` down to
    ``-LIFT - bias + 1``, below every ``n`` that :mod:`.exp` produces.
    """
    if t == types.float32:
        width, mant, bias, lift, magic = 32, 23, 127, 32, 0x4B400000
    elif t == types.float64:
        width, mant, bias, lift, magic = 64, 52, 1023, 64, 0x4338000000000000
    else:
        return None
    ity = ir.IntType(width)
    offset = (bias + lift - magic) % (1 << width)

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], ity)
        e = builder.shl(builder.add(bits, ir.Constant(ity, offset)), ir.Constant(ity, mant))
        return builder.bitcast(e, args[0].type)

    return t(t), codegen


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


MAX_LANES = 8
"""float32 lanes of the 256-bit vectors of :func:`vector_max` (half as many float64)."""
MAX_UNROLL = 4
"""Independent vector maxima of :func:`vector_max`: one ``max`` each per step, so the loop
waits on no single maximum's latency."""


@intrinsic
def vector_max(typingctx, x, j0, n):
    """The maximum of float32 or float64 ``x[j0:j0 + n]``, ignoring NaN (-inf for none);
    ``n`` must be a multiple of ``MAX_UNROLL`` vectors (32 float32, 16 float64).

    Written as ``v > m ? v : m`` on explicit vectors: that is the x86 ``max`` instruction
    itself (NaN in ``v`` keeps ``m``), one operation per vector.  The vectorizer turns
    ``llvm.maxnum``, which must also ignore a NaN already in ``m``, into a compare, a blend
    and a NaN test besides each ``max``; a Python compare-and-select does not vectorize.
    """
    if not isinstance(x, types.Array) or x.dtype not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        xa, start, count = args
        single = signature.args[0].dtype == types.float32
        fty = _F32 if single else ir.DoubleType()
        lanes, size = (MAX_LANES, 4) if single else (MAX_LANES // 2, 8)
        vty = ir.VectorType(fty, lanes)
        i64 = ir.IntType(64)
        data = context.make_array(signature.args[0])(context, builder, xa).data
        base = builder.gep(data, [builder.sext(start, i64) if start.type != i64 else start])
        count = builder.sext(count, i64) if count.type != i64 else count
        step = lanes * MAX_UNROLL
        lowest = ir.Constant(vty, [float("-inf")] * lanes)

        def larger(a, b):  # a > b ? a : b
            return builder.select(builder.fcmp_ordered(">", a, b), a, b)

        pre = builder.block
        loop = builder.append_basic_block("vmax.loop")
        done = builder.append_basic_block("vmax.done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), pre)
        accs = []
        for _ in range(MAX_UNROLL):
            acc = builder.phi(vty)
            acc.add_incoming(lowest, pre)
            accs.append(acc)
        new = []
        for k, acc in enumerate(accs):
            at = builder.gep(base, [builder.add(i, ir.Constant(i64, k * lanes))])
            v = builder.load(builder.bitcast(at, vty.as_pointer()), align=size)
            new.append(larger(v, acc))
        i_next = builder.add(i, ir.Constant(i64, step))
        end = builder.block
        i.add_incoming(i_next, end)
        for acc, value in zip(accs, new, strict=True):
            acc.add_incoming(value, end)
        builder.cbranch(builder.icmp_signed("<", i_next, count), loop, done)
        builder.position_at_end(done)
        outs = []
        for k in range(MAX_UNROLL):
            phi = builder.phi(vty)
            phi.add_incoming(lowest, pre)
            phi.add_incoming(new[k], end)
            outs.append(phi)
        while len(outs) > 1:
            outs = [larger(outs[k], outs[k + 1]) for k in range(0, len(outs), 2)]
        m = builder.extract_element(outs[0], ir.Constant(ir.IntType(32), 0))
        for k in range(1, lanes):
            m = larger(builder.extract_element(outs[0], ir.Constant(ir.IntType(32), k)), m)
        return m

    return x.dtype(x, j0, n), codegen
