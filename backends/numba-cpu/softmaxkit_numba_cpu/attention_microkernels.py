"""Register-blocked float32 products of the attention forward, written in LLVM IR.

BLAS is general; the two products of the attention forward have a shape it serves poorly:
``S = Q K^T`` has an inner dimension of only the head dim, so BLAS spends a good part of its
time zeroing ``S``, reading it back and packing both operands for every tile, and
``O += P V`` packs the whole probability tile.  Here:

* :func:`pack_keys` lays each head's keys out once as panels of 16 keys (``[d][16]``,
  zero-padded), shared by every query tile of that head;
* :func:`scores` computes a tile of ``S`` six query rows x 16 keys at a time in twelve
  8-lane accumulators (query values broadcast, one FMA per lane), writes ``S`` once, and
  keeps each row's lanewise maximum on the way, so the softmax needs no maximum pass;
* :func:`accumulate` adds ``P V`` to the output six rows x 16 columns at a time, reading
  ``P`` where the softmax wrote it and ``V`` from panels of 16 value columns
  (:func:`pack_values`, ``[Lk][16]``), also laid out once per head.

Both are overloaded on the dtype: float64 uses BLAS (:func:`~.attention_blas.gemm`), and so
do float32 calls whose value dim is not a multiple of 16 (``accumulate``) or whose head dim
is 0 (``scores``).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .attention_blas import gemm

PANEL = 16
"""Keys per panel of :func:`pack_keys`, and columns of each microkernel block."""

ROWS = 6
"""Rows of each microkernel block: 6 x 16 float32 = twelve AVX2 accumulators."""

_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _vector_call(builder, name, *args):
    fnty = ir.FunctionType(_V8, [_V8] * len(args))
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _broadcast(builder, value):
    vec = builder.insert_element(ir.Constant(_V8, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _data(context, builder, ty, value, offset):
    return builder.gep(context.make_array(ty)(context, builder, value).data, [offset])


def _element(builder, base, ld):
    """``(r, c) -> base[r * ld + c]``: an element of a row-major block, ``r`` a literal row."""

    def load(r, c):
        at = builder.add(builder.mul(ir.Constant(_I64, r), ld), c)
        return builder.load(builder.gep(base, [at]))

    return load


def _literal_rows(rows, arrays):
    """A microkernel's literal row count, or None where ``rows`` is not a literal or an
    array is not float32 (the microkernels then do not apply)."""
    if not isinstance(rows, types.IntegerLiteral) or any(
            not isinstance(a, types.Array) or a.dtype != types.float32 for a in arrays):
        return None
    return rows.literal_value


def _block_loop(builder, count, rows, a_elem, b_pair):
    """The k-loop of a block: ``acc[r] += broadcast(a_elem(r, k)) * b_pair(k)``, k < count.

    Returns the ``2 * rows`` accumulators after the loop (``count`` must be at least 1).
    """
    pre = builder.block
    loop = builder.append_basic_block("block.loop")
    done = builder.append_basic_block("block.done")
    builder.branch(loop)
    builder.position_at_end(loop)
    k = builder.phi(_I64)
    k.add_incoming(ir.Constant(_I64, 0), pre)
    zero = ir.Constant(_V8, [0.0] * 8)
    accs = []
    for _ in range(2 * rows):
        acc = builder.phi(_V8)
        acc.add_incoming(zero, pre)
        accs.append(acc)
    b0, b1 = b_pair(k)
    new = []
    for r in range(rows):
        a = _broadcast(builder, a_elem(r, k))
        new.append(_vector_call(builder, "llvm.fma.v8f32", a, b0, accs[2 * r]))
        new.append(_vector_call(builder, "llvm.fma.v8f32", a, b1, accs[2 * r + 1]))
    k_next = builder.add(k, ir.Constant(_I64, 1))
    end = builder.block
    k.add_incoming(k_next, end)
    for acc, value in zip(accs, new, strict=True):
        acc.add_incoming(value, end)
    builder.cbranch(builder.icmp_signed("<", k_next, count), loop, done)
    builder.position_at_end(done)
    return new


def _pair(builder, ptr):
    first = builder.load(builder.bitcast(ptr, _V8.as_pointer()), align=4)
    second = builder.gep(ptr, [ir.Constant(_I64, 8)])
    return first, builder.load(builder.bitcast(second, _V8.as_pointer()), align=4)


@intrinsic
def score_block(typingctx, rows, q, q_off, ldq, kp, kp_off, d, s, s_off, lds, mx, mx_off):
    """``s[r, :16] = sum_c q[r, c] kp[c, :16]`` and ``mx[r, :8] = max(mx[r, :8], s[r, :16])``.

    For ``r < rows`` (a literal, 1 to :data:`ROWS`); all float32, rows at the given element
    offsets and strides (``kp`` is one panel, ``[d][16]``; ``mx`` rows are 8 lanes).
    ``d`` must be at least 1.
    """
    nrows = _literal_rows(rows, (q, kp, s, mx))
    if nrows is None:
        return None

    def codegen(context, builder, signature, args):
        _, qa, qoff, ldq_, ka, koff, d_, sa, soff, lds_, ma, moff = args
        sig = signature.args
        qbase = _data(context, builder, sig[1], qa, qoff)
        kbase = _data(context, builder, sig[4], ka, koff)
        sbase = _data(context, builder, sig[7], sa, soff)
        mbase = _data(context, builder, sig[10], ma, moff)

        q_elem = _element(builder, qbase, ldq_)

        def k_pair(c):
            return _pair(builder, builder.gep(kbase, [builder.mul(c, ir.Constant(_I64, 16))]))

        accs = _block_loop(builder, d_, nrows, q_elem, k_pair)
        for r in range(nrows):
            row = builder.gep(sbase, [builder.mul(ir.Constant(_I64, r), lds_)])
            builder.store(accs[2 * r], builder.bitcast(row, _V8.as_pointer()), align=4)
            second = builder.gep(row, [ir.Constant(_I64, 8)])
            builder.store(accs[2 * r + 1], builder.bitcast(second, _V8.as_pointer()), align=4)
            mptr = builder.bitcast(builder.gep(mbase, [ir.Constant(_I64, 8 * r)]),
                                   _V8.as_pointer())
            both = _vector_call(builder, "llvm.maxnum.v8f32", accs[2 * r], accs[2 * r + 1])
            old = builder.load(mptr, align=4)
            builder.store(_vector_call(builder, "llvm.maxnum.v8f32", old, both), mptr, align=4)
        return ir.Constant(_I32, 0)

    intp = types.intp
    sig = types.int32(rows, q, intp, intp, kp, intp, intp, s, intp, intp, mx, intp)
    return sig, codegen


@intrinsic
def value_block(typingctx, rows, p, p_off, ldp, v, v_off, ldv, nk, o, o_off, ldo):
    """``o[r, :16] += sum_k p[r, k] v[k, :16]`` for ``r < rows`` (a literal, 1 to 6).

    All float32, rows at the given element offsets and strides; ``nk`` must be at least 1.
    """
    nrows = _literal_rows(rows, (p, v, o))
    if nrows is None:
        return None

    def codegen(context, builder, signature, args):
        _, pa, poff, ldp_, va, voff, ldv_, nk_, oa, ooff, ldo_ = args
        sig = signature.args
        pbase = _data(context, builder, sig[1], pa, poff)
        vbase = _data(context, builder, sig[4], va, voff)
        obase = _data(context, builder, sig[8], oa, ooff)

        p_elem = _element(builder, pbase, ldp_)

        def v_pair(k):
            return _pair(builder, builder.gep(vbase, [builder.mul(k, ldv_)]))

        accs = _block_loop(builder, nk_, nrows, p_elem, v_pair)
        for r in range(nrows):
            row = builder.gep(obase, [builder.mul(ir.Constant(_I64, r), ldo_)])
            for half in range(2):
                ptr = builder.bitcast(builder.gep(row, [ir.Constant(_I64, 8 * half)]),
                                      _V8.as_pointer())
                total = builder.fadd(builder.load(ptr, align=4), accs[2 * r + half])
                builder.store(total, ptr, align=4)
        return ir.Constant(_I32, 0)

    intp = types.intp
    sig = types.int32(rows, p, intp, intp, v, intp, intp, intp, o, intp, intp)
    return sig, codegen


@njit(cache=True, nogil=True)
def pack_keys(k, kp, bk):
    """Keys of (batch, kv head) ``bk`` of ``k [B, Hk, Lk, D]`` into panels ``kp[bk]``.

    ``kp[bk, (p * D + c) * 16 + l] = k[b, h, p * 16 + l, c]``, 0 past the last key.
    """
    hk, lk, d = k.shape[1], k.shape[2], k.shape[3]
    b = bk // hk
    h = bk - b * hk
    dst = kp[bk]
    for p in range((lk + PANEL - 1) // PANEL):
        for c in range(d):
            base = (p * d + c) * PANEL
            for lane in range(PANEL):
                j = p * PANEL + lane
                dst[base + lane] = k[b, h, j, c] if j < lk else 0


@njit(cache=True, nogil=True)
def pack_values(v, vp, bk):
    """Values of (batch, kv head) ``bk`` of ``v [B, Hk, Lk, Dv]`` into column panels ``vp[bk]``.

    ``vp[bk, (p * L + j) * 16 + l] = v[b, h, j, p * 16 + l]`` with ``L = 16 * ceil(Lk / 16)``,
    0 past the last key; ``Dv`` is a multiple of 16.
    """
    hk, lk, dv = v.shape[1], v.shape[2], v.shape[3]
    b = bk // hk
    h = bk - b * hk
    rows = (lk + PANEL - 1) // PANEL * PANEL
    dst = vp[bk]
    for p in range(dv // PANEL):
        for j in range(rows):
            base = (p * rows + j) * PANEL
            for lane in range(PANEL):
                dst[base + lane] = v[b, h, j, p * PANEL + lane] if j < lk else 0


@njit(fastmath={"contract"}, cache=True, nogil=True)
def score_rows(qs, nr, d, kp, panel_off, npanels, s, lds, mx):
    """``S[:nr, :16 * npanels]`` of query rows ``qs[:nr]`` against consecutive key panels.

    Panel by panel: each panel of keys stays in L1 while all the query rows pass.
    """
    full = nr - nr % ROWS
    for p in range(npanels):
        k_off = panel_off + p * d * PANEL
        for r in range(0, full, ROWS):
            score_block(6, qs, r * d, d, kp, k_off, d, s, r * lds + p * PANEL, lds, mx, r * 8)
        for r in range(full, nr):
            score_block(1, qs, r * d, d, kp, k_off, d, s, r * lds + p * PANEL, lds, mx, r * 8)


@njit(fastmath={"contract"}, cache=True, nogil=True)
def value_rows(p, ldp, nr, nk, vp, j0, dv, o, o_off):
    """``O[:nr] += P[:nr, :nk] V[j0:j0+nk]`` from the value panels ``vp`` of one head.

    16 value columns at a time: that panel of ``V`` stays in L1 while all the rows pass.
    """
    rows = vp.shape[0] // dv
    full = nr - nr % ROWS
    for c in range(0, dv, PANEL):
        v_off = (c * rows) + j0 * PANEL
        for r in range(0, full, ROWS):
            value_block(6, p, r * ldp, ldp, vp, v_off, PANEL, nk, o, o_off + r * dv + c, dv)
        for r in range(full, nr):
            value_block(1, p, r * ldp, ldp, vp, v_off, PANEL, nk, o, o_off + r * dv + c, dv)


def scores(qs, r0, nr, d, k, kp, bk, j0, nk, s, lds, mx):  # pragma: no cover - overloaded
    """``S[:nr, :nk] = Q_s[r0:r0+nr] K[bk, j0:j0+nk]^T``; True when ``mx`` holds row maxima.

    ``mx[i, :8]`` then holds lanewise maxima of row ``i`` (float32 microkernel path; ``j0`` a
    multiple of 16); False means the caller must take the maximum itself.
    """
    raise NotImplementedError


def accumulate(p, lds, nr, nk, v, vp, bk, j0, acc, r0):  # pragma: no cover - overloaded
    """``acc[r0:r0+nr] += P[:nr, :nk] V[bk, j0:j0+nk]``; ``vp`` the value panels or ``[0, 0]``."""
    raise NotImplementedError


@overload(scores, jit_options={"cache": True})
def _scores(qs, r0, nr, d, k, kp, bk, j0, nk, s, lds, mx):
    if s.dtype == types.float32:
        def impl(qs, r0, nr, d, k, kp, bk, j0, nk, s, lds, mx):
            if d == 0:
                s[:nr, :nk] = 0
                return False
            mx[:nr] = -np.inf
            npanels = (nk + PANEL - 1) // PANEL
            score_rows(qs[r0:], nr, d, kp[bk], (j0 // PANEL) * d * PANEL, npanels, s, lds, mx)
            return nk % PANEL == 0
        return impl

    def blas(qs, r0, nr, d, k, kp, bk, j0, nk, s, lds, mx):
        lk = k.shape[2]
        gemm(0, 1, nr, nk, d, 1.0, qs, r0 * max(d, 1), max(d, 1), k, (bk * lk + j0) * d,
             max(d, 1), 0.0, s, 0, lds)
        return False
    return blas


@njit(cache=True, nogil=True)
def value_product(p, lds, nr, nk, v, bk, j0, acc, r0):
    """``acc[r0:r0+nr] += P[:nr, :nk] V[bk, j0:j0+nk]`` by BLAS."""
    lk, dv = v.shape[2], v.shape[3]
    gemm(0, 0, nr, dv, nk, 1.0, p, 0, lds, v, (bk * lk + j0) * dv, dv, 1.0, acc, r0 * dv, dv)


@overload(accumulate, jit_options={"cache": True})
def _accumulate(p, lds, nr, nk, v, vp, bk, j0, acc, r0):
    if p.dtype == types.float32:
        def impl(p, lds, nr, nk, v, vp, bk, j0, acc, r0):
            if vp.shape[0] > 0:
                value_rows(p, lds, nr, nk, vp[bk], j0, v.shape[3], acc, r0 * v.shape[3])
            else:
                value_product(p, lds, nr, nk, v, bk, j0, acc, r0)
        return impl

    def blas(p, lds, nr, nk, v, vp, bk, j0, acc, r0):
        value_product(p, lds, nr, nk, v, bk, j0, acc, r0)
    return blas
