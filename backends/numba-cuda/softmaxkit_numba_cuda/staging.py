"""Rows staged in shared memory: the sizes and the device functions that the kernels of
:mod:`.staged` (a block per chunk, or a cluster per row) and :mod:`.persistent` (a persistent
grid of clusters) share: the copy of a thread's words in groups and their fold into a running
(max, sum) as they land, the row's state once its summary is known, and the outputs of a word.

Staged kernels serve rows that the register plan splits, read in 16-byte words (float32,
bfloat16, float16, the same dtype in and out).
"""

from __future__ import annotations

import functools

from numba import float32, uint32

from .plan import WORD_BYTES
from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    cuda,
    device_function,
    log_f32,
    register_cap,
)
from .ptx import (
    cp_async16,
    cp_async_commit,
    cp_async_pending,
    store16,
)
from .reductions import exponential, thread_max, word_terms
from .storage import word_codec

GROUPS = 4
"""Copy groups of a thread's words (each folded as soon as it has landed)."""
KINDS = ("float32", "bfloat16", "float16")
SHARED_PER_SM = 228 * 1024
"""Shared memory of a multiprocessor (sm_90); each block also reserves 1 KB and its scratch."""
BLOCK_OVERHEAD = 1536


def enabled(kind: str, split: bool, vector: bool, same_dtype: bool) -> bool:
    """Whether a row that the register plan ``split``s can take a staged kernel."""
    return split and vector and same_dtype and kind in KINDS


def groups(slots: int) -> int:
    """Copy groups of a thread's ``slots`` words: :data:`GROUPS`, at most 16, a divisor of
    ``slots``."""
    g = max(1, min(GROUPS, 16, slots))
    while slots % g:
        g -= 1
    return g


def shared_bytes(threads: int, slots: int) -> int:
    """Dynamic shared memory of a block staging ``threads * slots`` words."""
    return threads * slots * WORD_BYTES


def _fit(threads: int, slots: int) -> tuple[int, int]:
    """``(blocks per multiprocessor, values)``: the blocks that shared memory and threads
    allow on sm_90, and the values per thread that set the kernel's register budget
    (:func:`.primitives.register_cap`: 40, 56 or 80 registers, as many as those blocks leave;
    the fallback of the summary exchange keeps many values live)."""
    smem = shared_bytes(threads, slots) + BLOCK_OVERHEAD
    blocks = max(1, min(SHARED_PER_SM // smem, 2048 // threads))
    values = 8 if blocks * threads > 1024 else 16 if blocks * threads > 768 else 32
    return min(blocks, 65536 // (threads * register_cap(threads, values))), values


def blocks_per_sm(threads: int, slots: int) -> int:
    """Blocks of a staged kernel that fit on one multiprocessor."""
    return _fit(threads, slots)[0]


@functools.cache
def _raise_max():
    """Device function ``raise_max(m, s, mn) -> (m, s)``: a running (max, sum) whose maximum
    rises to ``mn`` (a copy group's maximum merged in), the sum rescaled (0 while the maximum
    was -inf); a NaN or +inf ``mn`` makes the row special and leaves the sum unused."""
    exp = exponential("float32")
    neg_inf, zero = float32(NEG_INF), float32(0.0)

    def raise_max(m, s, mn):
        if mn != mn or mn == POS_INF:
            m = mn
        elif mn > m:
            s = s * exp(m - mn) if m > neg_inf else zero
            m = mn
        return m, s

    return device_function(raise_max)


@functools.cache
def _stage(kind: str, threads: int, slots: int, has_where: bool, count: bool):
    """Device functions on a thread's words ``base + threads * j`` of a chunk, staged at
    ``off`` (in 32-bit words) in shared memory, ``lane`` the thread's index:

    * ``issue(stage, off, xr, nw, base, lane)``: start copying them, in :func:`groups`
      groups of whole words (each closed with a commit);
    * ``land(stage, off, wr, nw, base, lane) -> m_t``: overwrite the excluded values with
      ``-inf`` (with ``where``) and return their maximum; it waits for the groups as it goes
      (the maximum of a group as soon as it has landed);
    * ``sums(stage, off, nw, base, lane, m_t) -> (s_t, included, zsum)``: as
      :func:`.row_kernels._thread_sum` (``included``, ``zsum`` with ``count``);
    * ``land_fold(stage, off, wr, nw, base, lane) -> (m_t, s_t)``: ``land`` and ``sums`` in
      one walk (without ``count``): each group, as it lands, is held in registers, its
      maximum raises the running maximum (the running sum rescaled) and its exponentials
      join the sum, so that after the last group only that group's sum is left to do.
    """
    width, decode, encode = word_codec(kind)
    tmax = thread_max("float32")
    exp = exponential("float32")
    add_terms = word_terms("float32", width, count)
    raise_max = _raise_max()
    n_groups = groups(slots)
    per = slots // n_groups
    neg_inf, zero = float32(NEG_INF), float32(0.0)
    held = per * 4  # 32-bit words of a group of one thread

    def exclude(buf, wr, wi, m):
        """The maximum of ``m`` and word ``wi``'s values in ``buf``, those that ``where``
        excludes set to -inf first."""
        for v in range(width):
            if has_where:
                if not wr[wi * width + v]:
                    buf[v] = neg_inf
            m = tmax(m, buf[v])
        return m

    def restage(stage, q, buf):
        """``buf`` encoded back into the staged word at ``q``; returns its 32-bit words."""
        a, b, c, d = encode(buf, 0)
        stage[q] = a
        stage[q + 1] = b
        stage[q + 2] = c
        stage[q + 3] = d
        return a, b, c, d

    def await_group(g):
        """Wait for the thread's copy group ``g``: with ``where``, for every group before
        the first is read; else group by group, the later ones landing while the earlier
        are read."""
        if has_where:
            if g == 0:
                cp_async_pending(0)
        else:
            cp_async_pending(n_groups - 1 - g)

    exclude = device_function(exclude, inline=True)
    restage = device_function(restage, inline=True)
    await_group = device_function(await_group, inline=True)

    def issue(stage, off, xr, nw, base, lane):
        for g in range(n_groups):
            for j in range(g * per, (g + 1) * per):
                if base + j * threads < nw:
                    cp_async16(stage, off + (lane + j * threads) * 4, xr,
                               (base + j * threads) * width)
            cp_async_commit()

    def land(stage, off, wr, nw, base, lane):
        buf = cuda.local.array(width, float32)
        m = neg_inf
        for g in range(n_groups):
            await_group(g)
            for j in range(g * per, (g + 1) * per):
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    m = exclude(buf, wr, wi, m)
                    if has_where:
                        restage(stage, q, buf)
        return m

    def sums(stage, off, nw, base, lane, m_t):
        buf = cuda.local.array(width, float32)
        s = zero
        c = zero
        z = zero
        if m_t > neg_inf and m_t < POS_INF:
            for j in range(slots):
                if base + j * threads < nw:
                    q = off + (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    s, c, z = add_terms(buf, m_t, s, c, z)
        return s, c, z

    def land_fold(stage, off, wr, nw, base, lane):
        buf = cuda.local.array(width, float32)
        words = cuda.local.array(held, uint32)
        m = neg_inf
        s = zero
        for g in range(n_groups):
            await_group(g)
            gm = neg_inf
            for i in range(per):
                j = g * per + i
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
                    words[4 * i] = stage[q]
                    words[4 * i + 1] = stage[q + 1]
                    words[4 * i + 2] = stage[q + 2]
                    words[4 * i + 3] = stage[q + 3]
                    decode(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3],
                           buf, 0)
                    gm = exclude(buf, wr, wi, gm)
                    if has_where:
                        a, b, c, d = restage(stage, q, buf)
                        words[4 * i] = a
                        words[4 * i + 1] = b
                        words[4 * i + 2] = c
                        words[4 * i + 3] = d
            mn = tmax(m, gm)
            m, s = raise_max(m, s, mn)
            if m > neg_inf and m < POS_INF:
                for i in range(per):
                    if base + (g * per + i) * threads < nw:
                        decode(words[4 * i], words[4 * i + 1], words[4 * i + 2],
                               words[4 * i + 3], buf, 0)
                        for v in range(width):
                            s += exp(buf[v] - m)
        return m, s

    return (device_function(issue), device_function(land), device_function(sums),
            device_function(land_fold))


@functools.cache
def _row_state(op: str):
    """Device function ``row_state(m, s, m_t, masked_nan) -> (nan_row, inf_row, empty, log_s,
    f, regular)`` for a row of summary ``(m, s)`` and a thread of maximum ``m_t``: the row's
    kind, ``log s`` (0 on special rows), the thread's factor ``f = exp(m_t - m) / s`` (NaN
    where every output is NaN, 0 where every output is 0), and whether the thread's values
    take the usual formula (tested once a word instead of for every value)."""
    is_log = op == "log_softmax"
    exp = exponential("float32")
    nan, neg_inf, zero, one = float32(NAN), float32(NEG_INF), float32(0.0), float32(1.0)

    def row_state(m, s, m_t, masked_nan):
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        log_s = log_f32(s) if not (nan_row or inf_row or empty) else zero
        f = zero
        if nan_row or inf_row or (masked_nan and empty):
            f = nan
        elif not empty and m_t > neg_inf:
            f = exp(m_t - m) * (one / s)
        if is_log:
            regular = not (nan_row or inf_row or empty)
        else:
            regular = f == f and f != zero
        return nan_row, inf_row, empty, log_s, f, regular

    return device_function(row_state)


@functools.cache
def _word_results(op: str, kind: str):
    """Device function ``results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty,
    masked_nan)``: the outputs of the ``width`` values of one word in ``buf``, in place, by the
    rules of :func:`normalize` (``m`` the row's maximum, ``m_t`` the thread's, ``f =
    exp(m_t - m) / S``, ``regular`` the row's usual case)."""
    is_log = op == "log_softmax"
    width = word_codec(kind)[0]
    exp = exponential("float32")
    nan, neg_inf, zero = float32(NAN), float32(NEG_INF), float32(0.0)

    def results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty, masked_nan):
        for v in range(width):
            x_v = buf[v]
            if regular:
                o = (x_v - m) - log_s if is_log else exp(x_v - m_t) * f
            elif is_log:
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

    return device_function(results)


@functools.cache
def _word_output(op: str, kind: str):
    """Device function ``output(orow, wi, a, b, c, d, buf, regular, m, m_t, f, log_s,
    nan_row, inf_row, empty, masked_nan)``: the outputs of the staged word ``a, b, c, d`` by
    :func:`_word_results` (decoded into ``buf``), stored as word ``wi`` of ``orow``."""
    width, decode, encode = word_codec(kind)
    results = _word_results(op, kind)

    def output(orow, wi, a, b, c, d, buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty,
               masked_nan):
        decode(a, b, c, d, buf, 0)
        results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty, masked_nan)
        a, b, c, d = encode(buf, 0)
        store16(orow, wi * width, a, b, c, d)

    return device_function(output, inline=True)
