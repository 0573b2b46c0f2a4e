"""Long rows on a persistent grid of thread-block clusters: softmax and log_softmax.

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

The simulator runs this kernel as clusters of one block (the setting ``persist="all"``):
two clusters walking several rows each, and rows of two chunks as two clusters exchanging
through device memory, where the one-block-at-a-time schedule takes the fallback that
summarizes the parts not yet published.
"""


from __future__ import annotations

import functools

from numba import float32, int32, uint32, uint64

from .primitives import (
    LOG2E,
    NEG_INF,
    POS_INF,
    bits_from_f32,
    cuda,
    device_function,
    f32_from_bits,
    kernel,
)
from .ptx import (
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
from .reductions import SCRATCH, exponential, group_reducers, summary_ops
from .row_kernels import (
    MAX_POLL_NS,
    POLL_NS,
    SPIN_POLLS,
    WAIT_NS,
    _chunk_stream,
)
from .staging import (
    _fit,
    _raise_max,
    _row_state,
    _stage,
    _word_output,
    blocks_per_sm,
    groups,
)
from .storage import word_codec

POLICY = 2
"""The ``CUclusterSchedulingPolicy`` of the persistent kernel's clusters: load balancing."""
STAGGER = 1.0
"""How late, as a fraction of the time a wave of rows takes at the device's peak bandwidth,
the last of the persistent grid's groups of clusters that walk one row fewer starts."""
HELD = {"float32": 4, "bfloat16": 0, "float16": 0}
"""Words a thread of the persistent kernel keeps in registers beside those staged, by dtype
(:func:`.plan.held`: chunks twice as long, a row one cluster, for rows of whole such chunks
without ``where``); 16-bit rows are one cluster already."""

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


@functools.cache
def _whole_fold(kind: str, threads: int, slots: int):
    """Device function ``fold(stage, lane) -> (m_t, s_t)``: ``land_fold`` of :func:`.staging._stage`
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
    is the whole message) for at most :data:`.row_kernels.WAIT_NS` in all.  A part still
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
    :func:`.staged.normalize`, and ``spread``: :func:`stagger`'s nanoseconds): softmax or
    log_softmax on a persistent grid of thread-block clusters of ``chunks`` blocks, a block per
    chunk of ``threads * slots`` words (:func:`.staging.shared_bytes` of dynamic shared memory).

    The grid is the clusters that fit on the device at once (:func:`.arrays.resident_clusters`)
    and cluster ``c`` of ``C`` walks rows ``c, c + C, c + 2C, ...``; the groups that walk one
    row fewer start ``spread`` ns apart.  With ``parts`` above 1 a row is ``parts`` clusters of
    ``split`` blocks (``parts p`` to ``parts p + parts - 1`` walk rows ``p, p + C / parts,
    ...``, each an equal part of the chunks) that exchange their parts' summaries through device
    memory once a row (:func:`_part_exchange`: ``wsp`` holds zeroed slots, ``parts`` a row).
    Per row, each thread folds its copy groups into a running (max, sum) as they land
    (``land_fold`` of :func:`.staging._stage`; :func:`_whole_fold` with ``whole``: every row
    ``chunks`` whole chunks and no ``where``), each warp merges its threads' pairs by shuffles
    and publishes the pair in its block's shared memory, and one cluster barrier later every
    warp reads the ``chunks x warps`` pairs of the cluster (distributed shared memory) and
    merges them itself: one barrier per row, no block barrier.  The pairs alternate between two
    slots by row parity, so a slot is rewritten only after every peer has passed the barrier
    that follows its last read of it.  The outputs are then written word by word, and each
    staged word, once read back for its store, is refilled with the same word of the cluster's
    next row (``cp.async``, committed by copy group, so the fold of the next row waits group by
    group): the next row's loads are in flight while this row is written, and no cluster waits
    for a launch between rows.  With ``held``, each thread also keeps ``held`` words of its
    chunk in registers (loaded directly, written and reloaded with the next row's).  A thread
    reads back only the words it copied itself, so no barrier guards the stage.  Before it exits
    a block arrives at and waits on the cluster barrier once more, so that no block's shared
    memory goes while a peer may read it.
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
    output = _word_output(op, kind)
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
                for g in range(0, n_groups):
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
                    output(orow, wi, kw[4 * k], kw[4 * k + 1], kw[4 * k + 2], kw[4 * k + 3],
                           buf, regular, m, m_t, f, log_s, nan_row, inf_row, empty, masked_nan)
                    if more:
                        reload(kw, k, xn, wi * width)
                for g in range(n_groups):
                    for j in range(g * per, (g + 1) * per):
                        wi = base + j * threads
                        if wi < nw:
                            q = (lane + j * threads) * 4
                            a, b, c, d = stage[q], stage[q + 1], stage[q + 2], stage[q + 3]
                            output(orow, wi, a, b, c, d, buf, regular, m, m_t, f,
                                   log_s, nan_row, inf_row, empty, masked_nan)
                            if more:
                                cp_async16(stage, q, xn, wi * width)
                    cp_async_commit()
            r = nxt
            slot = 2 * warps - slot
        cluster_arrive()  # leave once every peer has read this block's pairs
        cluster_wait()

    return row_kernel
