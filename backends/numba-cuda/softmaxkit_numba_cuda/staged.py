"""Long rows staged in shared memory: softmax, log_softmax and cross-entropy with its gradient.

A row longer than a block holds in registers is copied to shared memory with ``cp.async``
(the copy never passes through registers), one block per row when the row fits in
:data:`.plan.STAGE_BYTES`, otherwise one block per chunk of the fewest equal chunks that fit
(:func:`.plan.staged`).  A block needs few registers (one word's values at a time) and
several blocks fit on a multiprocessor, so many bytes are in flight; a row that fits one block
exchanges nothing with other blocks.

Each thread copies its words ``base + threads * j`` in :func:`groups` groups and takes its
maximum over each group as it lands (the maximum does not depend on the order), then its sum
of exponentials over the staged words, then writes its outputs from the staged words: the
arithmetic and its order are those of the register kernels (:mod:`.rowkernels`), so the
summaries of the chunks of a split row are the same whether a block or the fallback of the
summary exchange computes them.  Each thread reads back only the words it copied, so no
barrier is needed between the copy and the reads.  Excluded positions (``where`` False) are
overwritten with ``-inf`` in the staged words before the first use; the tail past the row's
end is never read.

Staged kernels serve rows that the register plan splits, read in 16-byte words (float32,
bfloat16, float16, the same dtype in and out); the environment variable :data:`ENABLE` = ``0``
turns them off (the register kernels then serve every row).
"""

from __future__ import annotations

import functools
import os

from numba import float32, int32, uint32

from .intrinsics import NAN, NEG_INF, POS_INF, cuda, device_function, kernel, log_f32
from .plan import WORD_BYTES
from .reductions import SCRATCH, exponential, group_reducers, thread_max
from .rowkernels import _placement, _row_summary, _slots
from .storage import loader, storer, word_codec
from .wide import cp_async16, cp_async_commit, cp_async_pending, store16

ENABLE = "SOFTMAXKIT_NUMBA_CUDA_STAGED"
GROUPS = "SOFTMAXKIT_NUMBA_CUDA_STAGE_GROUPS"
"""Environment variable: the copy groups a thread's words are split into (tuning)."""
KINDS = ("float32", "bfloat16", "float16")
DEFAULT_GROUPS = 4


def enabled(kind: str, split: bool, vector: bool, same_dtype: bool) -> bool:
    """Whether a row that the register plan ``split``s takes a staged kernel."""
    return (os.environ.get(ENABLE, "1") != "0" and split and vector and same_dtype
            and kind in KINDS)


def groups(slots: int) -> int:
    """Copy groups of a thread's ``slots`` words (at most 4, each of whole words)."""
    g = int(os.environ.get(GROUPS, DEFAULT_GROUPS))
    g = max(1, min(g, 4, slots))
    while slots % g:
        g -= 1
    return g


def shared_bytes(threads: int, slots: int) -> int:
    """Dynamic shared memory of a block staging ``threads * slots`` words."""
    return threads * slots * WORD_BYTES


@functools.cache
def _stage(kind: str, threads: int, slots: int, has_where: bool, n_groups: int,
           count: bool):
    """Device functions of a thread's staged words ``base + threads * j`` (``lane`` its
    thread index): ``load(stage, xr, wr, nw, base, lane) -> m_t`` copies them, masks them and
    returns their maximum; ``sums(stage, nw, base, lane, m_t) -> (s_t, included, zsum)``
    as :func:`.rowkernels._thread_sum` (``included``, ``zsum`` with ``count``)."""
    width, decode, encode = word_codec(kind)
    tmax = thread_max("float32")
    exp = exponential("float32")
    per = slots // n_groups
    neg_inf, zero, one = float32(NEG_INF), float32(0.0), float32(1.0)

    def load(stage, xr, wr, nw, base, lane):
        for g in range(n_groups):
            for j in range(g * per, (g + 1) * per):
                if base + j * threads < nw:
                    cp_async16(stage, (lane + j * threads) * 4, xr,
                               (base + j * threads) * width)
            cp_async_commit()
        buf = cuda.local.array(width, float32)
        m = neg_inf
        if has_where:  # every word lands, then the excluded values become -inf
            cp_async_pending(0)
            for j in range(slots):
                wi = base + j * threads
                if wi < nw:
                    q = (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    for v in range(width):
                        if not wr[wi * width + v]:
                            buf[v] = neg_inf
                        m = tmax(m, buf[v])
                    a, b, c, d = encode(buf, 0)
                    stage[q] = a
                    stage[q + 1] = b
                    stage[q + 2] = c
                    stage[q + 3] = d
            return m
        for g in range(n_groups):
            cp_async_pending(n_groups - 1 - g)  # the maximum of a group as it lands
            for j in range(g * per, (g + 1) * per):
                if base + j * threads < nw:
                    q = (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    for v in range(width):
                        m = tmax(m, buf[v])
        return m

    def sums(stage, nw, base, lane, m_t):
        buf = cuda.local.array(width, float32)
        s = zero
        c = zero
        z = zero
        if m_t > neg_inf and m_t < POS_INF:
            for j in range(slots):
                if base + j * threads < nw:
                    q = (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    for v in range(width):
                        d = buf[v] - m_t
                        s += exp(d)
                        if count and buf[v] > neg_inf:
                            c += one
                            z += d
        return s, c, z

    return device_function(load), device_function(sums)


@functools.cache
def normalize(op: str, kind: str, threads: int, slots: int, has_where: bool):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp)`` (the signature of
    :func:`.rowkernels.normalize`): one block of ``threads`` per chunk of
    ``threads * slots`` words, launched with :func:`shared_bytes` of dynamic shared memory."""
    is_log = op == "log_softmax"
    width, decode, encode = word_codec(kind)
    words = threads * slots
    load, sums = _stage(kind, threads, slots, has_where, groups(slots), False)
    exp = exponential("float32")
    pair_reduce = group_reducers(threads, "float32")[0]
    publish = _slots("float32", 2)[0]
    collect = _row_summary(kind, True, threads, slots, has_where, 2)
    place = _placement(threads, 1, True)
    nan, neg_inf, zero, one = float32(NAN), float32(NEG_INF), float32(0.0), float32(1.0)

    @kernel(threads, 8)  # a word's values and a few indices: 40 registers
    def row_kernel(x, w, masked_nan, out, n_rows, nw, chunks, wsp):
        stage = cuda.shared.array(0, uint32)
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, float32)
        lane, r, c, _ = place(n_rows, chunks)
        xr = x[r]
        wr = w[r if has_where else 0]
        orow = out[r]
        base = c * words + lane
        m_t = load(stage, xr, wr, nw, base, lane)
        s_t, _, _ = sums(stage, nw, base, lane, m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        if chunks > 1:  # the row's summary from its other blocks
            if lane == 0:
                publish(wsp, r * chunks + c, m, s, zero, zero)
            m, s, _, _ = collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        log_s = log_f32(s) if not (nan_row or inf_row or empty) else zero
        f = zero
        if nan_row or inf_row or (masked_nan and empty):
            f = nan
        elif not empty and m_t > neg_inf:
            f = exp(m_t - m) * (one / s)
        buf = cuda.local.array(width, float32)
        for j in range(slots):
            wi = base + j * threads
            if wi < nw:
                q = (lane + j * threads) * 4
                decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                for v in range(width):
                    x_v = buf[v]
                    if is_log:
                        if nan_row or (masked_nan and empty):
                            o = nan
                        elif inf_row:
                            o = nan if x_v == POS_INF else neg_inf
                        elif empty:
                            o = x_v  # -inf: nothing is allowed
                        else:
                            o = (x_v - m) - log_s
                    elif f != f:
                        o = nan
                    elif f == zero:
                        o = zero
                    else:
                        o = exp(x_v - m_t) * f
                    buf[v] = o
                a, b, c2, d = encode(buf, 0)
                store16(orow, wi * width, a, b, c2, d)

    return row_kernel


@functools.cache
def cross_entropy(kind: str, threads: int, slots: int, has_where: bool, smooth: bool):
    """Kernel ``(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
    smoothing, has_ignore, ignore)`` (the signature of :func:`.rowkernels.cross_entropy`) with
    the fused gradient, one block of ``threads`` per chunk of ``threads * slots`` words.

    The loss and the gradient are those of the register kernel: ``grad = scale *
    (softmax(x) - y)`` written from the staged words with ``y`` the smoothing share only, then
    the thread that owns the target position rewrites that one element; block 0 of the row
    writes the loss.  ``ws`` and ``sync`` are unused.
    """
    width, decode, encode = word_codec(kind)
    words = threads * slots
    fields = 4 if smooth else 2
    load, sums = _stage(kind, threads, slots, has_where, groups(slots), smooth)
    exp = exponential("float32")
    pair_reduce, sum_reduce, _ = group_reducers(threads, "float32")
    publish = _slots("float32", fields)[0]
    collect = _row_summary(kind, True, threads, slots, has_where, fields)
    place = _placement(threads, 1, True)
    load_one = loader(kind, "float32")
    store = storer(kind)
    store_loss = storer("float32")
    nan, neg_inf, zero, one = float32(NAN), float32(NEG_INF), float32(0.0), float32(1.0)

    @kernel(threads, 8)
    def row_kernel(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
                   smoothing, has_ignore, ignore):
        stage = cuda.shared.array(0, uint32)
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, float32)
        lane, r, c, _ = place(n_rows, chunks)
        xr = x[r]
        wr = w[r if has_where else 0]
        grow = grad[r]
        base = c * words + lane
        m_t = load(stage, xr, wr, nw, base, lane)
        s_t, c_t, z_t = sums(stage, nw, base, lane, m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        cnt = zero
        zsum = zero
        if smooth:
            cnt = sum_reduce(c_t, scratch)
            zsum = sum_reduce(z_t + c_t * (m_t - m) if c_t > zero else zero, scratch)
        if chunks > 1:
            if lane == 0:
                publish(wsp, r * chunks + c, m, s, cnt, zsum)
            m, s, cnt, zsum = collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
        eps = float32(smoothing)
        n = nw * width
        target = index[r]
        valid = not has_ignore or target != ignore
        special = m != m or m == POS_INF
        normal = not special and m > neg_inf
        log_s = log_f32(s) if normal else zero
        inv = one / s if normal else zero
        share = eps / cnt if cnt > zero else eps
        g_scale = scale[0]
        in_row = valid and target >= 0 and target < n
        # the thread whose word holds the target (it rewrites that gradient element)
        tw = target // width - c * words
        owns = in_row and tw >= 0 and tw < words and tw % threads == lane
        writes_loss = c == 0
        x_t = nan
        if in_row and (owns or (writes_loss and lane == 0)):
            x_t = load_one(xr, target)
            if has_where:
                if not wr[target]:
                    x_t = neg_inf
        f = zero  # the plain gradient: exp(x - m_t) * f
        if valid and normal and not smooth and m_t > neg_inf:
            f = exp(m_t - m) * inv * g_scale
        buf = cuda.local.array(width, float32)
        for j in range(slots):
            wi = base + j * threads
            if wi < nw:
                q = (lane + j * threads) * 4
                decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                for v in range(width):
                    x_v = buf[v]
                    if not valid:
                        o = zero
                    elif special:
                        o = nan
                    elif not normal:
                        o = zero
                    elif smooth:
                        o = (exp(x_v - m) * inv - share) * g_scale if x_v > neg_inf else zero
                    elif f == zero:
                        o = zero
                    else:
                        o = exp(x_v - m_t) * f
                    buf[v] = o
                a, b, c2, d = encode(buf, 0)
                store16(grow, wi * width, a, b, c2, d)
        if owns and normal and x_t > neg_inf:
            g = exp(x_t - m) * inv - (one - eps)
            if smooth:
                g -= share
            store(grow, target, g * g_scale)
        if writes_loss and lane == 0:
            if not valid:
                res = zero
            elif special:
                res = nan
            else:
                z = x_t - (m if normal else zero)
                total = zero
                if eps != one:
                    total += (one - eps) * (z - log_s)
                if smooth and cnt > zero:
                    total += share * (zsum - cnt * log_s)
                res = zero - total
            store_loss(loss[r], 0, res)

    return row_kernel
