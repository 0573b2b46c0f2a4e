"""Exact attention on CUDA cores for float32 and float64 (FlashAttention-2 order).

Products and sums are in the accumulator dtype of the inputs (float32 for float32, float64
for float64); no tensor core takes part.  Every kernel runs blocks of :data:`THREADS` threads
laid out as 16 row groups (``ty``) of :data:`LANES` lanes (``tx``); a thread owns a
micro-tile of rows ``ty + 16 i`` and columns ``tx + 16 j``, so each value it reads from shared
memory feeds several FMAs, and the 16 lanes of a row group (half a warp) share their rows.

Shared memory holds every operand transposed, ``X^T[c][r]`` with a row stride of ``R + 1``
(``R`` = the tile's rows): reading along ``r`` (consecutive lanes) and along ``c`` (lanes 16
apart) both fall in distinct banks, and a row group's reads of one row are broadcasts.

Forward (:func:`forward`): a block owns ``BM`` query rows of one (batch, head), scaled by
``scale * log2 e`` as they are staged, so a probability costs one ``exp2``.  Key and value
tiles of ``BN`` keys walk the keys the block's rows may see (tiles entirely outside the causal
or window band are never visited); scores of excluded keys (past Lk, outside the band, masked)
are set to ``-inf``, never multiplied by zero.  Each row keeps a running maximum and sum;
the probabilities go through shared memory to ``O += P V`` in registers.  A row with no
allowed key keeps ``max = -inf``, ``sum = 0`` and ends as out 0, lse ``-inf``.

Backward (:func:`backward`, after :func:`backward_rows`): a block owns ``BN`` keys of one
(batch, key head) and walks the query tiles of every query head of its group that may see
them, recomputing ``P = exp2(S' - lse')`` from the forward's lse; dK and dV stay in registers
(so the group's sum needs no atomics), dQ's partial products are added atomically into a
zero-initialized dq in the accumulator dtype.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import uint64 as u

from .attention_tiles import (  # noqa: F401 - the tiles' plan, kept beside the kernels
    BACKWARD_TILES,
    FORWARD_TILES,
    LANES,
    MAX_HEAD_DIM,
    _columns,
    backward_shared,
    forward_shared,
    tiles,
    tiles_within,
)
from .primitives import (
    LOG2E,
    NEG_INF,
    POS_INF,
    SIMULATOR,
    accumulator,
    cuda,
    device_function,
    kernel,
    logarithm,
    shfl_xor,
)
from .ptx import ex2

THREADS = 256
UNBOUNDED = 1 << 40
"""A band limit no key offset reaches."""

if SIMULATOR:

    def exp2_f64(x):
        """``2**x`` in float64."""
        with np.errstate(all="ignore"):
            return np.float64(np.exp2(np.float64(x)))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def exp2_f64(x):
        """``2**x`` in float64."""
        return libdevice.exp2(x)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


REGISTERS = {"float32": 128, "float64": 168}
"""Registers a thread of the attention kernels may use: as many as every tile configuration
of :data:`FORWARD_TILES` and :data:`BACKWARD_TILES` needs without spilling (``ptxas -v`` for
sm_90), two blocks a multiprocessor in float32 (its shared memory would fit three, but not
without spills at 80 registers), one in float64."""


def band_limits(causal: object, window: tuple[int, int]) -> tuple[int, int]:
    """``(lo, hi)``: key ``j`` is in query ``i``'s causal and window band when
    ``lo <= j - (i + offset) <= hi`` (spec "Attention")."""
    left, right = window
    hi = right if right >= 0 else UNBOUNDED
    if causal is not None:
        hi = min(hi, 0)
    lo = -left if left >= 0 else -UNBOUNDED
    return lo, hi


def _lane_max(x):
    """The maximum of ``x`` over the 16 lanes of a row group (every thread calls it)."""
    for step in (1, 2, 4, 8):
        y = shfl_xor(x, step)
        x = y if y > x else x
    return x


def _lane_sum(x):
    """The sum of ``x`` over the 16 lanes of a row group (every thread calls it)."""
    for step in (1, 2, 4, 8):
        x += shfl_xor(x, step)
    return x


if SIMULATOR:
    from .primitives import warp_butterfly

    # the same butterflies, replayed by one thread (two barriers instead of eight)
    def _lane_max(x):  # noqa: F811
        return warp_butterfly(x, lambda a, b: b if b > a else a, (1, 2, 4, 8))

    def _lane_sum(x):  # noqa: F811
        return warp_butterfly(x, lambda a, b: a + b, (1, 2, 4, 8))

else:
    _lane_max = cuda.jit(device=True, inline="always")(_lane_max)
    _lane_sum = cuda.jit(device=True, inline="always")(_lane_sum)


@functools.cache
def _stager(acc_name: str):
    """Device function ``stage(smem, off, stride, src, row0, rows, width, limit, cols, mult)``:
    rows ``row0 .. row0 + rows`` of ``src`` [L, cols] times ``mult``, transposed into shared
    memory (column ``c`` of row ``r`` at ``off + c * stride + r``) over ``width`` padded
    columns; rows at or past ``limit`` and columns at or past ``cols`` are staged as 0.  Every
    thread of the block calls it."""
    _, acc = accumulator(acc_name)
    zero = acc(0.0)

    def stage(smem, off, stride, src, row0, rows, width, limit, cols, mult):
        for e in range(cuda.threadIdx.x, rows * width, THREADS):
            r = e // width
            c = e - r * width
            x = zero
            if row0 + r < limit and c < cols:
                x = acc(src[u(row0 + r), u(c)]) * mult
            smem[u(off + c * stride + r)] = x

    return stage if SIMULATOR else cuda.jit(device=True, inline="always")(stage)


@functools.cache
def _outer_products(rows: int, cols: int):
    """Device function ``product(out, smem, a_off, a_stride, b_off, b_stride, depth, a_reg,
    b_reg, ty, tx)``: ``out [rows, cols] += A B^T`` over ``depth`` columns of two transposed
    operands in shared memory, the thread's micro-tile of rows ``ty + 16 i`` of A (column ``c``
    of row ``r`` at ``a_off + c * a_stride + r``) and rows ``tx + 16 j`` of B; ``a_reg`` and
    ``b_reg`` hold one column of each (``rows`` and ``cols`` values)."""

    def product(out, smem, a_off, a_stride, b_off, b_stride, depth, a_reg, b_reg, ty, tx):
        for c in range(depth):
            for i in range(rows):
                a_reg[i] = smem[u(a_off + c * a_stride + ty + LANES * i)]
            for j in range(cols):
                b_reg[j] = smem[u(b_off + c * b_stride + tx + LANES * j)]
            for i in range(rows):
                for j in range(cols):
                    out[i, j] += a_reg[i] * b_reg[j]

    return device_function(product, inline=True)


@functools.cache
def _exclusion(bm: int, bn: int, masked: bool):
    """Device functions ``edge(m0, n0, offset, lo, hi, lk, lq)``: whether the tile of ``bm``
    queries from ``m0`` and ``bn`` keys from ``n0`` needs a test per score (a tile inside Lq,
    Lk and every row's band needs none), and ``allowed(row, key, offset, lo, hi, lk, lq, mh)``:
    whether query ``row`` sees ``key`` (inside Lq, Lk and the band, and, with ``masked``, where
    the head's mask ``mh`` allows it).  The padding rows past Lq see no key: their zero q
    times a non-finite k at a key the caller excluded would otherwise put NaN into that key's
    dk and dv."""

    def edge(m0, n0, offset, lo, hi, lk, lq):
        return (masked or n0 + bn > lk or m0 + bm > lq or n0 + bn - 1 - (m0 + offset) > hi
                or n0 - (m0 + bm - 1 + offset) < lo)

    def allowed(row, key, offset, lo, hi, lk, lq, mh):
        rel = key - row - offset
        keep = key < lk and row < lq and rel >= lo and rel <= hi
        if masked and keep:
            keep = mh[u(row), u(key)]
        return keep

    return device_function(edge, inline=True), device_function(allowed, inline=True)


def _micro_tile():
    """``(tid, ty, tx)``: the thread's index in the block, its row group and its lane."""
    tid = cuda.threadIdx.x
    ty = tid // LANES
    return tid, ty, tid - ty * LANES


if not SIMULATOR:  # in the simulator it stays Python, as the stager does
    _micro_tile = cuda.jit(device=True, inline="always")(_micro_tile)


@functools.cache
def forward(kind: str, d: int, dv: int, rm: int, cn: int, masked: bool, capped: bool,
            registers: int = 0):
    """Kernel ``(q, k, v, mask, out, lse, qk_mult, cap_mult, offset, lo, hi, q_tiles)``.

    q [B, Hq, Lq, d], k [B, Hk, Lk, d], v [B, Hk, Lk, dv], mask [B, Hq, Lq, Lk] (read only
    when ``masked``), out [B, Hq, Lq, dv], lse [B, Hq, Lq] (accumulator dtype, natural log).
    Scores in log2 units are ``(q * qk_mult) . k``, or with ``capped``
    ``tanh((q * qk_mult) . k) * cap_mult``.  Grid: ``q_tiles * B * Hq`` blocks, the last query
    tiles of every head first (under a causal mask they see the most keys).
    """
    acc_name, acc = accumulator(kind)
    exp2 = exp2_f64 if acc_name == "float64" else ex2
    log = logarithm(acc_name)
    bm, bn = LANES * rm, LANES * cn
    oc = _columns(dv)
    dvp = LANES * oc
    qs, ks = bm + 1, bn + 1
    k_off = d * qs
    v_off = k_off + d * ks
    p_off = v_off + dvp * ks
    zero, one, neg_inf = acc(0.0), acc(1.0), acc(NEG_INF)
    stage = _stager(acc_name)
    product = _outer_products(rm, cn)
    edge, allowed = _exclusion(bm, bn, masked)
    ln2 = acc(math.log(2.0))
    regs = registers or REGISTERS[acc_name]

    @kernel(THREADS, 0, registers=regs)
    def attention_forward(q, k, v, mask, out, lse, qk_mult, cap_mult, offset, lo, hi,
                          q_tiles):
        smem = cuda.shared.array(0, acc)
        tid, ty, tx = _micro_tile()
        hq, lq = q.shape[1], q.shape[2]
        hk, lk = k.shape[1], k.shape[2]
        heads = q.shape[0] * hq
        bid = cuda.blockIdx.x
        bh = bid % heads
        m0 = (q_tiles - 1 - bid // heads) * bm
        b = bh // hq
        h = bh - b * hq
        kh = h // (hq // hk)
        qh, kb, vb, oh, lh = q[b, h], k[b, kh], v[b, kh], out[b, h], lse[b, h]
        mh = mask[b, h] if masked else mask[0, 0]
        last = min(m0 + bm, lq) - 1
        n_lo = max(0, m0 + offset + lo)
        n_hi = min(lk, last + offset + hi + 1)
        qm = acc(qk_mult)
        cm = acc(cap_mult)
        # Q (scaled) and each K tile fill exactly d columns: staged without the column test of
        # stage(), which the compiler does not remove and which changes the kernel's code
        for e in range(tid, bm * d, THREADS):
            r = e // d
            c = e - r * d
            x = zero
            if m0 + r < lq:
                x = acc(qh[u(m0 + r), u(c)]) * qm
            smem[u(c * qs + r)] = x

        o = cuda.local.array((rm, oc), acc)
        row_max = cuda.local.array(rm, acc)
        row_sum = cuda.local.array(rm, acc)
        s = cuda.local.array((rm, cn), acc)
        a_reg = cuda.local.array(rm, acc)
        b_reg = cuda.local.array(cn, acc)
        v_reg = cuda.local.array(oc, acc)
        for i in range(rm):
            row_max[i] = neg_inf
            row_sum[i] = zero
            for c in range(oc):
                o[i, c] = zero

        for n0 in range(n_lo, n_hi, bn):
            cuda.syncthreads()  # the last tile's P and V are read (and Q is staged)
            for e in range(tid, bn * d, THREADS):
                r = e // d
                c = e - r * d
                x = zero
                if n0 + r < lk:
                    x = acc(kb[u(n0 + r), u(c)])
                smem[u(k_off + c * ks + r)] = x
            stage(smem, v_off, ks, vb, n0, bn, dvp, lk, dv, one)
            cuda.syncthreads()

            for i in range(rm):
                for j in range(cn):
                    s[i, j] = zero
            product(s, smem, 0, qs, k_off, ks, d, a_reg, b_reg, ty, tx)
            if capped:
                for i in range(rm):
                    for j in range(cn):
                        s[i, j] = math.tanh(s[i, j]) * cm
            if edge(m0, n0, offset, lo, hi, lk, lq):
                for i in range(rm):
                    row = m0 + ty + LANES * i
                    for j in range(cn):
                        if not allowed(row, n0 + tx + LANES * j, offset, lo, hi, lk, lq, mh):
                            s[i, j] = neg_inf

            for i in range(rm):
                m_new = row_max[i]
                for j in range(cn):
                    if s[i, j] > m_new:
                        m_new = s[i, j]
                m_new = _lane_max(m_new)
                use = zero if m_new == neg_inf else m_new  # nothing allowed yet: p = 0
                alpha = exp2(row_max[i] - use)
                row_max[i] = m_new
                total = zero
                for j in range(cn):
                    p = exp2(s[i, j] - use)
                    total += p
                    smem[u(p_off + (ty + LANES * i) * ks + tx + LANES * j)] = p
                row_sum[i] = row_sum[i] * alpha + total
                for c in range(oc):
                    o[i, c] *= alpha
            cuda.syncthreads()

            for j in range(bn):
                for i in range(rm):
                    a_reg[i] = smem[u(p_off + (ty + LANES * i) * ks + j)]
                for c in range(oc):
                    v_reg[c] = smem[u(v_off + (tx + LANES * c) * ks + j)]
                for i in range(rm):
                    for c in range(oc):
                        o[i, c] += a_reg[i] * v_reg[c]

        for i in range(rm):
            total = _lane_sum(row_sum[i])
            row = m0 + ty + LANES * i
            if row < lq:
                inv = one / total if total > zero else zero
                for c in range(oc):
                    col = tx + LANES * c
                    if col < dv:
                        oh[u(row), u(col)] = o[i, c] * inv
                if tx == 0:
                    lh[u(row)] = row_max[i] * ln2 + log(total) if total > zero else neg_inf

    return attention_forward


@functools.cache
def backward_rows(kind: str, dv: int):
    """Kernel ``(out, dout, lse, lse2, delta, n_rows)``: for each row ``r`` of
    [B * Hq * Lq], ``lse2[r] = lse * log2 e`` and ``delta[r] = sum(dout * out)``, or
    ``(+inf, 0)`` for a row with no allowed key (``lse = -inf``), so its P is exactly 0.
    A row group of 16 lanes a row, 16 rows a block."""
    acc_name, acc = accumulator(kind)
    zero, neg_inf, pos_inf = acc(0.0), acc(NEG_INF), acc(POS_INF)
    log2e = acc(LOG2E)

    @kernel(THREADS, 0, registers=64)
    def attention_backward_rows(out, dout, lse, lse2, delta, n_rows):
        tid = cuda.threadIdx.x
        lane = tid % LANES
        r = cuda.blockIdx.x * (THREADS // LANES) + tid // LANES
        hq, lq = out.shape[1], out.shape[2]
        live = r < n_rows
        rr = r if live else 0
        bh = rr // lq
        i = rr - bh * lq
        b = bh // hq
        h = bh - b * hq
        level = acc(lse[b, h, i])
        total = zero
        if level != neg_inf:
            for e in range(lane, dv, LANES):
                total += acc(dout[b, h, i, e]) * acc(out[b, h, i, e])
        total = _lane_sum(total)
        if live and lane == 0:
            if level == neg_inf:
                lse2[r] = pos_inf
                delta[r] = zero
            else:
                lse2[r] = level * log2e
                delta[r] = total

    return attention_backward_rows


@functools.cache
def backward(kind: str, d: int, dv: int, rn: int, cm: int, masked: bool, capped: bool,
             registers: int = 0):
    """Kernel ``(q, k, v, dout, mask, lse2, delta, dq, dk, dv, qk_mult, cap_mult, ds_mult,
    offset, lo, hi)``.

    Layouts as :func:`forward`'s; dout [B, Hq, Lq, dv]; lse2, delta [B * Hq * Lq] from
    :func:`backward_rows`; dq [B, Hq, Lq, d] in the accumulator dtype, zero on entry, receives
    its sums atomically; dk, dv [B, Hk, Lk, d / dv] are written whole.  Scores in log2 units
    are ``(q . k) * qk_mult``, or with ``capped`` ``t * cap_mult`` with ``t = tanh((q . k) *
    qk_mult)``; ``dS = P (dP - delta) ds_mult`` (times ``1 - t^2``), ``ds_mult`` the scale.
    Grid: ``ceil(Lk / BN) * B * Hk`` blocks, the first key tiles of every head first.
    ``registers`` overrides the register cap (:data:`REGISTERS`).
    """
    acc_name, acc = accumulator(kind)
    exp2 = exp2_f64 if acc_name == "float64" else ex2
    bn, bm = LANES * rn, LANES * cm
    dc, vc = _columns(d), _columns(dv)
    dp, dvp = LANES * dc, LANES * vc
    ks, qs = bn + 1, bm + 1
    v_off = dp * ks
    q_off = v_off + dvp * ks
    g_off = q_off + dp * qs
    p_off = g_off + dvp * qs
    s_off = p_off + bn * qs
    l_off = s_off + bn * qs
    d_off = l_off + bm
    zero, one, pos_inf = acc(0.0), acc(1.0), acc(POS_INF)
    stage = _stager(acc_name)
    product = _outer_products(rn, cm)
    edge, allowed = _exclusion(bm, bn, masked)
    regs = registers or REGISTERS[acc_name]

    @kernel(THREADS, 0, registers=regs)
    def attention_backward(q, k, v, dout, mask, lse2, delta, dq, dk, dv_out, qk_mult,
                           cap_mult, ds_mult, offset, lo, hi):
        smem = cuda.shared.array(0, acc)
        tid, ty, tx = _micro_tile()
        hq, lq = q.shape[1], q.shape[2]
        hk, lk = k.shape[1], k.shape[2]
        group = hq // hk
        heads = q.shape[0] * hk
        bid = cuda.blockIdx.x
        bkh = bid % heads
        n0 = (bid // heads) * bn
        b = bkh // hk
        kh = bkh - b * hk
        kb, vb, dkh, dvh = k[b, kh], v[b, kh], dk[b, kh], dv_out[b, kh]
        qm = acc(qk_mult)
        capm = acc(cap_mult)
        dsm = acc(ds_mult)
        stage(smem, 0, ks, kb, n0, bn, dp, lk, d, one)
        stage(smem, v_off, ks, vb, n0, bn, dvp, lk, dv, one)

        dka = cuda.local.array((rn, dc), acc)
        dva = cuda.local.array((rn, vc), acc)
        dqa = cuda.local.array((cm, dc), acc)
        st = cuda.local.array((rn, cm), acc)
        dpt = cuda.local.array((rn, cm), acc)
        a_reg = cuda.local.array(rn, acc)
        a2_reg = cuda.local.array(rn, acc)
        b_reg = cuda.local.array(cm, acc)
        for a in range(rn):
            for c in range(dc):
                dka[a, c] = zero
            for c in range(vc):
                dva[a, c] = zero
        # the queries that may see a key of this tile
        i_lo = max(0, n0 - offset - hi)
        i_hi = min(lq, n0 + bn - 1 - offset - lo + 1)
        for hh in range(group):
            h = kh * group + hh
            row_base = (b * hq + h) * lq
            qh, gh, dqh = q[b, h], dout[b, h], dq[b, h]
            mh = mask[b, h] if masked else mask[0, 0]
            for m0 in range(i_lo, i_hi, bm):
                cuda.syncthreads()  # the last tile's operands are read (and K, V staged)
                stage(smem, q_off, qs, qh, m0, bm, dp, lq, d, one)
                stage(smem, g_off, qs, gh, m0, bm, dvp, lq, dv, one)
                for r in range(tid, bm, THREADS):
                    if m0 + r < lq:
                        smem[u(l_off + r)] = lse2[u(row_base + m0 + r)]
                        smem[u(d_off + r)] = delta[u(row_base + m0 + r)]
                    else:  # past Lq: P = 0
                        smem[u(l_off + r)] = pos_inf
                        smem[u(d_off + r)] = zero
                cuda.syncthreads()

                # S^T and dP^T for keys ty + 16 a, queries tx + 16 j
                for a in range(rn):
                    for j in range(cm):
                        st[a, j] = zero
                        dpt[a, j] = zero
                product(st, smem, 0, ks, q_off, qs, d, a_reg, b_reg, ty, tx)
                product(dpt, smem, v_off, ks, g_off, qs, dv, a_reg, b_reg, ty, tx)
                tested = edge(m0, n0, offset, lo, hi, lk, lq)
                for a in range(rn):
                    key = n0 + ty + LANES * a
                    for j in range(cm):
                        qi = tx + LANES * j
                        row = m0 + qi
                        keep = True
                        if tested:
                            keep = allowed(row, key, offset, lo, hi, lk, lq, mh)
                        p = zero
                        ds = zero
                        if keep:
                            if capped:
                                t = math.tanh(st[a, j] * qm)
                                p = exp2(t * capm - smem[u(l_off + qi)])
                                ds = p * (dpt[a, j] - smem[u(d_off + qi)]) * (one - t * t) * dsm
                            else:
                                p = exp2(st[a, j] * qm - smem[u(l_off + qi)])
                                ds = p * (dpt[a, j] - smem[u(d_off + qi)]) * dsm
                        smem[u(p_off + (ty + LANES * a) * qs + qi)] = p
                        smem[u(s_off + (ty + LANES * a) * qs + qi)] = ds
                cuda.syncthreads()

                # dV += P dO and dK += dS Q for keys ty + 16 a, columns tx + 16 c
                for i in range(bm):
                    for a in range(rn):
                        a_reg[a] = smem[u(p_off + (ty + LANES * a) * qs + i)]
                        a2_reg[a] = smem[u(s_off + (ty + LANES * a) * qs + i)]
                    for c in range(vc):
                        g = smem[u(g_off + (tx + LANES * c) * qs + i)]
                        for a in range(rn):
                            dva[a, c] += a_reg[a] * g
                    for c in range(dc):
                        x = smem[u(q_off + (tx + LANES * c) * qs + i)]
                        for a in range(rn):
                            dka[a, c] += a2_reg[a] * x
                # dQ += dS^T K for queries ty + 16 j, columns tx + 16 c
                for j in range(cm):
                    for c in range(dc):
                        dqa[j, c] = zero
                for r in range(bn):
                    for j in range(cm):
                        b_reg[j] = smem[u(s_off + r * qs + ty + LANES * j)]
                    for c in range(dc):
                        x = smem[u((tx + LANES * c) * ks + r)]
                        for j in range(cm):
                            dqa[j, c] += b_reg[j] * x
                for j in range(cm):
                    row = m0 + ty + LANES * j
                    if row < lq:
                        for c in range(dc):
                            col = tx + LANES * c
                            if col < d:
                                cuda.atomic.add(dqh, (u(row), u(col)), dqa[j, c])

        for a in range(rn):
            key = n0 + ty + LANES * a
            if key < lk:
                for c in range(dc):
                    col = tx + LANES * c
                    if col < d:
                        dkh[u(key), u(col)] = dka[a, c]
                for c in range(vc):
                    col = tx + LANES * c
                    if col < dv:
                        dvh[u(key), u(col)] = dva[a, c]

    return attention_backward
