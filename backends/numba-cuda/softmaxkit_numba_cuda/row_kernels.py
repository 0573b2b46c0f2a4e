"""Row kernels that read each row once and hold it on chip: softmax, log_softmax, logsumexp
and summaries (cross-entropy, laid out the same way: :mod:`.cross_entropy_kernels`).

Layout (:mod:`.plan`).  A group of ``threads`` threads holds a chunk of ``threads * slots``
words of a row in registers (a word: 16 bytes, or one element).  Short and medium rows are one
chunk: a group per row.  Long rows are split into ``chunks`` chunks, one block each.

One pass over the chunk.  Each thread loads its words (all loads issued before the first
use), takes its own maximum ``m_t`` and sum ``s_t = sum exp(v - m_t)`` (keeping the
exponentials when the outputs need them), and the group merges the pairs ``(m_t, s_t)`` with
the online-softmax rule into the chunk's summary ``(m, s)``.  Excluded positions (``where``
False) and the tail past the row's end enter as ``-inf``, which the maximum ignores and the
exponential sends to zero: nothing is multiplied by zero to exclude it.  Each output is then
``e * exp(m_t - M) / S`` (softmax) or ``(x - M) - log S`` (log_softmax) with the row's
``(M, S)``: one multiply or two adds per element, the chunk never read again.

Long rows: block ``b`` holds chunk ``b % chunks`` of row ``b // chunks`` and publishes the
chunk's summary to a workspace.

* logsumexp, summarize, cross-entropy without gradient: each block counts itself in on a
  per-row counter; the block that arrives last merges the row's summaries and writes the
  result.  No block waits for another.
* softmax, log_softmax, cross-entropy with gradient: every block needs the whole row's
  summary before it writes its chunk from registers (so the row is read once).  A summary is
  one 64-bit slot (two float32; float64 summaries use a flag slot and four more), written
  with a release store and read with acquire loads, so one read both finds and fetches it.
  A block polls its row's slots for at most :data:`WAIT_NS` nanoseconds; a chunk whose
  summary has not appeared by then is summarized by the waiting block itself, from device
  memory, with the same arithmetic in the same order, and published on its owner's behalf.
  No wait is unbounded, so the kernel cannot deadlock whatever the order in which the
  hardware schedules blocks or how many are resident; in the common case the blocks of a row
  run together (consecutive block indices) and each chunk is read once.  Numba's simulator,
  which runs blocks one after another, takes the fallback for the first block of each row.

Special rows (a NaN, a ``+inf``, nothing allowed) follow spec/semantics.md.  The workspaces
(``ws [fields, rows * chunks]`` and counters ``sync [rows]`` for the last-arriving block;
zeroed 64-bit slots ``wsp [slots, rows * chunks]`` for the waiting blocks) are allocated for
each call by the caller.
"""

from __future__ import annotations

import functools
import math

from numba import float32, float64, int32, uint64

from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    bits_from_f32,
    cuda,
    device_function,
    f32_from_bits,
    f64_from_u64,
    group_coordinates,
    kernel,
    logarithm,
    u64_from_f64,
)
from .ptx import globaltimer, load_acquire, load_l2, nanosleep, store_release
from .reductions import (
    SCRATCH,
    exponential,
    group_reducers,
    summary_ops,
    thread_max,
    word_terms,
)
from .storage import storer, word_io

SUMMARY = "summarize"


@functools.cache
def _placement(threads: int, rows_per_block: int, split: bool):
    """Device function ``place(n_rows, chunks) -> (lane, row, chunk, live)``."""
    coordinates = group_coordinates(threads, rows_per_block)

    def place(n_rows, chunks):
        tid = cuda.threadIdx.x
        if split:
            t = cuda.blockIdx.x
            r = t // chunks
            return tid, r, t - r * chunks, True
        lane, row, live = coordinates(n_rows)
        return lane, row, 0, live

    return device_function(place)


@functools.cache
def _chunk_io(kind: str, vector: bool, threads: int, slots: int, has_where: bool):
    """Device functions ``load_chunk(xr, wr, live, nw, base, vals) -> thread maximum`` and
    ``store_chunk(orow, live, nw, base, vals)`` for the words ``base + threads * j``."""
    acc_name, acc = accumulator(kind)
    width, load_word, store_word = word_io(kind, vector)
    values = slots * width
    tmax = thread_max(acc_name)
    neg_inf = acc(NEG_INF)

    def load_chunk(xr, wr, live, nw, base, vals):
        if live and base + (slots - 1) * threads < nw:  # the common case: no bounds checks
            for j in range(slots):
                load_word(xr, base + j * threads, vals, j * width)
        else:
            for j in range(slots):
                wi = base + j * threads
                if live and wi < nw:
                    load_word(xr, wi, vals, j * width)
                else:
                    for v in range(width):
                        vals[j * width + v] = neg_inf
        if has_where:
            for j in range(slots):
                wi = base + j * threads
                if live and wi < nw:
                    for v in range(width):
                        if not wr[wi * width + v]:
                            vals[j * width + v] = neg_inf  # excluded: the max/exp contract
        m = neg_inf
        for k in range(values):
            m = tmax(m, vals[k])
        return m

    def store_chunk(orow, live, nw, base, vals):
        if live and base + (slots - 1) * threads < nw:
            for j in range(slots):
                store_word(orow, base + j * threads, vals, j * width)
        else:
            for j in range(slots):
                wi = base + j * threads
                if live and wi < nw:
                    store_word(orow, wi, vals, j * width)

    return device_function(load_chunk), device_function(store_chunk)


@functools.cache
def _chunk_stream(kind: str, vector: bool, threads: int, slots: int, has_where: bool,
                  count: bool, rolled: bool = False):
    """Device function ``stream_stats(xr, wr, nw, base) -> (m, s, included, zsum)``: what
    ``load_chunk`` and ``thread_sum`` give for the thread's words ``base + threads * j``, the
    same operations in the same order, reading one word at a time (twice) from memory.

    ``rolled``: the loops' trip count is not a compile-time constant, so they are not
    unrolled (a rare path that should not claim registers of the kernel around it)."""
    acc_name, acc = accumulator(kind)
    width, load_word, _ = word_io(kind, vector)
    tmax = thread_max(acc_name)
    add_terms = word_terms(acc_name, width, count)
    neg_inf, zero = acc(NEG_INF), acc(0.0)

    def load_one(xr, wr, nw, wi, buf):
        if wi < nw:
            load_word(xr, wi, buf, 0)
            if has_where:
                for v in range(width):
                    if not wr[wi * width + v]:
                        buf[v] = neg_inf
        else:
            for v in range(width):
                buf[v] = neg_inf

    load_one = device_function(load_one)

    def stream_stats(xr, wr, nw, base):
        buf = cuda.local.array(width, acc)
        m = neg_inf
        n_slots = (slots if nw >= 0 else 0) if rolled else slots
        for j in range(n_slots):
            load_one(xr, wr, nw, base + j * threads, buf)
            for v in range(width):
                m = tmax(m, buf[v])
        s = zero
        c = zero
        z = zero
        if m > neg_inf and m < POS_INF:
            for j in range(n_slots):
                load_one(xr, wr, nw, base + j * threads, buf)
                s, c, z = add_terms(buf, m, s, c, z)
        return m, s, c, z

    return device_function(stream_stats)


@functools.cache
def _thread_sum(acc_name: str, values: int, keep_exp: bool, count: bool, rest: bool = False):
    """Device function ``thread_sum(vals, m) -> (s, included, zsum)``: ``s = sum exp(v - m)``
    over the thread's values (stored back in ``vals`` with ``keep_exp``, zeros when ``m`` is
    not finite); with ``count``, the number of values above ``-inf`` and the sum of their
    ``v - m``.  With ``rest`` (logsumexp, neither of the others), ``s`` is ``t = S - 1``: the
    values at the maximum are counted instead of summed, so a row dominated by one term keeps
    the others' share (spec "logsumexp"); ``-1`` when ``m`` is not finite."""
    acc = float64 if acc_name == "float64" else float32
    exp = exponential(acc_name)
    neg_inf, zero, one = acc(NEG_INF), acc(0.0), acc(1.0)

    if rest:

        def thread_rest(vals, m):
            t = -one
            if m > neg_inf and m < POS_INF:
                tops = zero
                r = zero
                for k in range(values):
                    v = vals[k]
                    e = exp(v - m)
                    if v == m:
                        tops += one
                    else:
                        r += e
                t = r + (tops - one)
            return t, zero, zero

        return device_function(thread_rest)

    def thread_sum(vals, m):
        s = zero
        c = zero
        z = zero
        if m > neg_inf and m < POS_INF:
            for k in range(values):
                v = vals[k]
                d = v - m
                e = exp(d)
                s += e
                if count and v > neg_inf:
                    c += one
                    z += d
                if keep_exp:
                    vals[k] = e
        elif keep_exp:  # nothing allowed here (or the row is special): no exponentials
            for k in range(values):
                vals[k] = zero
        return s, c, z

    return device_function(thread_sum)


@functools.cache
def _last_arriver(threads: int, acc_name: str, fields: int, rest: bool = False):
    """Device functions ``publish``, ``gather`` and ``gather_counts`` for the blocks of a
    split row when the block that arrives last writes the row's result (``rest``: the
    summaries are logsumexp's ``(m, t)``, see :func:`_thread_sum`)."""
    acc = float64 if acc_name == "float64" else float32
    merge = summary_ops(acc_name, rest)[1]
    pair_reduce, sum_reduce, _ = group_reducers(threads, acc_name, rest)
    neg_inf, zero = acc(NEG_INF), acc(0.0)
    empty_s = acc(-1.0) if rest else zero

    def publish(ws, sync, r, c, chunks, m, s, cnt, z, flag):
        """Write the chunk's summary, count the block in; True in every thread of the block
        that arrives last at its row."""
        if cuda.threadIdx.x == 0:
            k = r * chunks + c
            ws[0, k] = m
            ws[1, k] = s
            if fields == 4:
                ws[2, k] = cnt
                ws[3, k] = z
            cuda.threadfence()  # the summary is visible before the count
            flag[0] = int32(cuda.atomic.add(sync, r, 1) == chunks - 1)
        cuda.syncthreads()
        last = flag[0] != 0
        if last:
            cuda.threadfence()
        return last

    def gather(ws, r, chunks, scratch):
        """The row's summary ``(M, S)``, in every thread."""
        m = neg_inf
        s = empty_s
        for k in range(cuda.threadIdx.x, chunks, threads):
            i = r * chunks + k
            m, s = merge(m, s, load_l2(ws[0], i), load_l2(ws[1], i))
        return pair_reduce(m, s, scratch)

    def gather_counts(ws, r, chunks, m, scratch):
        """The row's included count and sum of ``x - M`` over them (``M`` finite)."""
        cnt = zero
        z = zero
        for k in range(cuda.threadIdx.x, chunks, threads):
            i = r * chunks + k
            ck = load_l2(ws[2], i)
            if ck > zero:
                cnt += ck
                z += load_l2(ws[3], i) + ck * (load_l2(ws[0], i) - m)
        return sum_reduce(cnt, scratch), sum_reduce(z, scratch)

    return device_function(publish), device_function(gather), device_function(gather_counts)


WAIT_NS = 20_000
"""How long a block polls for another block's chunk summary before computing it itself."""
SPIN_POLLS = 4
"""Polls (one L2 round trip each) before the first pause."""
POLL_NS = 32
MAX_POLL_NS = 512
SLOT_FIELDS = {"float32": 2, "float64": 5}
"""64-bit slots per chunk summary: ``(max, sum)`` and ``(count, zsum)`` packed as float32
pairs; or a flag and four float64 bit patterns."""


@functools.cache
def _slots(acc_name: str, fields: int):
    """Device functions ``publish(wsp, k, m, s, cnt, z)`` (one thread),
    ``peek(wsp, k) -> (published, m, s)`` and ``counts(wsp, k) -> (cnt, z)`` (after a peek
    that found the summary) on the 64-bit slots of chunk ``k``."""
    acc = float64 if acc_name == "float64" else float32
    nan = acc(NAN)
    low = uint64(0xFFFFFFFF)
    shift = uint64(32)

    if acc_name == "float32":

        def pack(a, b):
            return uint64(bits_from_f32(a)) | (uint64(bits_from_f32(b)) << shift)

        def unpack(w):
            return f32_from_bits(w & low), f32_from_bits(w >> shift)

        pack = device_function(pack)
        unpack = device_function(unpack)

        def publish(wsp, k, m, s, cnt, z):
            if fields == 4:
                wsp[1, k] = pack(cnt, z)
            store_release(wsp[0], k, pack(m, s))  # never 0: a finite max has a sum >= 1

        def peek(wsp, k):
            w = load_acquire(wsp[0], k)
            m, s = unpack(w)
            return w != uint64(0), m, s

        def counts(wsp, k):
            return unpack(load_l2(wsp[1], k))

    else:

        def publish(wsp, k, m, s, cnt, z):
            wsp[1, k] = u64_from_f64(m)
            wsp[2, k] = u64_from_f64(s)
            if fields == 4:
                wsp[3, k] = u64_from_f64(cnt)
                wsp[4, k] = u64_from_f64(z)
            store_release(wsp[0], k, uint64(1))

        def peek(wsp, k):
            if load_acquire(wsp[0], k) == uint64(0):
                return False, nan, nan
            return (True, f64_from_u64(load_l2(wsp[1], k)),
                    f64_from_u64(load_l2(wsp[2], k)))

        def counts(wsp, k):
            return f64_from_u64(load_l2(wsp[3], k)), f64_from_u64(load_l2(wsp[4], k))

    return device_function(publish), device_function(peek), device_function(counts)


@functools.cache
def _await_slot(acc_name: str, fields: int):
    """Device function ``await_slot(wsp, k) -> (published, m, s)``: :func:`_slots`' ``peek``
    of slot ``k``, repeated while it is unpublished for at most :data:`WAIT_NS` (a few polls,
    then pauses doubling up to :data:`MAX_POLL_NS`)."""
    peek = _slots(acc_name, fields)[1]
    wait = uint64(WAIT_NS)

    def await_slot(wsp, k):
        ok, m, s = peek(wsp, k)
        if not ok:
            start = globaltimer()
            polls = 0
            pause = POLL_NS
            while not ok and globaltimer() - start < wait:
                polls += 1
                if polls > SPIN_POLLS:  # then back off: fewer L2 requests
                    nanosleep(pause)
                    pause = min(2 * pause, MAX_POLL_NS)
                ok, m, s = peek(wsp, k)
        return ok, m, s

    return device_function(await_slot)


@functools.cache
def _row_summary(kind: str, vector: bool, threads: int, slots: int, has_where: bool,
                 fields: int, rolled: bool = False):
    """Device function ``collect(wsp, xr, wr, nw, r, chunks, scratch, flag) -> (M, S, count,
    zsum)``: the whole row's summary for a block of a split row that has published its own
    chunk's (see the module docstring: bounded polling, then the missing chunks computed
    here).  ``count`` and ``zsum`` are the included positions and their ``sum(x - M)``
    (with ``fields == 4``, and ``M`` finite)."""
    acc_name, acc = accumulator(kind)
    counting = fields == 4
    publish, peek, counts = _slots(acc_name, fields)
    await_slot = _await_slot(acc_name, fields)
    stream_stats = _chunk_stream(kind, vector, threads, slots, has_where, counting, rolled)
    merge = summary_ops(acc_name)[1]
    pair_reduce, sum_reduce, _ = group_reducers(threads, acc_name)
    neg_inf, zero = acc(NEG_INF), acc(0.0)

    def shifted(cnt, z, m_part, m):
        return z + cnt * (m_part - m) if cnt > zero else zero

    shifted = device_function(shifted)

    def collect(wsp, xr, wr, nw, r, chunks, scratch, flag):
        tid = cuda.threadIdx.x
        m = neg_inf
        s = zero
        missing = 0
        for k in range(tid, chunks, threads):
            ok, mk, sk = await_slot(wsp, r * chunks + k)
            if ok:
                m, s = merge(m, s, mk, sk)
            else:
                missing = 1
        if cuda.syncthreads_or(int32(missing)):
            # rare: summarize the chunks whose blocks have not published, publish for them
            for k in range(chunks):
                if tid == 0:
                    ok, _, _ = peek(wsp, r * chunks + k)
                    flag[0] = int32(0 if ok else 1)
                cuda.syncthreads()
                if flag[0] != 0:
                    mt, st, ct, zt = stream_stats(xr, wr, nw, k * (threads * slots) + tid)
                    mk, sk = pair_reduce(mt, st, scratch)
                    ck = zero
                    zk = zero
                    if counting:
                        ck = sum_reduce(ct, scratch)
                        zk = sum_reduce(shifted(ct, zt, mt, mk), scratch)
                    if tid == 0:
                        publish(wsp, r * chunks + k, mk, sk, ck, zk)
                cuda.syncthreads()
            m = neg_inf
            s = zero
            for k in range(tid, chunks, threads):
                _, mk, sk = peek(wsp, r * chunks + k)
                m, s = merge(m, s, mk, sk)
        m, s = pair_reduce(m, s, scratch)
        cnt = zero
        z = zero
        if counting and m > neg_inf and m < POS_INF:
            for k in range(tid, chunks, threads):
                _, mk, _ = peek(wsp, r * chunks + k)
                ck, zk = counts(wsp, r * chunks + k)
                cnt += ck
                z += shifted(ck, zk, mk, m)
            cnt = sum_reduce(cnt, scratch)
            z = sum_reduce(z, scratch)
        return m, s, cnt, z

    return device_function(collect)


def _values(kind: str, vector: bool, slots: int) -> int:
    return slots * word_io(kind, vector)[0]


@functools.cache
def normalize(op: str, kin: str, kout: str, vector: bool, threads: int, slots: int,
              rows_per_block: int, split: bool, has_where: bool):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp)`` for softmax or log_softmax
    over ``[rows, N]`` element arrays; ``nw`` is the row length in words."""
    acc_name, acc = accumulator(kin)
    is_log = op == "log_softmax"
    values = _values(kin, vector, slots)
    load_chunk, _ = _chunk_io(kin, vector, threads, slots, has_where)
    _, store_chunk = _chunk_io(kout, vector, threads, slots, False)
    thread_sum = _thread_sum(acc_name, values, not is_log, False)
    pair_reduce = group_reducers(threads, acc_name)[0]
    publish = _slots(acc_name, 2)[0]
    collect = _row_summary(kin, vector, threads, slots, has_where, 2)
    place = _placement(threads, rows_per_block, split)
    exp = exponential(acc_name)
    log = logarithm(acc_name)
    nan, neg_inf, zero, one = acc(NAN), acc(NEG_INF), acc(0.0), acc(1.0)

    @kernel(threads * rows_per_block, values, acc_name == "float64")
    def row_kernel(x, w, masked_nan, out, n_rows, nw, chunks, wsp):
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, acc)
        lane, r, c, live = place(n_rows, chunks)
        base = c * (threads * slots) + lane
        wr = w[r if has_where else 0]
        vals = cuda.local.array(values, acc)
        m_t = load_chunk(x[r], wr, live, nw, base, vals)
        s_t, _, _ = thread_sum(vals, m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        if split:
            if lane == 0:
                publish(wsp, r * chunks + c, m, s, zero, zero)
            m, s, _, _ = collect(wsp, x[r], wr, nw, r, chunks, scratch, flag)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        if is_log:
            if nan_row or (masked_nan and empty):
                for k in range(values):
                    vals[k] = nan
            elif inf_row:
                for k in range(values):
                    vals[k] = nan if vals[k] == POS_INF else neg_inf
            elif not empty:  # an empty row's values are -inf already
                log_s = log(s)
                for k in range(values):
                    vals[k] = (vals[k] - m) - log_s
        else:
            if nan_row or inf_row or (masked_nan and empty):
                f = nan
            elif empty or m_t == neg_inf:
                f = zero
            else:
                f = exp(m_t - m) * (one / s)
            for k in range(values):
                vals[k] = vals[k] * f  # f is NaN for a NaN or +inf row
        store_chunk(out[r], live, nw, base, vals)

    return row_kernel


@functools.cache
def reduce(op: str, kin: str, kout: str, vector: bool, threads: int, slots: int,
           rows_per_block: int, split: bool, has_where: bool):
    """Kernel ``(x, w, out, sign, return_sign, n_rows, nw, chunks, ws, sync)``.

    ``op == "logsumexp"``: ``out`` (``[rows, 1]`` of ``kout``) receives ``M + log S`` and
    ``sign`` its sign.  ``op == "summarize"``: ``out`` and ``sign`` (``[rows, 1]`` in the
    accumulator dtype) receive the row's maximum and mass (spec "Summaries").
    """
    acc_name, acc = accumulator(kin)
    values = _values(kin, vector, slots)
    load_chunk, _ = _chunk_io(kin, vector, threads, slots, has_where)
    # logsumexp carries t = S - 1 and finishes with log1p (spec "logsumexp")
    rest = op != SUMMARY
    thread_sum = _thread_sum(acc_name, values, False, False, rest)
    pair_reduce = group_reducers(threads, acc_name, rest)[0]
    publish, gather, _ = _last_arriver(threads, acc_name, 2, rest)
    place = _placement(threads, rows_per_block, split)
    store = storer(acc_name if op == SUMMARY else kout)
    summary = op == SUMMARY
    nan, neg_inf, pos_inf, zero, one = (acc(v) for v in (NAN, NEG_INF, POS_INF, 0.0, 1.0))

    @kernel(threads * rows_per_block, values, acc_name == "float64")
    def row_kernel(x, w, out, sign, return_sign, n_rows, nw, chunks, ws, sync):
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, acc)
        lane, r, c, live = place(n_rows, chunks)
        vals = cuda.local.array(values, acc)
        m_t = load_chunk(x[r], w[r if has_where else 0], live, nw, c * (threads * slots) + lane,
                         vals)
        s_t, _, _ = thread_sum(vals, m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        if split:
            if not publish(ws, sync, r, c, chunks, m, s, zero, zero, flag):
                return
            m, s = gather(ws, r, chunks, scratch)
        if live and lane == 0:
            if summary:
                if m != m or m == POS_INF:
                    s = nan
                elif m == neg_inf:
                    s = zero
                store(out[r], 0, m)
                store(sign[r], 0, s)
            else:
                if m != m:
                    res, sg = nan, nan
                elif m == POS_INF:
                    res, sg = pos_inf, one
                elif m == neg_inf:
                    res, sg = neg_inf, zero
                else:
                    res, sg = m + math.log1p(s), one
                store(out[r], 0, res)
                if return_sign:
                    store(sign[r], 0, sg)

    return row_kernel
