"""16-byte loads and stores, packed 16-bit conversions, fast exp2 and the cross-block loads.

numba emits at most 8-byte accesses for array element loads, and its ``math`` functions go
through libdevice; these intrinsics write the PTX that a memory-bound row kernel wants:

* ``load16(row, i)`` / ``store16(row, i, a, b, c, d)``: the 16 bytes at element ``i`` of a
  1-D array as four 32-bit words (``ld.global.nc.v4.u32`` / ``st.global.v4.u32``); ``i`` must
  be a multiple of ``16 / itemsize`` and the row 16-byte aligned (the caller checks);
* ``ex2(x)``: ``2**x`` in float32 by ``ex2.approx.ftz.f32`` (relative error about 2 ulp,
  subnormal results flushed to zero);
* ``max_nan(a, b)``: the float32 maximum that propagates NaN (``max.NaN.f32``);
  ``max_bf16x2(a, b)`` / ``max_f16x2(a, b)``: the same on the two 16-bit halves of two words
  at once (``max.NaN.bf16x2`` / ``max.NaN.f16x2``; a NaN half comes out NaN);
* ``load_shared16(stage, j)``: elements ``j`` to ``j + 3`` of a shared ``uint32`` array (``j``
  a multiple of 4) in one ``ld.shared.v4.u32``;
* ``pack_bf16(lo, hi)`` / ``pack_f16(lo, hi)``: two float32 values rounded to nearest even and
  packed into one word (``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``, NaN stays NaN);
  ``unpack_f16(u)``: the two float16 halves of a word as float32;
* ``load_acquire(a, i)`` (``ld.acquire.gpu``) and ``load_l2(a, i)`` (``ld.relaxed.gpu``):
  loads of 32-bit integers, 64-bit unsigned integers and floats that see other blocks' writes
  (never a stale L1 line); ``store_release(a, i, v)`` (``st.release.gpu``): a 64-bit store
  ordered after every earlier write of the thread;
* ``globaltimer()``: the GPU's nanosecond clock; ``nanosleep(ns)``;
* ``opaque(v)``: the 64-bit integer ``v``, through a move the compiler cannot see through,
  so what is derived from it inside a loop is computed there and not hoisted out (and kept
  live, and spilled) across the loop;
* ``cp_async16(stage, j, row, i)``: copy the 16 bytes at element ``i`` of a global row to
  element ``j`` of a shared ``uint32`` array without passing through registers
  (``cp.async.cg.shared.global``); ``cp_async_wait()`` waits for the thread's copies
  (``cp.async.wait_all``), after which the thread may read what it copied;
  ``cp_async_commit()`` closes a group of copies (``cp.async.commit_group``) and
  ``cp_async_pending(n)`` waits until at most ``n`` of the thread's groups, 0 to 15, are
  still in flight (``cp.async.wait_group``; more than 15 waits as for 15);
* thread-block clusters (sm_90): ``cluster_rank()`` (``%cluster_ctarank``), the block's rank
  in its cluster, and ``cluster_id()`` (``%clusterid.x``), the cluster's index in a 1-D grid;
  ``cluster_arrive()`` / ``cluster_wait()`` (``barrier.cluster.arrive.release``
  / ``barrier.cluster.wait.acquire``, ``.aligned``: every thread of the block calls them), the
  split cluster barrier whose wait returns once every thread of the cluster has arrived, the
  writes before an arrive then visible after the wait; ``cluster_load(a, i, rank)``: element
  ``i`` of float32 shared array ``a`` in the block of rank ``rank`` of the cluster
  (``mapa.shared::cluster`` + ``ld.shared::cluster.f32``, distributed shared memory).

Under Numba's CUDA simulator each has a numpy form on the same bits.  The simulator runs the
blocks of a grid one after another, so its cluster forms serve a cluster of one block only:
``cluster_rank()`` is 0, ``cluster_id()`` the block's index, the barrier is the block's
barrier and ``cluster_load`` reads the
block's own array (another rank raises).
"""

from __future__ import annotations

import time

import numpy as np

from .primitives import SIMULATOR, cuda

if SIMULATOR:

    def load16(row, i):
        """The 16 bytes at element ``i`` of ``row`` as four unsigned 32-bit words."""
        k = 16 // row.itemsize
        w = np.ascontiguousarray(row[i:i + k]).view(np.uint32)
        return w[0], w[1], w[2], w[3]

    def store16(row, i, a, b, c, d):
        """Store four 32-bit words as the 16 bytes at element ``i`` of ``row``."""
        k = 16 // row.itemsize
        row[i:i + k] = np.array([a, b, c, d], dtype=np.uint32).view(row.dtype)

    def ex2(x):
        """``2**x`` in float32, subnormal results flushed to zero as ``.ftz`` does."""
        with np.errstate(all="ignore"):
            r = np.exp2(np.float32(x))
        return np.float32(0.0) if abs(r) < np.finfo(np.float32).tiny else r

    def max_nan(a, b):
        """The larger of ``a`` and ``b``, NaN if either is NaN."""
        if a != a or b != b:
            return np.float32(np.nan)
        return np.float32(a if a >= b else b)

    def _halves_max(a, b, widen):
        out = 0
        for shift in (0, 16):
            ha, hb = (int(a) >> shift) & 0xFFFF, (int(b) >> shift) & 0xFFFF
            va, vb = widen(ha), widen(hb)
            if va != va or vb != vb:
                bits = 0x7FFF  # a NaN
            else:
                bits = ha if va >= vb else hb
            out |= bits << shift
        return np.uint32(out)

    def _bf16_value(h):
        return np.array(h << 16, dtype=np.uint32).view(np.float32)[()]

    def _f16_value(h):
        return np.array(h, dtype=np.uint16).view(np.float16)[()]

    def max_bf16x2(a, b):
        """The NaN-propagating maximum of each bfloat16 half of words ``a`` and ``b``."""
        return _halves_max(a, b, _bf16_value)

    def max_f16x2(a, b):
        """The NaN-propagating maximum of each float16 half of words ``a`` and ``b``."""
        return _halves_max(a, b, _f16_value)

    def load_shared16(stage, j):
        """``stage[j:j + 4]`` as four unsigned 32-bit words."""
        return np.uint32(stage[j]), np.uint32(stage[j + 1]), np.uint32(stage[j + 2]), \
            np.uint32(stage[j + 3])

    def _bf16_bits(v):
        u = int(np.array(v, dtype=np.float32).view(np.uint32)[()])
        if v != v:
            return 0x7FFF
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    def pack_bf16(lo, hi):
        """bfloat16 bits of ``lo`` (low half) and ``hi`` (high half), rounded to nearest even."""
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def pack_f16(lo, hi):
        """float16 bits of ``lo`` (low half) and ``hi`` (high half), rounded to nearest even."""
        with np.errstate(all="ignore"):
            h = np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint16)
        return np.uint32(int(h[0]) | (int(h[1]) << 16))

    def unpack_f16(u):
        """The low and high float16 halves of word ``u`` as float32."""
        h = np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def load_acquire(a, i):
        """``a[i]`` as another block last published it."""
        return a[i]

    def load_l2(a, i):
        """``a[i]`` read from the L2 cache (coherent across blocks)."""
        return a[i]

    def store_release(a, i, v):
        """``a[i] = v``, after every earlier write of the thread."""
        a[i] = v

    def globaltimer():
        """Nanoseconds on a clock shared by every thread."""
        return time.perf_counter_ns()

    def opaque(v):
        """``v``."""
        return v

    def cp_async16(stage, j, row, i):
        """Copy the 16 bytes at element ``i`` of ``row`` to ``stage[j:j + 4]``."""
        k = 16 // row.itemsize
        stage[j:j + 4] = np.ascontiguousarray(row[i:i + k]).view(np.uint32)

    def cp_async_wait():
        """Wait for the thread's asynchronous copies (they are synchronous here)."""

    def cp_async_commit():
        """Close the thread's current group of asynchronous copies."""

    def cp_async_pending(n):
        """Wait until at most ``n`` groups of copies are in flight (they are done here)."""

    def nanosleep(ns):
        """Pause the thread for about ``ns`` nanoseconds (nothing in the simulator)."""

    def cluster_rank():
        """The block's rank in its cluster (a cluster of one block here)."""
        return 0

    @cuda.jit(device=True)
    def cluster_id():
        """The cluster's index in the grid: the block's, a cluster being one block here."""
        return cuda.blockIdx.x

    def cluster_arrive():
        """Arrive at the cluster barrier (the wait below holds the block's barrier)."""

    @cuda.jit(device=True)
    def cluster_wait():
        """Wait until every thread of the cluster, here the block, has arrived."""
        cuda.syncthreads()

    def cluster_load(a, i, rank):
        """``a[i]`` of the block of rank ``rank`` in the cluster (only the block itself here)."""
        if rank != 0:
            raise NotImplementedError("the simulator runs clusters of one block only")
        return np.float32(a[i])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()
    _REGISTER = {types.int32: (32, "r"), types.float32: (32, "f"), types.float64: (64, "d"),
                 types.uint64: (64, "l")}

    def _pointer(context, builder, aryty, ary, idx):
        arr = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, arr, [idx], wraparound=False)

    def _tuple_call(context, builder, sig, asm, args):
        """Call ``asm``, whose outputs are a struct, and return them as ``sig``'s tuple."""
        res = builder.call(asm, args)
        fields = [builder.extract_value(res, k) for k in range(len(sig.return_type))]
        return context.make_tuple(builder, sig.return_type, fields)

    def _load_words(text, constraint, side_effect=False):
        """An intrinsic ``(a, i) -> four uint32``: one asm statement that loads the 16 bytes
        at the address of element ``i`` of ``a`` (its operand ``$4``) into four words."""

        @intrinsic
        def impl(typingctx, a, i):
            sig = types.UniTuple(types.uint32, 4)(a, i)

            def codegen(context, builder, sig, args):
                ptr = _pointer(context, builder, sig.args[0], args[0], args[1])
                fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [ptr.type])
                asm = ir.InlineAsm(fnty, text, constraint, side_effect=side_effect)
                return _tuple_call(context, builder, sig, asm, [ptr])

            return sig, codegen

        return impl

    load16 = _load_words("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")

    @intrinsic
    def store16(typingctx, row, i, a, b, c, d):
        sig = types.void(row, i, a, b, c, d)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], args[1])
            words = [context.cast(builder, v, t, types.uint32)
                     for v, t in zip(args[2:], sig.args[2:], strict=True)]
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type] + [_I32] * 4)
            asm = ir.InlineAsm(fnty, "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
                               "l,r,r,r,r,~{memory}", side_effect=True)
            builder.call(asm, [ptr] + words)
            return context.get_dummy_value()

        return sig, codegen

    def _unary_f32(asm_text):
        @intrinsic
        def impl(typingctx, x):
            sig = types.float32(types.float32)

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], types.float32)
                asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), asm_text, "=f,f")
                return builder.call(asm, [v])

            return sig, codegen

        return impl

    ex2 = _unary_f32("ex2.approx.ftz.f32 $0, $1;")

    def _binary(asm_text, ty):
        """An intrinsic ``(a, b) -> ty``: one PTX instruction on two operands of ``ty``
        (float32 or uint32)."""
        lltype, reg = (_F32, "f") if ty == types.float32 else (_I32, "r")

        @intrinsic
        def impl(typingctx, a, b):
            sig = ty(ty, ty)

            def codegen(context, builder, sig, args):
                vals = [context.cast(builder, v, t, ty)
                        for v, t in zip(args, sig.args, strict=True)]
                asm = ir.InlineAsm(ir.FunctionType(lltype, [lltype, lltype]), asm_text,
                                   f"={reg},{reg},{reg}")
                return builder.call(asm, vals)

            return sig, codegen

        return impl

    max_nan = _binary("max.NaN.f32 $0, $1, $2;", types.float32)
    max_bf16x2 = _binary("max.NaN.bf16x2 $0, $1, $2;", types.uint32)
    max_f16x2 = _binary("max.NaN.f16x2 $0, $1, $2;", types.uint32)

    # ordered after the cp.async waits that precede it
    load_shared16 = _load_words(
        "{ .reg .u64 sa; .reg .u32 s32; cvta.to.shared.u64 sa, $4; cvt.u32.u64 s32, sa; "
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [s32]; }",
        "=r,=r,=r,=r,l,~{memory}", side_effect=True)

    def _pack(kind):
        @intrinsic
        def impl(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig, args):
                lo_v, hi_v = (context.cast(builder, v, t, types.float32)
                              for v, t in zip(args, sig.args, strict=True))
                # cvt.rn.{kind}x2.f32 d, a, b puts a in the high half and b in the low half
                asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                                   f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
                return builder.call(asm, [hi_v, lo_v])

            return sig, codegen

        return impl

    pack_bf16 = _pack("bf16")
    pack_f16 = _pack("f16")

    @intrinsic
    def unpack_f16(typingctx, u):
        sig = types.UniTuple(types.float32, 2)(u)

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            fnty = ir.FunctionType(ir.LiteralStructType([_F32, _F32]), [_I32])
            asm = ir.InlineAsm(
                fnty,
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; "
                "cvt.f32.f16 $1, hi; }",
                "=f,=f,r")
            return _tuple_call(context, builder, sig, asm, [word])

        return sig, codegen

    def _coherent_load(semantics):
        @intrinsic
        def impl(typingctx, a, i):
            dtype = a.dtype
            if dtype not in _REGISTER:
                return None
            sig = dtype(a, i)

            def codegen(context, builder, sig, args):
                ptr = _pointer(context, builder, sig.args[0], args[0], args[1])
                ty = context.get_value_type(dtype)
                bits, reg = _REGISTER[dtype]
                # side effects and a memory clobber: the load stays where it is written
                # (inside a polling loop, after a fence)
                asm = ir.InlineAsm(ir.FunctionType(ty, [ptr.type]),
                                   f"ld.{semantics}.gpu.global.b{bits} $0, [$1];",
                                   f"={reg},l,~{{memory}}", side_effect=True)
                return builder.call(asm, [ptr])

            return sig, codegen

        return impl

    load_acquire = _coherent_load("acquire")
    load_l2 = _coherent_load("relaxed")

    def _element_asm(dtype, result, operand, text, constraint):
        """An intrinsic ``(a, i, v) -> result`` (``result`` void or float32) for arrays ``a``
        of ``dtype``: one asm statement whose operands are the address of element ``i`` and
        ``v`` cast to ``operand`` (after the result, where there is one), with side effects
        and a memory clobber, so that it stays where it is written."""
        void = result == types.void

        @intrinsic
        def impl(typingctx, a, i, v):
            if a.dtype != dtype:
                return None
            sig = result(a, i, v)

            def codegen(context, builder, sig, args):
                ptr = _pointer(context, builder, sig.args[0], args[0], args[1])
                value = context.cast(builder, args[2], sig.args[2], operand)
                out = ir.VoidType() if void else context.get_value_type(result)
                asm = ir.InlineAsm(
                    ir.FunctionType(out, [ptr.type, context.get_value_type(operand)]), text,
                    constraint, side_effect=True)
                res = builder.call(asm, [ptr, value])
                return context.get_dummy_value() if void else res

            return sig, codegen

        return impl

    store_release = _element_asm(types.uint64, types.void, types.uint64,
                                 "st.release.gpu.global.b64 [$0], $1;", "l,l,~{memory}")

    @intrinsic
    def cp_async16(typingctx, stage, j, row, i):
        sig = types.void(stage, j, row, i)

        def codegen(context, builder, sig, args):
            dst = _pointer(context, builder, sig.args[0], args[0], args[1])
            src = _pointer(context, builder, sig.args[2], args[2], args[3])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [dst.type, src.type]),
                "{ .reg .u64 sa, ga; .reg .u32 s32; cvta.to.shared.u64 sa, $0; "
                "cvt.u32.u64 s32, sa; cvta.to.global.u64 ga, $1; "
                "cp.async.cg.shared.global [s32], [ga], 16; }",
                "l,l,~{memory}", side_effect=True)
            builder.call(asm, [dst, src])
            return context.get_dummy_value()

        return sig, codegen

    def _asm_statement(text):
        @intrinsic
        def impl(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return sig, codegen

        return impl

    cp_async_wait = _asm_statement("cp.async.wait_all;")
    cp_async_commit = _asm_statement("cp.async.commit_group;")
    _WAIT = tuple(_asm_statement(f"cp.async.wait_group {n};") for n in range(16))
    (_w0, _w1, _w2, _w3, _w4, _w5, _w6, _w7, _w8, _w9, _w10, _w11, _w12, _w13, _w14,
     _w15) = _WAIT

    @cuda.jit(device=True)
    def cp_async_pending(n):
        """Wait until at most ``n`` of the thread's groups of copies are in flight (the
        instruction takes a constant: 0 to 15, more waits as for 15; a constant ``n`` folds
        the choice away)."""
        if n <= 0:
            _w0()
        elif n == 1:
            _w1()
        elif n == 2:
            _w2()
        elif n == 3:
            _w3()
        elif n == 4:
            _w4()
        elif n == 5:
            _w5()
        elif n == 6:
            _w6()
        elif n == 7:
            _w7()
        elif n == 8:
            _w8()
        elif n == 9:
            _w9()
        elif n == 10:
            _w10()
        elif n == 11:
            _w11()
        elif n == 12:
            _w12()
        elif n == 13:
            _w13()
        elif n == 14:
            _w14()
        else:
            _w15()

    def _read_register(text, ty, ir_ty, constraint, side_effect=False):
        """An intrinsic ``() -> ty`` of one ``mov`` from a special register (``side_effect``:
        read where it is written, each time)."""

        @intrinsic
        def impl(typingctx):
            sig = ty()

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir_ty, []), text, constraint,
                                   side_effect=side_effect)
                return builder.call(asm, [])

            return sig, codegen

        return impl

    cluster_rank = _read_register("mov.u32 $0, %cluster_ctarank;", types.uint32, _I32, "=r")
    cluster_id = _read_register("mov.u32 $0, %clusterid.x;", types.uint32, _I32, "=r")
    cluster_arrive = _asm_statement("barrier.cluster.arrive.release.aligned;")
    cluster_wait = _asm_statement("barrier.cluster.wait.acquire.aligned;")

    # the local shared address, mapped to the same variable in block `rank` (the operand)
    cluster_load = _element_asm(
        types.float32, types.float32, types.uint32,
        "{ .reg .u64 sa; .reg .u32 s32, d32; cvta.to.shared.u64 sa, $1; "
        "cvt.u32.u64 s32, sa; mapa.shared::cluster.u32 d32, s32, $2; "
        "ld.shared::cluster.f32 $0, [d32]; }",
        "=f,l,r,~{memory}")

    globaltimer = _read_register("mov.u64 $0, %globaltimer;", types.uint64, ir.IntType(64),
                                 "=l", side_effect=True)

    @intrinsic
    def opaque(typingctx, v):
        sig = types.int64(types.int64)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.int64)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                               "mov.b64 $0, $1;", "=l,l", side_effect=True)
            return builder.call(asm, [v])

        return sig, codegen

    def nanosleep(ns):
        """Pause the thread for about ``ns`` nanoseconds."""
        cuda.nanosleep(types.uint32(ns))

    nanosleep = cuda.jit(device=True)(nanosleep)
