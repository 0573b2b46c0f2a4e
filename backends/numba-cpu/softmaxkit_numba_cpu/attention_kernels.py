"""Compiled attention forward: query tiles x key tiles, tiled products, online softmax.

For each (batch, head, tile of :data:`TILE_Q` queries) the kernel walks the keys that tile
may see (causal and window limits, :func:`key_range`) in tiles of up to :data:`TILE_K`:

1. ``S = Q_s K_t^T`` with the scale folded into the query tile once (``Q_s = scale * Q``),
   into a per-thread buffer: in float32 a register-blocked product that also keeps each row's
   maximum (:mod:`.attention_microkernels`), in float64 BLAS (:mod:`.attention_blas`);
2. on each row of ``S``: softcap, then the excluded keys set to ``-inf`` (only on tiles
   that cut the causal / window band, and wherever a boolean mask is given), the tile's
   maximum (unless the product kept it), ``P = exp(S - m)`` (written over ``S``) with the
   backend's vectorized exponential, and the online rescale of the row's running mass and
   output by ``exp(m_old - m_new)``;
3. ``O += P V_t``, accumulated into the tile's output (microkernel or BLAS likewise).

Key tiles that lie entirely outside a query tile's band are never computed, and of the tiles
the band cuts only the query rows that see some of their keys are.  The running
maximum, mass and output are in the accumulator dtype (float32, float64 for float64), the
output is normalized once at the end, and a row with no allowed key gets ``out = 0`` and
``lse = -inf`` without evaluating ``-inf - (-inf)``.  A row with an allowed NaN or ``+inf``
score gets NaN.  Numba's threads take tasks one at a time from a shared counter
(:mod:`.attention_schedule`), longest first; BLAS must run single-threaded meanwhile.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention_microkernels import PANEL, accumulate, pack_keys, pack_values, scores
from .attention_schedule import claim, flag, next_task, set_flag
from .bits import like, maxnum
from .exp import exp_nonpos
from .lanes import FASTMATH

TILE_Q = 512
"""Queries per tile: the rows of each BLAS product (only those that see the key tile)."""

TILE_K = 256
"""Keys per tile: the score tile (512 x 256 float32, 512 KiB, ``P`` written over ``S``)
stays in a 1 MiB L2 next to BLAS's packed copies."""


@njit(cache=True, nogil=True)
def key_range(i0, i1, lk, offset, causal, left, right):
    """Keys ``[lo, hi)`` that any query in ``[i0, i1)`` may see (its diagonal is i + offset)."""
    lo = 0
    hi = lk
    if causal or right >= 0:
        reach = 0 if causal else right  # causal: keys up to the diagonal, whatever right is
        hi = min(lk, i1 - 1 + offset + reach + 1)
    if left >= 0:
        lo = max(0, i0 + offset - left)
    return lo, max(lo, hi)


@njit(cache=True, nogil=True)
def query_range(j0, j1, lq, offset, causal, left, right):
    """Queries ``[lo, hi)`` that may see a key in ``[j0, j1)`` (query i's diagonal: i + offset)."""
    lo = 0
    hi = lq
    if causal or right >= 0:
        reach = 0 if causal else right
        lo = max(0, j0 - offset - reach)
    if left >= 0:
        hi = min(lq, j1 - offset + left)
    return lo, max(lo, hi)


@njit(cache=True, nogil=True)
def band_covers(i0, i1, j0, j1, offset, causal, left, right):
    """Whether every query in ``[i0, i1)`` may see every key in ``[j0, j1)`` (causal, window)."""
    if causal:
        if j1 - 1 > i0 + offset:
            return False
    elif right >= 0 and j1 - 1 > i0 + offset + right:
        return False
    return not (left >= 0 and j0 < i1 - 1 + offset - left)


@njit(cache=True, nogil=True)
def row_limits(diag, nk, causal, left, right):
    """The allowed keys ``[jmin, jmax)`` of a tile row whose diagonal is tile column ``diag``."""
    jmax = nk
    if causal:
        jmax = min(nk, diag + 1)
    elif right >= 0:
        jmax = min(nk, diag + right + 1)
    jmin = 0
    if left >= 0:
        jmin = min(nk, max(0, diag - left))
    return jmin, max(jmin, jmax)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def exclude(s, nq, nk, i0, j0, offset, causal, left, right, mask, strides, has_mask, b, h):
    """Set the excluded scores of the tile ``s[:nq, :nk]`` to ``-inf`` (band and mask).

    The mask element ``[b, h, i, j]`` is ``mask[b*strides[0] + ... + j*strides[3]]``.
    """
    ninf = like(s, -np.inf)
    sb, sh, si, sj = strides
    for i in range(nq):
        row = s[i]
        jmin, jmax = row_limits(i0 + i + offset - j0, nk, causal, left, right)
        for j in range(jmin):
            row[j] = ninf
        for j in range(jmax, nk):
            row[j] = ninf
        if has_mask:
            base = b * sb + h * sh + (i0 + i) * si + j0 * sj
            for j in range(jmin, jmax):
                if not mask[base + j * sj]:
                    row[j] = ninf


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def cap_scores(s, nq, nk, softcap):
    """``s = softcap * tanh(s / softcap)`` on the tile ``s[:nq, :nk]``."""
    inv = like(s, 1.0) / softcap
    for i in range(nq):
        row = s[i]
        for j in range(nk):
            row[j] = softcap * math.tanh(row[j] * inv)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def online_softmax(s, m, mass, bad, acc, nq, nk, mx, premax):
    """Fold the score tile ``s[:nq, :nk]`` into each row's running (max, mass, output).

    Overwrites ``s`` with ``p = exp(s - m_new)`` (0 at excluded keys, whose score is
    ``-inf``) for the caller's ``acc += p V``, after rescaling ``acc`` and ``mass`` by
    ``exp(m_old - m_new)``.  In place, the tile takes half the cache a separate ``p`` would.
    With ``premax`` the tile's row maxima are those of the lanes ``mx[i, :8]`` (kept by the
    score microkernel) instead of a pass over ``s``.
    """
    ninf = like(s, -np.inf)
    zero = like(s, 0.0)
    dv = acc.shape[1]
    for i in range(nq):
        row = s[i]
        mt = ninf
        if premax:
            for j in range(8):
                mt = maxnum(mt, like(s, mx[i, j]))
        else:
            for j in range(nk):
                mt = maxnum(mt, row[j])
        if mt == ninf or mt == np.inf or bad[i]:
            # no finite allowed score (or the row is already NaN): the tile adds nothing,
            # unless a score is +inf or NaN (the maximum skips NaN), which makes the row NaN
            if not bad[i]:
                bad[i] = mt == np.inf
                for j in range(nk):
                    bad[i] = bad[i] or row[j] != row[j]
            for j in range(nk):
                row[j] = zero
            continue
        m_old = m[i]
        m_new = maxnum(m_old, mt)
        total = zero
        chk = zero  # NaN exactly when an allowed score is NaN (the maximum skips NaN)
        for j in range(nk):
            z = row[j] - m_new
            chk += z
            e = exp_nonpos(z)
            row[j] = e
            total += e
        if chk != chk:
            bad[i] = True
        if m_old != m_new:
            alpha = exp_nonpos(m_old - m_new)  # m_old = -inf (first allowed tile) gives 0
            mass[i] = mass[i] * alpha
            arow = acc[i]
            for c in range(dv):
                arow[c] *= alpha
            m[i] = m_new
        mass[i] += total


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def finish_rows(out, lse, b, h, i0, nq, m, mass, bad, acc):
    """Normalize the tile's rows into ``out`` and ``lse``: 0 and -inf for empty rows."""
    dv = acc.shape[1]
    nan = like(acc, np.nan)
    for i in range(nq):
        orow = out[b, h, i0 + i]
        arow = acc[i]
        if bad[i]:
            lse[b, h, i0 + i] = nan
            for c in range(dv):
                orow[c] = nan
        elif mass[i] == 0:
            lse[b, h, i0 + i] = -np.inf
            for c in range(dv):
                orow[c] = 0
        else:
            inv = like(acc, 1.0) / mass[i]
            lse[b, h, i0 + i] = m[i] + np.log(mass[i])
            for c in range(dv):
                orow[c] = arow[c] * inv


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True)
def forward(q, k, v, out, lse, scale, offset, causal, left, right, softcap, mask, strides,
            has_mask, workers, tile_q, tile_k, kp, vp):
    """Attention of C-contiguous ``q [B, Hq, Lq, D]``, ``k``, ``v [B, Hk, Lk, D|Dv]``.

    Writes ``out [B, Hq, Lq, Dv]`` and the natural-log ``lse [B, Hq, Lq]``, all arrays in the
    accumulator dtype.  ``offset`` places query ``i``'s diagonal at key ``i + offset``;
    ``left`` / ``right`` are the window (-1 unbounded); ``softcap`` 0 means none; the mask
    (:func:`exclude`) is read only when ``has_mask``.  ``kp`` receives the float32 keys in
    panels (:func:`~.attention_microkernels.pack_keys`; ``[B * Hk, 16 * ceil(Lk/16) * D]``)
    and ``vp`` the values (:func:`~.attention_microkernels.pack_values`, same size with
    ``Dv``), or each is a ``[0, 0]`` float32 array for BLAS.  ``tile_k`` is a multiple of 16.
    """
    nb, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hk
    ntiles = (lq + tile_q - 1) // tile_q
    nbh = nb * hq
    ntasks = nbh * ntiles
    sc = like(q, scale)
    packed = np.zeros(nb * hk, dtype=np.int64)  # 0: to do, 1: in progress, 2: done
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        qs = np.empty((tile_q, max(d, 1)), dtype=q.dtype)
        s = np.empty((tile_q, tile_k), dtype=q.dtype)
        mx = np.empty((tile_q, 8), dtype=np.float32)
        acc = np.empty((tile_q, max(dv, 1)), dtype=q.dtype)
        m = np.empty(tile_q, dtype=q.dtype)
        mass = np.empty(tile_q, dtype=q.dtype)
        bad = np.empty(tile_q, dtype=np.bool_)
        while True:
            task = next_task(counter)
            if task >= ntasks:
                break
            # the last query tiles first: under a causal mask they are the longest
            bh = task % nbh
            i0 = (ntiles - 1 - task // nbh) * tile_q
            b = bh // hq
            h = bh - b * hq
            kv = b * hk + h // group
            nq = min(tile_q, lq - i0)
            if flag(packed, kv) != 2:
                # this head's keys and values in panels, by the first task that needs them
                if claim(packed, kv):
                    if kp.shape[0] > 0:
                        pack_keys(k, kp, kv)
                    if vp.shape[0] > 0:
                        pack_values(v, vp, kv)
                    set_flag(packed, kv, 2)
                else:
                    while flag(packed, kv) != 2:
                        pass
            lo, hi = key_range(i0, i0 + nq, lk, offset, causal, left, right)
            lo -= lo % PANEL  # key tiles start on a panel; keys before the band are masked
            m[:] = -np.inf
            mass[:] = 0
            bad[:] = False
            acc[:] = 0
            if hi > lo:
                for i in range(nq):
                    for c in range(d):
                        qs[i, c] = q[b, h, i0 + i, c] * sc
                for j0 in range(lo, hi, tile_k):
                    nk = min(tile_k, hi - j0)
                    # only the rows of the tile that see some of these keys
                    r0, r1 = query_range(j0, j0 + nk, lq, offset, causal, left, right)
                    r0 = max(r0, i0) - i0
                    r1 = min(r1, i0 + nq) - i0
                    if r1 <= r0:
                        continue
                    nr = r1 - r0
                    premax = scores(qs, r0, nr, d, k, kp, kv, j0, nk, s, tile_k, mx)
                    if softcap > 0:
                        premax = False
                        cap_scores(s, nr, nk, softcap)
                    if has_mask or not band_covers(i0 + r0, i0 + r1, j0, j0 + nk, offset,
                                                   causal, left, right):
                        premax = False
                        exclude(s, nr, nk, i0 + r0, j0, offset, causal, left, right, mask,
                                strides, has_mask, b, h)
                    online_softmax(s, m[r0:], mass[r0:], bad[r0:], acc[r0:], nr, nk, mx,
                                   premax)
                    if dv > 0:
                        accumulate(s, tile_k, nr, nk, v, vp, kv, j0, acc, r0)
            finish_rows(out, lse, b, h, i0, nq, m, mass, bad, acc)
