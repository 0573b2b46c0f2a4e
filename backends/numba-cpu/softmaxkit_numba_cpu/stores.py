"""Memory traffic of the row kernels: streaming stores, the store fence, a shared counter.

A row result is written once and not read again by the kernel, so a large one
(:data:`~.row_kernels.STREAM_FROM`) is written with non-temporal stores (``!nontemporal``
vector stores, ``vmovntps`` on x86): they go to memory without first reading the
destination's cache lines, which an ordinary store must do, and so move a third fewer
bytes. Each intrinsic here writes :data:`LANES` elements computed in float32 from a float32
or 16-bit source, converted to the destination's storage (float32, or float16 / bfloat16
bits, see :mod:`.bits`) in registers; the destination must be aligned to ``LANES`` elements
(:func:`aligned_span` finds the whole cache lines of a range). After the last streaming
store a kernel calls :func:`fence`, so every result is visible before it returns.

:func:`fetch_add` hands out rows to the threads of a kernel.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

LANES = 8
"""Elements per streaming store: one AVX register of float32."""

_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VI32 = ir.VectorType(_I32, LANES)
_VI16 = ir.VectorType(_I16, LANES)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_STREAMED = (types.float32, types.int16, types.uint16)  # float32, float16 bits, bfloat16 bits


def _pointer(context, builder, aryty, ary, idx):
    array = context.make_array(aryty)(context, builder, value=ary)
    return cgutils.get_item_pointer(context, builder, aryty, array, [idx], wraparound=False)


def _splat(builder, value):
    vec = builder.insert_element(ir.Constant(_VF, ir.Undefined), value, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
    return builder.shuffle_vector(vec, ir.Constant(_VF, ir.Undefined), mask)


def _load(context, builder, aryty, ary, idx):
    """``LANES`` elements of a 1-D storage array from ``idx``, widened to float32."""
    ptr = _pointer(context, builder, aryty, ary, idx)
    if aryty.dtype == types.float32:
        return builder.load(builder.bitcast(ptr, _VF.as_pointer()), align=4)
    raw = builder.load(builder.bitcast(ptr, _VI16.as_pointer()), align=2)
    if aryty.dtype == types.int16:  # float16 bits: F16C conversion
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VF)
    wide = builder.shl(builder.zext(raw, _VI32), ir.Constant(_VI32, [16] * LANES))
    return builder.bitcast(wide, _VF)


def _narrow(builder, dtype, vec):
    """float32 lanes in the storage of ``dtype``, rounded to nearest even (NaN stays NaN)."""
    if dtype == types.float32:
        return vec
    if dtype == types.int16:
        return builder.bitcast(builder.fptrunc(vec, ir.VectorType(ir.HalfType(), LANES)), _VI16)

    def const(v):
        return ir.Constant(_VI32, [v] * LANES)

    bits = builder.bitcast(vec, _VI32)
    odd = builder.and_(builder.lshr(bits, const(16)), const(1))
    rounded = builder.add(builder.add(bits, const(0x7FFF)), odd)
    quiet = builder.or_(bits, const(0x00400000))
    isnan = builder.fcmp_unordered("uno", vec, vec)
    chosen = builder.select(isnan, quiet, rounded)
    return builder.trunc(builder.lshr(chosen, const(16)), _VI16)


def _stream(context, builder, aryty, ary, idx, vec):
    """Non-temporal store of ``vec`` (float32 lanes) at ``ary[idx]``, aligned to the lanes."""
    value = _narrow(builder, aryty.dtype, vec)
    ptr = builder.bitcast(_pointer(context, builder, aryty, ary, idx), value.type.as_pointer())
    store = builder.store(value, ptr, align=LANES * (4 if aryty.dtype == types.float32 else 2))
    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))


def _typed(dst, src):
    return (isinstance(dst, types.Array) and dst.ndim == 1
            and isinstance(src, types.Array) and src.ndim == 1)


def _trap(context, builder):
    # kernels call the intrinsics only inside an aligned_span, which is empty for the
    # types they cannot write; reaching this would be a bug, so it stops the program
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                        "llvm.trap")
    builder.call(fn, [])


def _two_steps(dst, j, src, k, a, b, step):
    """The typing and code of ``dst[j:j+LANES] = step(step(src[k:k+LANES], a), b)`` in float32
    arithmetic, streamed; ``step`` names an IR builder operation (``"fmul"``, ``"fsub"``)."""
    if not _typed(dst, src) or a != b:
        return None

    def codegen(context, builder, signature, args):
        if not (streams(dst) and streams(src) and a == types.float32):
            _trap(context, builder)
            return context.get_dummy_value()
        adst, aj, asrc, ak, aa, ab = args
        apply = getattr(builder, step)
        v = _load(context, builder, signature.args[2], asrc, ak)
        v = apply(apply(v, _splat(builder, aa)), _splat(builder, ab))
        _stream(context, builder, signature.args[0], adst, aj, v)
        return context.get_dummy_value()

    return types.void(dst, j, src, k, a, b), codegen


@intrinsic
def stream_scaled(typingctx, dst, j, src, k, h, g):
    """``dst[j:j+LANES] = (src[k:k+LANES] * h) * g``, float32 arithmetic, streamed.

    Two factors, so that a scale below the float32 range can be applied as a normal ``h``
    and a power of two ``g`` (the product is rounded once unless the result is subnormal).
    """
    return _two_steps(dst, j, src, k, h, g, "fmul")


@intrinsic
def stream_shifted(typingctx, dst, j, src, k, a, b):
    """``dst[j:j+LANES] = (src[k:k+LANES] - a) - b``, float32 arithmetic, streamed."""
    return _two_steps(dst, j, src, k, a, b, "fsub")


@intrinsic
def fence(typingctx):
    """Order every earlier streaming store before any later store (``sfence`` on x86)."""

    def codegen(context, builder, signature, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty,
                                                        "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def streams(arr) -> bool:
    """Whether the intrinsics here read and write the Numba array type ``arr``."""
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in _STREAMED


def aligned_span(dst, j0, j1):  # pragma: no cover - replaced by the overload
    """``(a, b)``: the part of ``dst[j0:j1]`` (1-D) made of whole 64-byte cache lines.

    Streaming stores write ``dst[a:b]``; the elements before ``a`` and from ``b`` on share a
    cache line with other data and are written with ordinary stores, so no line receives
    both kinds (which costs a read of the line from memory).  ``a == b`` when there is no
    whole line, the array is not aligned to its element size, or the intrinsics here do
    not write its type.
    """
    raise NotImplementedError


_LINE = 64


@overload(aligned_span, jit_options={"cache": True})
def _aligned_span(dst, j0, j1):
    if not streams(dst):  # the intrinsics do not write this type: nothing is streamed
        return lambda dst, j0, j1: (j0, j0)
    size = dst.dtype.bitwidth // 8
    per_line = _LINE // size

    def impl(dst, j0, j1):
        address = dst.ctypes.data + j0 * size
        if address % size != 0 or j1 <= j0:
            return j0, j0
        a = min(j0 + (-address % _LINE) // size, j1)
        b = a + (j1 - a) // per_line * per_line
        return a, b

    return impl


@intrinsic
def fetch_add(typingctx, arr, j, value):
    """Atomically add ``value`` to ``arr[j]`` (1-D int64) and return the old value.

    The threads of a kernel take their next rows from a shared counter this way, so a thread
    slowed by other work on the machine leaves its rows to the others.
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
        add = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, add, "monotonic")

    return types.int64(arr, j, value), codegen
