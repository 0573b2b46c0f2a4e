"""Compiled attention backward: recomputation from the log-sum-exp, FlashAttention-2 style.

Each task owns one tile of :data:`TILE_K` keys of one (batch, key/value head) and walks, for
every query head of its group, the tiles of :data:`TILE_Q` queries that can see those keys.
For each pair of tiles (``i`` queries, ``j`` keys), with ``D_i = <dout_i, out_i>``:

    S   = scale Q_i K_j^T       (softcap: T = tanh(S / c), S = c T; excluded keys -inf)
    P   = exp(S - lse_i)        (0 at excluded keys and on rows with lse = -inf)
    dV_j += P^T dO_i
    dP  = dO_i V_j^T
    dS  = P * (dP - D_i)        (times 1 - T^2 under softcap; exactly 0 where excluded)
    dQ_i += scale dS K_j,       dK_j += scale dS^T Q_i

all products BLAS (:func:`~.attention_blas.gemm`).  dK and dV of a key tile are summed over
the query heads of the group in the task's own buffers and written once; dQ receives
contributions from every key tile, so each thread adds into its own dQ buffer and the caller
sums the buffers.  Threads take tasks from a shared counter (:mod:`.attention_schedule`).
Accumulation is in the accumulator dtype (float32, float64 for float64).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention_blas import gemm
from .attention_kernels import band_covers, exclude, query_range
from .attention_schedule import next_task
from .bits import like
from .exp import exp_nonpos
from .lanes import FASTMATH

TILE_Q = 256
"""Queries per tile."""

TILE_K = 256
"""Keys per tile: the rows of dK and dV a task owns.  (Three 256 x 256 float32 tiles, S, P
and dP, stay in a 1 MiB L2.)"""


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def cap_keep(s, t, nq, nk, softcap):
    """``t = tanh(s / softcap)`` and ``s = softcap * t`` on the tile ``[:nq, :nk]``."""
    inv = like(s, 1.0) / softcap
    for i in range(nq):
        srow = s[i]
        trow = t[i]
        for j in range(nk):
            th = math.tanh(srow[j] * inv)
            trow[j] = th
            srow[j] = softcap * th


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def probabilities(s, p, lse, b, h, i0, nq, nk):
    """``p = exp(s - lse)`` row by row; a row with ``lse = -inf`` (no key) is all 0."""
    zero = like(s, 0.0)
    for i in range(nq):
        srow = s[i]
        prow = p[i]
        m = lse[b, h, i0 + i]
        if m == -np.inf:
            for j in range(nk):
                prow[j] = zero
        else:
            for j in range(nk):
                prow[j] = exp_nonpos(srow[j] - m)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def score_grads(s, p, dp, t, lse, delta, b, h, i0, nq, nk, capped):
    """``dp = p * (dp - D)`` (times ``1 - t^2`` when ``capped``).

    Exactly 0 at excluded keys and on rows with ``lse = -inf``, whatever ``dp`` holds there.
    """
    zero = like(s, 0.0)
    one = like(s, 1.0)
    ninf = like(s, -np.inf)
    for i in range(nq):
        srow = s[i]
        prow = p[i]
        drow = dp[i]
        di = delta[b, h, i0 + i]
        if lse[b, h, i0 + i] == -np.inf:
            for j in range(nk):
                drow[j] = zero
        elif capped:
            trow = t[i]
            for j in range(nk):
                g = prow[j] * (drow[j] - di) * (one - trow[j] * trow[j])
                drow[j] = zero if srow[j] == ninf else g
        else:
            for j in range(nk):
                g = prow[j] * (drow[j] - di)
                drow[j] = zero if srow[j] == ninf else g


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def backward(q, k, v, dout, lse, delta, dq_parts, dk, dv, scale, offset, causal, left, right,
             softcap, mask, strides, has_mask, workers, tile_q, tile_k):
    """Gradients of attention, all arrays C-contiguous in the accumulator dtype.

    ``q [B, Hq, Lq, D]``, ``k [B, Hk, Lk, D]``, ``v [B, Hk, Lk, Dv]``, ``dout [B, Hq, Lq, Dv]``,
    ``lse`` and ``delta = rowsum(dout * out)`` ``[B, Hq, Lq]``.  Writes ``dk``, ``dv`` (shaped
    like ``k``, ``v``) and adds thread ``w``'s share of dQ into ``dq_parts[w]`` (zeroed by the
    caller, ``[workers, B, Hq, Lq, D]``).  Band and mask arguments as in
    :func:`~.attention_kernels.forward`.
    """
    nb, hq, lq, d = q.shape
    hk, lk, dvn = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hk
    ntiles = (lk + tile_k - 1) // tile_k
    nbk = nb * hk
    ntasks = nbk * ntiles
    sc = like(q, scale)
    capped = softcap > 0
    dd = max(d, 1)
    ddv = max(dvn, 1)
    counter = np.zeros(1, dtype=np.int64)
    for w in prange(workers):
        s = np.empty((tile_q, tile_k), dtype=q.dtype)
        p = np.empty((tile_q, tile_k), dtype=q.dtype)
        dp = np.empty((tile_q, tile_k), dtype=q.dtype)
        t = np.empty((tile_q if capped else 1, tile_k), dtype=q.dtype)
        dk_t = np.empty((tile_k, dd), dtype=q.dtype)
        dv_t = np.empty((tile_k, ddv), dtype=q.dtype)
        while True:
            task = next_task(counter)
            if task >= ntasks:
                break
            # the first key tiles first: under a causal mask the most queries see them
            bk = task % nbk
            j0 = (task // nbk) * tile_k
            b = bk // hk
            kvh = bk - b * hk
            nk = min(tile_k, lk - j0)
            k_off = (bk * lk + j0) * d
            v_off = (bk * lk + j0) * dvn
            dk_t[:] = 0
            dv_t[:] = 0
            lo, hi = query_range(j0, j0 + nk, lq, offset, causal, left, right)
            for h in range(kvh * group, (kvh + 1) * group):
                bh = b * hq + h
                for i0 in range(lo, hi, tile_q):
                    nq = min(tile_q, hi - i0)
                    q_off = (bh * lq + i0) * d
                    do_off = (bh * lq + i0) * dvn
                    gemm(0, 1, nq, nk, d, sc, q, q_off, dd, k, k_off, dd, 0.0, s, 0, tile_k)
                    if capped:
                        cap_keep(s, t, nq, nk, softcap)
                    if has_mask or not band_covers(i0, i0 + nq, j0, j0 + nk, offset, causal,
                                                   left, right):
                        exclude(s, nq, nk, i0, j0, offset, causal, left, right, mask,
                                strides, has_mask, b, h)
                    probabilities(s, p, lse, b, h, i0, nq, nk)
                    if dvn > 0:
                        gemm(1, 0, nk, dvn, nq, 1.0, p, 0, tile_k, dout, do_off, ddv, 1.0,
                             dv_t, 0, ddv)
                        gemm(0, 1, nq, nk, dvn, 1.0, dout, do_off, ddv, v, v_off, ddv, 0.0,
                             dp, 0, tile_k)
                    else:
                        dp[:nq, :nk] = 0
                    score_grads(s, p, dp, t, lse, delta, b, h, i0, nq, nk, capped)
                    if d > 0:
                        gemm(0, 0, nq, d, nk, sc, dp, 0, tile_k, k, k_off, dd, 1.0, dq_parts,
                             ((w * nb * hq + bh) * lq + i0) * d, dd)
                        gemm(1, 0, nk, d, nq, sc, dp, 0, tile_k, q, q_off, dd, 1.0, dk_t, 0,
                             dd)
            for j in range(nk):
                for c in range(d):
                    dk[b, kvh, j0 + j, c] = dk_t[j, c]
                for c in range(dvn):
                    dv[b, kvh, j0 + j, c] = dv_t[j, c]
