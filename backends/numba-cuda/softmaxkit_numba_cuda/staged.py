"""softmax and log_softmax of split rows with each chunk staged in shared memory (opt-in).

The blocks of a split row hold their chunk while they wait for the row's summary
(:mod:`.rowkernels`).  Held in registers, a chunk ties up the register file for the whole wait;
here it is copied to shared memory with ``cp.async`` (the copy never passes through
registers) and read back word by word, so a block needs few registers and more blocks -- more
bytes in flight -- fit on a multiprocessor: registers hold at most a word's values at a time.
Each thread reads back only the words it copied, so no barrier is needed between the copy and
the reads.  The arithmetic and its order are those of the register path (the thread's maximum
over its words, then the sum of exponentials), so the chunk summaries are the same.

Enabled with the environment variable :data:`ENABLE` = ``1`` for rows split across blocks,
float32 / bfloat16 / float16 rows read in 16-byte words, without ``where``.
"""

from __future__ import annotations

import functools
import os

from numba import float32, int32, uint32

from .intrinsics import NAN, NEG_INF, POS_INF, cuda, kernel, log_f32
from .reductions import SCRATCH, exponential, group_reducers, thread_max
from .rowkernels import _placement, _row_summary, _slots
from .storage import word_codec
from .wide import cp_async16, cp_async_wait, store16

ENABLE = "SOFTMAXKIT_NUMBA_CUDA_STAGED"
KINDS = ("float32", "bfloat16", "float16")


def enabled(kind: str, split: bool, vector: bool, has_where: bool, same_dtype: bool) -> bool:
    """Whether this call takes the staged kernel."""
    return (os.environ.get(ENABLE) == "1" and split and vector and not has_where
            and same_dtype and kind in KINDS)


@functools.cache
def normalize(op: str, kind: str, threads: int, slots: int):
    """Kernel ``(x, w, masked_nan, out, n_rows, nw, chunks, wsp)`` (the signature of
    :func:`.rowkernels.normalize`) for a split row, one chunk per block of ``threads``."""
    is_log = op == "log_softmax"
    width, decode, encode = word_codec(kind)
    words = threads * slots
    stage_len = 4 * words  # 32-bit words of shared memory
    tmax = thread_max("float32")
    exp = exponential("float32")
    pair_reduce = group_reducers(threads, "float32")[0]
    publish = _slots("float32", 2)[0]
    collect = _row_summary(kind, True, threads, slots, False, 2)
    place = _placement(threads, 1, True)
    nan, neg_inf, zero, one = float32(NAN), float32(NEG_INF), float32(0.0), float32(1.0)

    @kernel(threads, 8)  # a word's values and a few indices: 40 registers
    def row_kernel(x, w, masked_nan, out, n_rows, nw, chunks, wsp):
        stage = cuda.shared.array(stage_len, uint32)
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, float32)
        lane, r, c, _ = place(n_rows, chunks)
        xr = x[r]
        orow = out[r]
        base = c * words + lane
        for j in range(slots):
            if base + j * threads < nw:
                cp_async16(stage, (lane + j * threads) * 4, xr, (base + j * threads) * width)
        cp_async_wait()
        buf = cuda.local.array(width, float32)
        m_t = neg_inf
        for j in range(slots):
            if base + j * threads < nw:
                q = (lane + j * threads) * 4
                decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                for v in range(width):
                    m_t = tmax(m_t, buf[v])
        s_t = zero
        if m_t > neg_inf and m_t < POS_INF:
            for j in range(slots):
                if base + j * threads < nw:
                    q = (lane + j * threads) * 4
                    decode(stage[q], stage[q + 1], stage[q + 2], stage[q + 3], buf, 0)
                    for v in range(width):
                        s_t += exp(buf[v] - m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        if lane == 0:
            publish(wsp, r * chunks + c, m, s, zero, zero)
        m, s, _, _ = collect(wsp, xr, w[0], nw, r, chunks, scratch, flag)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        log_s = log_f32(s) if not (nan_row or inf_row or empty) else zero
        f = zero
        if nan_row or inf_row or (masked_nan and empty):
            f = nan
        elif not empty and m_t > neg_inf:
            f = exp(m_t - m) * (one / s)
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
                            o = x_v
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
