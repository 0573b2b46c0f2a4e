"""Long rows staged in shared memory: softmax, log_softmax and cross-entropy with its gradient.

A row longer than a block holds in registers is cut into the fewest equal chunks that fit a
stage of shared memory (:func:`.plan.staged`; one chunk when the row fits) and each chunk is
copied to a stage with ``cp.async``, which never passes through registers: a block needs few
registers (one word's values at a time) and several blocks fit on a multiprocessor.  A block
takes one chunk: block ``t`` holds chunk ``t % chunks`` of row ``t // chunks``.  A thread
copies its words in :data:`GROUPS` groups and folds each group, as it lands, into its running
(max, sum): the group's words are held in registers, its maximum raises the running maximum
(the sum rescaled) and its exponentials join the sum, so no second pass over the stage is left
once the last group has landed.  Excluded values (``where`` False) are overwritten with
``-inf`` in the stage first.  The block merges its threads' pairs; the blocks of a split row
exchange their summaries as in :mod:`.rowkernels` (a bounded wait, then the missing chunks
summarized from device memory with the same arithmetic in the same order).  Outputs are
written from the staged words.  Each thread reads back only the words it copied, so no
barrier is needed between a copy and its reads.

Thread-block clusters (sm_90): a row of 2 to 8 chunks (:func:`.plan.clustered`) is launched
as one cluster of one block per chunk (:func:`.arrays.run`; the cluster's index is the row,
the block's rank in it the chunk).  The blocks exchange their summaries through distributed
shared memory instead of the slots in device memory: each block writes its (max, sum) to its
shared memory, the cluster barrier (arrive.release / wait.acquire) publishes them, each block
reads its peers' with ``ld.shared::cluster`` and merges, arrives again, and waits on that
barrier before it exits, so that no block's shared memory goes while a peer may read it.  The
cluster's blocks are co-scheduled by the hardware, so no wait is unbounded and no fallback is
needed.

Persistent clusters (sm_90): rows of 9 to 32 chunks (:func:`.plan.persistent`) take
:func:`persistent`, a grid of the clusters that fit at once, each walking rows: one cluster of
up to 16 blocks a row, or two clusters a row, each an equal part of the chunks, that exchange
their parts' summaries through slots in device memory.  Each block refills every staged word
with the next row's word as soon as it has read it back for its store, so the next row's
copies are in flight while the current row is written; one cluster barrier a row publishes the
warps' (max, sum) pairs, which every warp merges itself.  Rows whose chunks are all full and
without ``where`` take a lean fold (16-byte shared loads, the group maximum on packed 16-bit
pairs) and write 16-bit softmax as ``2^((x - M) log2 e - log2 S)``.  Float32 rows of whole
128 KB chunks keep :data:`HELD` words a thread in registers and stage the rest, two blocks a
multiprocessor, so that a row of 2^19 float32 values is one cluster of 16.  The grid's groups
of clusters that walk one row fewer than the others start late (:func:`stagger`), so that
the groups' fold-and-exchange pauses fall at different times.

What CI does not run: Numba's CUDA simulator runs the blocks of a grid one after another, so a
barrier across the blocks of a cluster (or a read of another block's shared memory) cannot
run there.  The simulator runs the cluster kernels as clusters of one block (the setting
``cluster="all"`` on rows of one chunk): the same kernel code, exchange and barriers
included, on the block itself; the exchange between several blocks, the launch with cluster
dimensions and non-portable cluster sizes are checked on the GPU only
(``tools/gpu_check.py``, against float64 with poisoned outputs).  The persistent kernel runs
there as clusters of one block (``persist="all"``): two clusters walking several rows each,
and rows of two chunks as two clusters exchanging through device memory, where the
one-block-at-a-time schedule takes the fallback that summarizes the parts not yet published.

Staged kernels serve rows that the register plan splits, read in 16-byte words (float32,
bfloat16, float16, the same dtype in and out).
"""

from __future__ import annotations

import functools

from numba import float32, int32, uint32, uint64

from .intrinsics import (
    LOG2E,
    NAN,
    NEG_INF,
    POS_INF,
    bits_from_f32,
    cuda,
    device_function,
    f32_from_bits,
    kernel,
    log_f32,
    register_cap,
)
from .plan import WORD_BYTES
from .reductions import SCRATCH, exponential, group_reducers, summary_ops, thread_max
from .rowkernels import (
    MAX_POLL_NS,
    POLL_NS,
    SPIN_POLLS,
    WAIT_NS,
    _chunk_stream,
    _row_summary,
    _slots,
)
from .storage import loader, storer, word_codec
from .wide import (
    cluster_arrive,
    cluster_id,
    cluster_load,
    cluster_rank,
    cluster_wait,
    cp_async16,
    cp_async_commit,
    cp_async_pending,
    ex2,
    globaltimer,
    load16,
    load_l2,
    load_shared16,
    max_bf16x2,
    max_f16x2,
    max_nan,
    nanosleep,
    opaque,
    store16,
    unpack_f16,
)

GROUPS = 4
"""Copy groups of a thread's words (each folded as soon as it has landed)."""
POLICY = 2
"""The ``CUclusterSchedulingPolicy`` of the persistent kernel's clusters: load balancing."""
STAGGER = 1.0
"""How late, as a fraction of the time a wave of rows takes at the device's peak bandwidth,
the last of the persistent grid's groups of clusters that walk one row fewer starts."""
HELD = {"float32": 4, "bfloat16": 0, "float16": 0}
"""Words a thread of the persistent kernel keeps in registers beside those staged, by dtype
(:func:`.plan.held`: chunks twice as long, a row one cluster, for rows of whole such chunks
without ``where``); 16-bit rows are one cluster already."""
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


def stagger(n_rows: int, groups: int, row_bytes: int, bandwidth: float) -> int:
    """Nanoseconds between the starts of consecutive groups of clusters of a persistent grid of
    ``groups`` groups (a row each at a time) walking ``n_rows`` rows of ``row_bytes`` bytes
    read and as many written, on a device of peak ``bandwidth`` bytes per second: only the
    groups that walk one row fewer start late (up to :data:`STAGGER` of a wave), so no group
    ends later."""
    rem = n_rows % groups
    if n_rows < groups or rem == 0:
        return 0
    wave_ns = 2 * row_bytes * groups / bandwidth * 1e9
    return int(STAGGER * wave_ns / (groups - rem))


def shared_bytes(threads: int, slots: int) -> int:
    """Dynamic shared memory of a block staging ``threads * slots`` words."""
    return threads * slots * WORD_BYTES


def _fit(threads: int, slots: int) -> tuple[int, int]:
    """``(blocks per multiprocessor, values)``: the blocks that shared memory and threads
    allow on sm_90, and the values per thread that set the kernel's register budget
    (:func:`.intrinsics.register_cap`: 40, 56 or 80 registers, as many as those blocks leave;
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
      :func:`.rowkernels._thread_sum` (``included``, ``zsum`` with ``count``);
    * ``land_fold(stage, off, wr, nw, base, lane) -> (m_t, s_t)``: ``land`` and ``sums`` in
      one walk (without ``count``): each group, as it lands, is held in registers, its
      maximum raises the running maximum (the running sum rescaled) and its exponentials
      join the sum, so that after the last group only that group's sum is left to do.
    """
    width, decode, encode = word_codec(kind)
    tmax = thread_max("float32")
    exp = exponential("float32")
    raise_max = _raise_max()
    n_groups = groups(slots)
    per = slots // n_groups
    neg_inf, zero, one = float32(NEG_INF), float32(0.0), float32(1.0)
    held = per * 4  # 32-bit words of a group of one thread

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
        if has_where:
            cp_async_pending(0)
        for g in range(n_groups):
            if not has_where:
                cp_async_pending(n_groups - 1 - g)
            for j in range(g * per, (g + 1) * per):
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    for v in range(width):
                        if has_where:
                            if not wr[wi * width + v]:
                                buf[v] = neg_inf
                        m = tmax(m, buf[v])
                    if has_where:
                        a, b, c, d = encode(buf, 0)
                        stage[q] = a
                        stage[q + 1] = b
                        stage[q + 2] = c
                        stage[q + 3] = d
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
                    for v in range(width):
                        d = buf[v] - m_t
                        s += exp(d)
                        if count and buf[v] > neg_inf:
                            c += one
                            z += d
        return s, c, z

    def land_fold(stage, off, wr, nw, base, lane):
        buf = cuda.local.array(width, float32)
        words = cuda.local.array(held, uint32)
        m = neg_inf
        s = zero
        if has_where:
            cp_async_pending(0)
        for g in range(n_groups):
            if not has_where:
                cp_async_pending(n_groups - 1 - g)
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
                    for v in range(width):
                        if has_where:
                            if not wr[wi * width + v]:
                                buf[v] = neg_inf
                        gm = tmax(gm, buf[v])
                    if has_where:
                        a, b, c, d = encode(buf, 0)
                        stage[q] = a
                        stage[q + 1] = b
                        stage[q + 2] = c
                        stage[q + 3] = d
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
def _cluster_exchange(threads: int, fields: int):
    """Device function ``exchange(m, s, cnt, z, summary, scratch, chunks) -> (M, S, count,
    zsum)``: the row's summary from the block summaries of the ``chunks`` blocks of its
    cluster (rank ``k`` holding chunk ``k``), read from each block's ``summary`` (a shared
    float32 array of ``fields`` values) through distributed shared memory.  ``count`` and
    ``zsum`` are merged as :func:`.rowkernels._row_summary` merges them (``fields == 4``).

    Every thread of every block of the cluster calls it once.  Each warp reads the
    ``chunks`` summaries (at most 32) and merges them by shuffles, the same steps in every
    warp: no block barrier.  It arrives at the cluster barrier a second time after its
    reads; the kernel waits on that barrier before it exits, so no block's shared memory
    goes away while a peer may still read it.
    """
    counting = fields == 4
    pair_reduce, sum_reduce, _ = group_reducers(min(32, threads), "float32")
    neg_inf, zero = float32(NEG_INF), float32(0.0)

    def exchange(m, s, cnt, z, summary, scratch, chunks):
        lane = cuda.threadIdx.x
        if lane == 0:
            summary[0] = m
            summary[1] = s
            if counting:
                summary[2] = cnt
                summary[3] = z
        cluster_arrive()
        cluster_wait()  # every block's summary is written
        mk = neg_inf
        sk = zero
        ck = zero
        zk = zero
        k = lane % 32
        if k < chunks:
            mk = cluster_load(summary, 0, k)
            sk = cluster_load(summary, 1, k)
            if counting:
                ck = cluster_load(summary, 2, k)
                zk = cluster_load(summary, 3, k)
        cluster_arrive()  # this block's reads of its peers are done (release)
        m, s = pair_reduce(mk, sk, scratch)
        cnt = zero
        z = zero
        if counting and m > neg_inf and m < POS_INF:
            cnt = sum_reduce(ck, scratch)
            z = sum_reduce(zk + ck * (mk - m) if ck > zero else zero, scratch)
        return m, s, cnt, z

    return device_function(exchange)


@functools.cache
def normalize(op: str, kind: str, threads: int, slots: int, has_where: bool,
              cluster: bool = False):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp)`` (the signature of
    :func:`.rowkernels.normalize`): chunks of ``threads * slots`` words, a block of
    ``threads`` each (:func:`shared_bytes` of dynamic shared memory), each thread folding its
    copy groups into a running (max, sum) as they land (``land_fold`` of :func:`_stage`).

    With ``cluster``, the ``chunks`` blocks of a row are one thread-block cluster (launched
    with clusters of ``chunks`` blocks, :func:`.arrays.run`) and exchange their summaries
    through distributed shared memory (:func:`_cluster_exchange`); ``wsp`` is unused.
    """
    width, decode, encode = word_codec(kind)
    words = threads * slots
    issue, _, _, land_fold = _stage(kind, threads, slots, has_where, False)
    exchange = _cluster_exchange(threads, 2)
    results = _word_results(op, kind)
    row_state = _row_state(op)
    pair_reduce = group_reducers(threads, "float32")[0]
    publish = _slots("float32", 2)[0]
    collect = _row_summary(kind, True, threads, slots, has_where, 2, True)
    zero = float32(0.0)

    @kernel(threads, _fit(threads, slots)[1])
    def row_kernel(x, w, masked_nan, out, n_rows, nw, chunks, wsp):
        stage = cuda.shared.array(0, uint32)
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, float32)
        summary = cuda.shared.array(2, float32)
        lane = cuda.threadIdx.x
        total = n_rows * chunks
        buf = cuda.local.array(width, float32)
        t = cuda.blockIdx.x
        while t < total:
            if cluster:  # the cluster is the row, the rank its chunk (no division)
                r = cluster_id()
                c = cluster_rank()
            else:
                r = t // chunks
                c = t - r * chunks
            off = 0
            issue(stage, 0, x[r], nw, c * words + lane, lane)  # land_fold waits
            xr = x[r]
            wr = w[r if has_where else 0]
            orow = out[r]
            base = c * words + lane
            m_t, s_t = land_fold(stage, off, wr, nw, base, lane)
            m, s = pair_reduce(m_t, s_t, scratch)
            if cluster:  # the row's summary from the other blocks of the cluster
                m, s, _, _ = exchange(m, s, zero, zero, summary, scratch, chunks)
            elif chunks > 1:  # the row's summary from its other blocks
                if lane == 0:
                    publish(wsp, r * chunks + c, m, s, zero, zero)
                m, s, _, _ = collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
            nan_row, inf_row, empty, log_s, f, regular = row_state(m, s, m_t, masked_nan)
            for j in range(slots):
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty,
                            masked_nan)
                    a, b, c2, d = encode(buf, 0)
                    store16(orow, wi * width, a, b, c2, d)
            break  # one chunk per block
        if cluster:  # leave once every peer has read this block's summary
            cluster_wait()

    return row_kernel


@functools.cache
def cross_entropy(kind: str, threads: int, slots: int, has_where: bool, smooth: bool,
                  cluster: bool = False):
    """Kernel ``(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
    smoothing, has_ignore, ignore)`` (the signature of :func:`.rowkernels.cross_entropy`) with
    the fused gradient, laid out as :func:`normalize`.

    The loss and the gradient are those of the register kernel: ``grad = scale *
    (softmax(x) - y)`` written from the staged words with ``y`` the smoothing share only, then
    the thread that owns the target position rewrites that one element; the block of the
    row's first chunk writes the loss.  ``ws`` and ``sync`` are unused.  ``cluster`` as in
    :func:`normalize` (then ``wsp`` is unused too).
    """
    width, decode, encode = word_codec(kind)
    words = threads * slots
    fields = 4 if smooth else 2
    issue, land, sums, _ = _stage(kind, threads, slots, has_where, smooth)
    exchange = _cluster_exchange(threads, fields)
    exp = exponential("float32")
    pair_reduce, sum_reduce, _ = group_reducers(threads, "float32")
    publish = _slots("float32", fields)[0]
    collect = _row_summary(kind, True, threads, slots, has_where, fields, True)
    load_one = loader(kind, "float32")
    store = storer(kind)
    store_loss = storer("float32")
    nan, neg_inf, zero, one = float32(NAN), float32(NEG_INF), float32(0.0), float32(1.0)

    @kernel(threads, _fit(threads, slots)[1])
    def row_kernel(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
                   smoothing, has_ignore, ignore):
        stage = cuda.shared.array(0, uint32)
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, float32)
        summary = cuda.shared.array(4, float32)
        lane = cuda.threadIdx.x
        total = n_rows * chunks
        eps = float32(smoothing)
        n = nw * width
        g_scale = scale[0]
        buf = cuda.local.array(width, float32)
        t = cuda.blockIdx.x
        while t < total:
            if cluster:  # the cluster is the row, the rank its chunk (no division)
                r = cluster_id()
                c = cluster_rank()
            else:
                r = t // chunks
                c = t - r * chunks
            off = 0
            issue(stage, 0, x[r], nw, c * words + lane, lane)  # land waits
            xr = x[r]
            wr = w[r if has_where else 0]
            grow = grad[r]
            base = c * words + lane
            m_t = land(stage, off, wr, nw, base, lane)
            s_t, c_t, z_t = sums(stage, off, nw, base, lane, m_t)
            m, s = pair_reduce(m_t, s_t, scratch)
            cnt = zero
            zsum = zero
            if smooth:
                cnt = sum_reduce(c_t, scratch)
                zsum = sum_reduce(z_t + c_t * (m_t - m) if c_t > zero else zero, scratch)
            if cluster:
                m, s, cnt, zsum = exchange(m, s, cnt, zsum, summary, scratch, chunks)
            elif chunks > 1:
                if lane == 0:
                    publish(wsp, r * chunks + c, m, s, cnt, zsum)
                m, s, cnt, zsum = collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
            target = index[r]
            valid = not has_ignore or target != ignore
            special = m != m or m == POS_INF
            normal = not special and m > neg_inf
            log_s = log_f32(s) if normal else zero
            inv = one / s if normal else zero
            share = eps / cnt if cnt > zero else eps
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
            for j in range(slots):
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
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
                            o = ((exp(x_v - m) * inv - share) * g_scale if x_v > neg_inf
                                 else zero)
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
                    total_loss = zero
                    if eps != one:
                        total_loss += (one - eps) * (z - log_s)
                    if smooth and cnt > zero:
                        total_loss += share * (zsum - cnt * log_s)
                    res = zero - total_loss
                store_loss(loss[r], 0, res)
            break  # one chunk per block
        if cluster:  # leave once every peer has read this block's summary
            cluster_wait()

    return row_kernel


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
def _whole_fold(kind: str, threads: int, slots: int):
    """Device function ``fold(stage, lane) -> (m_t, s_t)``: ``land_fold`` of :func:`_stage`
    for a thread whose words are all in the row and all allowed (no ``where``), with fewer
    instructions a value: each word read from the stage in one 16-byte load, the group's
    maximum taken on the packed words (two 16-bit values an instruction), no range tests."""
    width, decode, _ = word_codec(kind)
    n_groups = groups(slots)
    per = slots // n_groups
    exp = exponential("float32")
    raise_max = _raise_max()
    packed = width == 8
    bf16 = kind == "bfloat16"
    pmax = max_bf16x2 if bf16 else max_f16x2
    lowest = uint32(0xFF80FF80 if bf16 else 0xFC00FC00)  # -inf in both halves
    neg_inf, zero = float32(NEG_INF), float32(0.0)
    held = per * 4

    def fold(stage, lane):
        words = cuda.local.array(held, uint32)
        buf = cuda.local.array(width, float32)
        m = neg_inf
        s = zero
        for g in range(n_groups):
            cp_async_pending(n_groups - 1 - g)
            pm = lowest
            gm = neg_inf
            for i in range(per):
                a, b, c, d = load_shared16(stage, (lane + (g * per + i) * threads) * 4)
                words[4 * i] = a
                words[4 * i + 1] = b
                words[4 * i + 2] = c
                words[4 * i + 3] = d
                if packed:
                    pm = pmax(pm, pmax(pmax(a, b), pmax(c, d)))
                else:
                    gm = max_nan(gm, max_nan(max_nan(f32_from_bits(a), f32_from_bits(b)),
                                             max_nan(f32_from_bits(c), f32_from_bits(d))))
            if packed:
                if bf16:
                    lo = f32_from_bits(pm << 16)
                    hi = f32_from_bits(pm & 0xFFFF0000)
                else:
                    lo, hi = unpack_f16(pm)
                gm = max_nan(lo, hi)
            mn = max_nan(m, gm)
            m, s = raise_max(m, s, mn)
            if m > neg_inf and m < POS_INF:
                for i in range(per):
                    decode(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3],
                           buf, 0)
                    for v in range(width):
                        s += exp(buf[v] - m)
        return m, s

    return device_function(fold)


@functools.cache
def _part_exchange(kind: str, threads: int, part_slots: int, has_where: bool, parts: int):
    """Device function ``exchange(wsp, r, h, m, s, xr, wr, nw, scratch, flag) -> (M, S)``: the
    row's summary for a block of the cluster that holds part ``h`` of row ``r`` (``(m, s)``
    that part's summary, ``part_slots`` words a thread of the part), the other ``parts - 1``
    parts held by other clusters.

    Thread 0 of each block claims the part's 64-bit slot ``parts r + h`` in device memory with
    a compare-and-swap from zero and keeps what the slot holds after it (every block of the
    cluster has merged the same pairs in the same order, so the first claim publishes the
    part's summary for all), then polls the other parts' slots (relaxed loads: a 64-bit slot
    is the whole message) for at most :data:`.rowkernels.WAIT_NS` in all.  A part still
    missing then (its cluster not resident) is summarized by the block itself from device
    memory and claimed the same way.  The parts reach the block's threads through shared
    memory and every thread merges them in slot order, so every block of the row gets the same
    summary.  Every thread of the block calls it; ``scratch[48:48 + 2 parts]`` carries the
    parts.
    """
    if not 2 <= parts <= (SCRATCH - 48) // 2:
        raise ValueError(f"a row of {parts} clusters: 2 to {(SCRATCH - 48) // 2} are served")
    stream_stats = _chunk_stream(kind, True, threads, part_slots, has_where, False, True)
    pair_reduce = group_reducers(threads, "float32")[0]
    merge = summary_ops("float32")[1]
    free = uint64(0)
    wait = uint64(WAIT_NS)
    low = uint64(0xFFFFFFFF)
    shift = uint64(32)
    every = (1 << parts) - 1

    def claim(wsp, k, m, s):
        """The slot's summary once ``(m, s)`` has been offered to it (the first one wins)."""
        packed = uint64(bits_from_f32(m)) | (uint64(bits_from_f32(s)) << shift)
        old = cuda.atomic.cas(wsp[0], k, free, packed)  # never 0: a finite max has a sum >= 1
        return packed if old == free else old

    claim = device_function(claim)

    def put(scratch, i, word):
        scratch[i] = f32_from_bits(word & low)
        scratch[i + 1] = f32_from_bits(word >> shift)

    put = device_function(put)

    def exchange(wsp, r, h, m, s, xr, wr, nw, scratch, flag):
        tid = cuda.threadIdx.x
        first = parts * r
        if tid == 0:
            # the claim and the first reads of the other slots in flight together; a slot
            # is its whole message, so relaxed loads suffice
            packed = uint64(bits_from_f32(m)) | (uint64(bits_from_f32(s)) << shift)
            old = cuda.atomic.cas(wsp[0], first + h, free, packed)
            put(scratch, 48 + 2 * h, packed if old == free else old)
            got = 1 << h
            start = globaltimer()
            polls = 0
            pause = POLL_NS
            while True:
                for k in range(parts):
                    if not (got >> k) & 1:
                        word = load_l2(wsp[0], first + k)
                        if word != free:
                            put(scratch, 48 + 2 * k, word)
                            got |= 1 << k
                if got == every or globaltimer() - start >= wait:
                    break
                polls += 1
                if polls > SPIN_POLLS:  # then back off: fewer L2 requests
                    nanosleep(pause)
                    pause = min(2 * pause, MAX_POLL_NS)
            flag[0] = int32(every ^ got)
        cuda.syncthreads()
        missing = flag[0]
        if missing != 0:  # rare: summarize the parts whose clusters have not published
            for k in range(parts):
                if (missing >> k) & 1:
                    mt, st, _, _ = stream_stats(xr, wr, nw, k * threads * part_slots + tid)
                    mk, sk = pair_reduce(mt, st, scratch)
                    if tid == 0:
                        put(scratch, 48 + 2 * k, claim(wsp, first + k, mk, sk))
                    cuda.syncthreads()
        m = scratch[48]
        s = scratch[49]
        for k in range(1, parts):
            m, s = merge(m, s, scratch[48 + 2 * k], scratch[49 + 2 * k])
        return m, s

    return device_function(exchange)


@functools.cache
def persistent(op: str, kind: str, threads: int, slots: int, has_where: bool,
               whole: bool = False, split: int = 0, parts: int = 1, held: int = 0):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp, spread)`` (the signature of
    :func:`normalize`, and ``spread``: :func:`stagger`'s nanoseconds): softmax or log_softmax
    on a persistent grid of thread-block clusters of ``chunks`` blocks, a block per chunk of
    ``threads * slots`` words (:func:`shared_bytes` of dynamic shared memory with one stage).

    The grid is the clusters that fit on the device at once (:func:`.arrays.resident_clusters`)
    and cluster ``c`` of ``C`` walks rows ``c, c + C, c + 2C, ...``; the groups that walk one
    row fewer start ``spread`` ns apart.  With ``parts`` above 1 a row is ``parts`` clusters of
    ``split`` blocks (``parts p`` to ``parts p + parts - 1`` walk rows ``p, p + C / parts,
    ...``, each an equal part of the chunks) that exchange their parts' summaries through device
    memory once a row (:func:`_part_exchange`: ``wsp`` holds zeroed slots, ``parts`` a row).  Per
    row, each thread folds its copy groups into a running (max, sum) as they land (``land_fold``
    of :func:`_stage`; :func:`_whole_fold` with ``whole``: every row ``chunks`` whole chunks and
    no ``where``), each warp merges its threads' pairs by shuffles and publishes the pair in its
    block's shared memory, and one cluster barrier later every warp reads the ``chunks x warps``
    pairs of the cluster (distributed shared memory) and merges them itself: one barrier per
    row, no block barrier.  The pairs alternate between two slots by row parity, so a slot is
    rewritten only after every peer has passed the barrier that follows its last read of it.  The
    outputs are then written word by word, and each staged word, once read back for its store,
    is refilled with the same word of the cluster's next row (``cp.async``, committed by copy
    group, so the fold of the next row waits group by group): the next row's loads are in flight
    while this row is written, and no cluster waits for a launch between rows.  With ``held``,
    each thread also keeps ``held`` words of its chunk in registers (loaded directly, written
    and reloaded with the next row's).  A thread reads back only the words it copied itself,
    so no barrier guards the stage.  Before it exits a block arrives at and waits on the cluster
    barrier once more, so that no block's shared memory goes while a peer may read it.
    """
    if held and (parts > 1 or not whole or has_where):
        raise ValueError("words held in registers serve rows of one cluster, whole chunks "
                         "and no where")
    width, decode, encode = word_codec(kind)
    words = threads * (slots + held)  # a chunk: ``slots`` words a thread staged, ``held`` kept
    n_groups = groups(slots)
    per = slots // n_groups
    issue, _, _, land_fold = _stage(kind, threads, slots, has_where, False)
    lean = whole and not has_where
    fold = _whole_fold(kind, threads, slots) if lean else None
    results = _word_results(op, kind)
    row_state = _row_state(op)
    exp = exponential("float32")
    merge = summary_ops("float32")[1]
    warp_pair = group_reducers(min(32, threads), "float32")[0]  # shuffles only: no scratch
    warps = max(1, threads // 32)
    pairs = 4 * warps  # (max, sum) per warp, two slots by row parity
    held_words = 4 * per  # 32-bit words of a copy group of one thread
    several = parts > 1
    # 16-bit softmax: the exponent's error from log2 S (|log2 S| u_A, at most 2^-19 for rows
    # of 2^19 values) is far below the 16-bit rounding; float32 keeps exp(x - m_t) * f
    short = width == 8
    part_exchange = (_part_exchange(kind, threads, slots * split, has_where, parts)
                     if several else None)
    is_log = op == "log_softmax"
    neg_inf, zero = float32(NEG_INF), float32(0.0)

    def regular_word(orow, i, a, b, c, d, m, m_t, f, log_s, log2_s, buf):
        """Write the outputs of the staged word ``a, b, c, d`` of a usual row at ``orow[i]``."""
        decode(a, b, c, d, buf, 0)
        for v in range(width):
            if is_log:
                buf[v] = (buf[v] - m) - log_s
            elif short:  # 2^((x - M) log2 e - log2 S): one FMA, one ex2
                buf[v] = ex2((buf[v] - m) * float32(LOG2E) - log2_s)
            else:
                buf[v] = exp(buf[v] - m_t) * f
        a, b, c, d = encode(buf, 0)
        store16(orow, i, a, b, c, d)

    regular_word = device_function(regular_word)

    def reload(kw, k, row, i):
        """Load the 16 bytes at element ``i`` of ``row`` into held word ``k``."""
        a, b, c, d = load16(row, i)
        kw[4 * k] = a
        kw[4 * k + 1] = b
        kw[4 * k + 2] = c
        kw[4 * k + 3] = d

    reload = device_function(reload)
    raise_max = _raise_max()
    # with held words, two blocks a multiprocessor: their registers allow twice the budget
    registers = min(255, 65536 // (threads * blocks_per_sm(threads, slots))) if held else None
    n_held = held
    kw_words = max(1, 4 * held)

    @kernel(threads, _fit(threads, slots)[1], registers=registers)
    def row_kernel(x, w, masked_nan, out, n_rows, nw, chunks, wsp, spread):
        stage = cuda.shared.array(0, uint32)
        summary = cuda.shared.array(pairs, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        flag = cuda.shared.array(1, int32)
        lane = cuda.threadIdx.x
        wl = lane % 32
        size = chunks // parts  # blocks of a cluster
        cid = cluster_id()
        h = cid % parts  # the part of the row's chunks this cluster holds
        row_base = (h * size + cluster_rank()) * words
        base = row_base + lane
        step = cuda.gridDim.x // chunks  # the clusters (groups of clusters) of the grid
        total = size * warps  # warp pairs of a cluster
        buf = cuda.local.array(width, float32)
        held = cuda.local.array(held_words, uint32)
        kw = cuda.local.array(kw_words, uint32)  # the held words (registers)
        r = cid // parts
        late = r - n_rows % step + 1  # > 0: the group walks one row fewer than the first ones
        if spread > 0 and late > 0 and n_rows % step > 0:
            start = globaltimer()
            while globaltimer() - start < uint64(spread * late):
                nanosleep(256)
        if r < n_rows:
            issue(stage, 0, x[r], nw, base, lane)
            for k in range(n_held):
                reload(kw, k, x[r], (base + (slots + k) * threads) * width)
        slot = 0
        while r < n_rows:
            # the thread's offsets derived afresh each row: hoisted, the words' addresses
            # would be live across the loop (and spilled)
            lane = opaque(cuda.threadIdx.x)
            base = opaque(row_base) + lane
            wr = w[r if has_where else 0]
            orow = out[r]
            nxt = r + step
            more = nxt < n_rows
            xn = x[nxt if more else r]
            if lean:
                m_t, s_t = fold(stage, lane)
                if n_held:  # the words in registers: their maximum, then their exponentials
                    gm = neg_inf
                    for k in range(n_held):
                        decode(kw[4 * k], kw[4 * k + 1], kw[4 * k + 2], kw[4 * k + 3], buf, 0)
                        for v in range(width):
                            gm = max_nan(gm, buf[v])
                    m_t, s_t = raise_max(m_t, s_t, max_nan(m_t, gm))
                    if m_t > neg_inf and m_t < POS_INF:
                        for k in range(n_held):
                            decode(kw[4 * k], kw[4 * k + 1], kw[4 * k + 2], kw[4 * k + 3], buf,
                                   0)
                            for v in range(width):
                                s_t += exp(buf[v] - m_t)
            else:
                m_t, s_t = land_fold(stage, 0, wr, nw, base, lane)
            m, s = warp_pair(m_t, s_t, summary)
            if wl == 0:
                summary[slot + 2 * (lane // 32)] = m
                summary[slot + 2 * (lane // 32) + 1] = s
            cluster_arrive()
            cluster_wait()  # every warp's pair of the row is written
            m = neg_inf
            s = zero
            for k in range(wl, total, 32):
                peer = k // warps
                i = slot + 2 * (k - peer * warps)
                m, s = merge(m, s, cluster_load(summary, i, peer),
                             cluster_load(summary, i + 1, peer))
            m, s = warp_pair(m, s, summary)
            if several:  # the other parts' summaries, from the other clusters
                m, s = part_exchange(wsp, r, h, m, s, x[r], wr, nw, scratch, flag)
            nan_row, inf_row, empty, log_s, f, regular = row_state(m, s, m_t, masked_nan)
            log2_s = log_s * float32(LOG2E)
            if lean and regular:  # the usual case: no tests a value
                for k in range(n_held):  # written, then reloaded with the next row's
                    wi = base + (slots + k) * threads
                    regular_word(orow, wi * width, kw[4 * k], kw[4 * k + 1], kw[4 * k + 2],
                                 kw[4 * k + 3], m, m_t, f, log_s, log2_s, buf)
                    if more:
                        reload(kw, k, xn, wi * width)
                for g in range(n_groups):
                    for i in range(per):  # the group read back first, then written
                        a, b, c, d = load_shared16(stage, (lane + (g * per + i) * threads) * 4)
                        held[4 * i] = a
                        held[4 * i + 1] = b
                        held[4 * i + 2] = c
                        held[4 * i + 3] = d
                    for i in range(per):
                        j = g * per + i
                        wi = base + j * threads
                        regular_word(orow, wi * width, held[4 * i], held[4 * i + 1],
                                     held[4 * i + 2], held[4 * i + 3], m, m_t, f, log_s,
                                     log2_s, buf)
                        if more:  # the word is read back: refill it with the next row's
                            cp_async16(stage, (lane + j * threads) * 4, xn, wi * width)
                    cp_async_commit()
            else:
                for k in range(n_held):
                    wi = base + (slots + k) * threads
                    decode(kw[4 * k], kw[4 * k + 1], kw[4 * k + 2], kw[4 * k + 3], buf, 0)
                    results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty,
                            masked_nan)
                    a, b, c, d = encode(buf, 0)
                    store16(orow, wi * width, a, b, c, d)
                    if more:
                        reload(kw, k, xn, wi * width)
                for g in range(n_groups):
                    for j in range(g * per, (g + 1) * per):
                        wi = base + j * threads
                        if wi < nw:
                            q = (lane + j * threads) * 4
                            a, b, c, d = stage[q], stage[q + 1], stage[q + 2], stage[q + 3]
                            decode(a, b, c, d, buf, 0)
                            results(buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty,
                                    masked_nan)
                            a, b, c, d = encode(buf, 0)
                            store16(orow, wi * width, a, b, c, d)
                            if more:
                                cp_async16(stage, q, xn, wi * width)
                    cp_async_commit()
            r = nxt
            slot = 2 * warps - slot
        cluster_arrive()  # leave once every peer has read this block's pairs
        cluster_wait()

    return row_kernel
