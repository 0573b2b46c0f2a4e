"""Long rows staged in shared memory, a block per chunk: softmax, log_softmax and
cross-entropy with its gradient.

A row longer than a block holds in registers is cut into the fewest equal chunks that fit a
stage of shared memory (:func:`.plan.staged`; one chunk when the row fits) and each chunk is
copied to a stage with ``cp.async``, which never passes through registers: a block needs few
registers (one word's values at a time) and several blocks fit on a multiprocessor.  A block
takes one chunk: block ``t`` holds chunk ``t % chunks`` of row ``t // chunks``.  A thread
copies its words in :data:`.staging.GROUPS` groups and folds each group, as it lands, into its
running (max, sum): the group's words are held in registers, its maximum raises the running
maximum (the sum rescaled) and its exponentials join the sum, so no second pass over the stage
is left once the last group has landed.  Excluded values (``where`` False) are overwritten with
``-inf`` in the stage first.  The block merges its threads' pairs; the blocks of a split row
exchange their summaries as in :mod:`.row_kernels` (a bounded wait, then the missing chunks
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
"""


from __future__ import annotations

import functools

from numba import float32, int32, uint32

from .cross_entropy_kernels import (
    row_loss,
    row_terms,
    smoothing_sums,
    target_gradient,
    target_logit,
)
from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    cuda,
    device_function,
    kernel,
)
from .ptx import (
    cluster_arrive,
    cluster_id,
    cluster_load,
    cluster_rank,
    cluster_wait,
    store16,
)
from .reductions import SCRATCH, exponential, group_reducers
from .row_kernels import _row_summary, _slots
from .staging import _fit, _row_state, _stage, _word_output
from .storage import storer, word_codec


@functools.cache
def _locate(threads: int, slots: int, issue, cluster: bool):
    """Device function ``locate(stage, x, nw, chunks, t) -> (off, r, c)``: the row ``r`` and
    chunk ``c`` of item ``t`` (chunk ``t % chunks`` of row ``t // chunks``; in a cluster the
    cluster's row and the block's rank), whose copy to the stage at offset ``off`` it starts;
    the fold waits for the copies group by group."""
    words = threads * slots

    def arrive(stage, x, nw, chunks, t):
        lane = cuda.threadIdx.x
        r = t // chunks
        issue(stage, 0, x[r], nw, (t - r * chunks) * words + lane, lane)
        return 0

    arrive = device_function(arrive)

    def locate(stage, x, nw, chunks, t):
        if cluster:  # the cluster is the row, the rank its chunk (no division)
            lane = cuda.threadIdx.x
            r = cluster_id()
            c = cluster_rank()
            issue(stage, 0, x[r], nw, c * words + lane, lane)
            return 0, r, c
        off = arrive(stage, x, nw, chunks, t)
        r = t // chunks
        return off, r, t - r * chunks

    return device_function(locate)


@functools.cache
def _cluster_exchange(threads: int, fields: int):
    """Device function ``exchange(m, s, cnt, z, summary, scratch, chunks) -> (M, S, count,
    zsum)``: the row's summary from the block summaries of the ``chunks`` blocks of its
    cluster (rank ``k`` holding chunk ``k``), read from each block's ``summary`` (a shared
    float32 array of ``fields`` values) through distributed shared memory.  ``count`` and
    ``zsum`` are merged as :func:`.row_kernels._row_summary` merges them (``fields == 4``).

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
def _chunk_exchange(kind: str, threads: int, slots: int, has_where: bool, fields: int,
                    cluster: bool):
    """Device function ``combine(m, s, cnt, z, summary, scratch, flag, wsp, xr, wr, nw, r, c,
    chunks) -> (M, S, count, zsum)``: the row's summary from this block's (chunk ``c`` of row
    ``r``) and its other chunks' blocks: through distributed shared memory in a cluster
    (:func:`_cluster_exchange`), else through the slots ``wsp`` in device memory
    (:func:`.row_kernels._row_summary`); a row of one chunk keeps the block's."""
    exchange = _cluster_exchange(threads, fields)
    publish = _slots("float32", fields)[0]
    collect = _row_summary(kind, True, threads, slots, has_where, fields, True)

    def combine(m, s, cnt, z, summary, scratch, flag, wsp, xr, wr, nw, r, c, chunks):
        if cluster:
            return exchange(m, s, cnt, z, summary, scratch, chunks)
        if chunks > 1:
            if cuda.threadIdx.x == 0:
                publish(wsp, r * chunks + c, m, s, cnt, z)
            return collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
        return m, s, cnt, z

    return device_function(combine)


@functools.cache
def normalize(op: str, kind: str, threads: int, slots: int, has_where: bool,
              cluster: bool = False):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp)`` (the signature of
    :func:`.row_kernels.normalize`): chunks of ``threads * slots`` words, a block of
    ``threads`` each (:func:`.staging.shared_bytes` of dynamic shared memory), each thread
    folding its copy groups into a running (max, sum) as they land (``land_fold`` of
    :func:`.staging._stage`).

    With ``cluster``, the ``chunks`` blocks of a row are one thread-block cluster (launched
    with clusters of ``chunks`` blocks, :func:`.arrays.run`) and exchange their summaries
    through distributed shared memory (:func:`_cluster_exchange`); ``wsp`` is unused.
    """
    width, decode, encode = word_codec(kind)
    words = threads * slots
    issue, _, _, land_fold = _stage(kind, threads, slots, has_where, False)
    locate = _locate(threads, slots, issue, cluster)
    combine = _chunk_exchange(kind, threads, slots, has_where, 2, cluster)
    output = _word_output(op, kind)
    row_state = _row_state(op)
    pair_reduce = group_reducers(threads, "float32")[0]
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
            off, r, c = locate(stage, x, nw, chunks, t)
            xr = x[r]
            wr = w[r if has_where else 0]
            orow = out[r]
            base = c * words + lane
            m_t, s_t = land_fold(stage, off, wr, nw, base, lane)
            m, s = pair_reduce(m_t, s_t, scratch)
            m, s, _, _ = combine(m, s, zero, zero, summary, scratch, flag, wsp, xr, wr, nw, r,
                                 c, chunks)
            nan_row, inf_row, empty, log_s, f, regular = row_state(m, s, m_t, masked_nan)
            for j in range(slots):
                wi = base + j * threads
                if wi < nw:
                    q = off + (lane + j * threads) * 4
                    output(orow, wi, stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf,
                           regular, m, m_t, f, log_s, nan_row, inf_row, empty, masked_nan)
            break  # one chunk per block
        if cluster:  # leave once every peer has read this block's summary
            cluster_wait()

    return row_kernel


@functools.cache
def cross_entropy(kind: str, threads: int, slots: int, has_where: bool, smooth: bool,
                  cluster: bool = False):
    """Kernel ``(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
    smoothing, has_ignore, ignore)`` (the signature of
    :func:`.cross_entropy_kernels.cross_entropy`) with the fused gradient, laid out as
    :func:`normalize`.

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
    locate = _locate(threads, slots, issue, cluster)
    combine = _chunk_exchange(kind, threads, slots, has_where, fields, cluster)
    exp = exponential("float32")
    pair_reduce = group_reducers(threads, "float32")[0]
    logit = target_logit(kind, "float32", has_where)
    rewrite = target_gradient(kind, "float32", smooth)
    terms = row_terms("float32")
    store_loss = storer("float32")
    loss_of = row_loss("float32", smooth)
    smooth_sums = smoothing_sums(threads, "float32", smooth)
    nan, neg_inf, zero = float32(NAN), float32(NEG_INF), float32(0.0)

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
            off, r, c = locate(stage, x, nw, chunks, t)
            xr = x[r]
            wr = w[r if has_where else 0]
            grow = grad[r]
            base = c * words + lane
            m_t = land(stage, off, wr, nw, base, lane)
            s_t, c_t, z_t = sums(stage, off, nw, base, lane, m_t)
            m, s = pair_reduce(m_t, s_t, scratch)
            cnt, zsum = smooth_sums(c_t, z_t, m_t, m, scratch)
            m, s, cnt, zsum = combine(m, s, cnt, zsum, summary, scratch, flag, wsp, xr, wr, nw,
                                      r, c, chunks)
            target = index[r]
            valid = not has_ignore or target != ignore
            # a target outside [0, n) that is not ignored makes the row NaN (never read there)
            special, normal, log_s, inv, share = terms(m, s, cnt, eps, valid, target, n)
            in_row = valid and target >= 0 and target < n
            # the thread whose word holds the target (it rewrites that gradient element)
            tw = target // width - c * words
            owns = in_row and tw >= 0 and tw < words and tw % threads == lane
            writes_loss = c == 0
            x_t = nan
            if in_row and (owns or (writes_loss and lane == 0)):
                x_t = logit(xr, wr, target)
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
                rewrite(grow, target, x_t, m, inv, eps, share, g_scale)
            if writes_loss and lane == 0:
                res = loss_of(valid, special, normal, x_t, m, log_s, eps, cnt, share, zsum)
                store_loss(loss[r], 0, res)
            break  # one chunk per block
        if cluster:  # leave once every peer has read this block's summary
            cluster_wait()

    return row_kernel
