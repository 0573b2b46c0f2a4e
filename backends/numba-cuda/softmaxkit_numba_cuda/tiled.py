"""Row kernels that walk each row in tiles: the VJPs, weighted logsumexp and cross-entropy
with probability targets (the operations :mod:`.row_kernels` does not hold on chip).

Every kernel takes 2-D C-contiguous ``[rows, N]`` arrays, read as *words* of one element, or
of 16 bytes (:func:`.storage.word_io`).  A group of ``threads`` threads (a warp or less with
several rows per block, or a block) owns a row; a thread holds ``slots`` words per tile at
``lane + threads * j``, and the group walks the row's ``tiles`` tiles.

First pass.  When the row fits in one tile it stays in registers: the group reduces the
maximum, then the sum of ``exp(v - max)``.  Longer rows are read tile by tile, each tile's
maximum and sum folded into the thread's running summary (the online recurrence), and the
group merges the summaries.  Excluded positions (``where`` False) and the masked tail of the
last tile enter as ``-inf``, which the maximum ignores and the exponential sends to zero:
nothing is multiplied by zero to exclude it.  Second pass: the outputs, from registers, or
reading each tile again.  Special rows (a NaN, a ``+inf``, nothing allowed) follow
spec/semantics.md.
"""

from __future__ import annotations

import functools
import math

from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    cuda,
    device_function,
    group_coordinates,
    kernel,
    logarithm,
)
from .reductions import SCRATCH, exponential, group_reducers, summary_ops
from .storage import loader, word_io


@functools.cache
def _first_pass(kin: str, vector: bool, threads: int, slots: int, cached: bool,
                keep_exp: bool, count: bool = False):
    """Device functions ``load_tile`` and ``row_stats``: the row's maximum, normalizer and
    (with ``count``) number of included positions (allowed, above ``-inf``)."""
    acc_name, acc = accumulator(kin)
    width, load_word, _ = word_io(kin, vector)
    values = slots * width
    merge = summary_ops(acc_name)[1]
    pair_reduce, sum_reduce, max_reduce = group_reducers(threads, acc_name)
    exp = exponential(acc_name)
    neg_inf, zero, nan = acc(NEG_INF), acc(0.0), acc(NAN)

    def load_tile(xr, wr, has_where, live, nw, base, vals):
        """Load one tile into ``vals``; return its maximum (NaN if it holds a NaN) and the
        number of its values above ``-inf`` (when counting)."""
        m = neg_inf
        seen_nan = False
        included = zero
        for j in range(slots):
            wi = base + j * threads
            if live and wi < nw:
                load_word(xr, wi, vals, j * width)
                for v in range(width):
                    x = vals[j * width + v]
                    if has_where:
                        if not wr[wi * width + v]:
                            x = neg_inf  # excluded by the max/exp contract
                            vals[j * width + v] = x
                    if x != x:
                        seen_nan = True
                    elif x > m:
                        m = x
                    if count and x > neg_inf:
                        included += acc(1.0)
            else:
                for v in range(width):
                    vals[j * width + v] = neg_inf
        return (nan if seen_nan else m), included

    load_tile = device_function(load_tile)

    def row_stats(xr, wr, has_where, live, nw, lane, tiles, vals, scratch):
        """``(m, s, count)`` of the row, the same in every thread of the group."""
        if cached:
            tm, c = load_tile(xr, wr, has_where, live, nw, lane, vals)
            m = max_reduce(tm, scratch)
            if count:
                c = sum_reduce(c, scratch)
            s = zero
            if m > neg_inf and m < POS_INF:
                for k in range(values):
                    e = exp(vals[k] - m)
                    s += e
                    if keep_exp:
                        vals[k] = e
            return m, sum_reduce(s, scratch), c
        m = neg_inf
        s = zero
        c = zero
        for t in range(tiles):
            tm, tc = load_tile(xr, wr, has_where, live, nw, t * (threads * slots) + lane, vals)
            c += tc
            ts = zero
            if tm > neg_inf and tm < POS_INF:
                for k in range(values):
                    ts += exp(vals[k] - tm)
            m, s = merge(m, s, tm, ts)
        m, s = pair_reduce(m, s, scratch)
        if count:
            c = sum_reduce(c, scratch)
        return m, s, c

    return load_tile, device_function(row_stats)


@functools.cache
def cross_entropy(kin: str, kout: str, vector: bool, threads: int, slots: int,
                  rows_per_block: int, cached: bool, kp: str = ""):
    """Kernel ``(x, w, has_where, index, probs, scale, loss, grad, has_grad, n_rows, nw, tiles,
    smoothing, has_ignore, ignore)``.

    ``loss`` is ``[rows, 1]`` in the accumulator dtype; ``grad`` (``[rows, W]``) is written
    when ``has_grad``: ``scale * (softmax(x) - y)`` with ``y`` the (smoothed) target: one-hot
    of ``index``, or the probabilities ``probs`` (``[rows, N]`` elements of storage ``kp``)
    when ``kp`` is given.
    """
    acc_name, acc = accumulator(kin)
    soft = kp != ""
    load_prob = loader(kp or "float32", acc_name)
    load_tile, row_stats = _first_pass(kin, vector, threads, slots, cached, False, True)
    width, _, _ = word_io(kin, vector)
    _, _, store_word = word_io(kout, vector)
    _, _, store_loss = word_io(acc_name, False)
    values = slots * width
    sum_reduce = group_reducers(threads, acc_name)[1]
    exp = exponential(acc_name)
    log = logarithm(acc_name)
    coordinates = group_coordinates(threads, rows_per_block)
    nan, neg_inf, zero, one = acc(NAN), acc(NEG_INF), acc(0.0), acc(1.0)

    @kernel(threads * rows_per_block, values, acc_name == "float64")
    def row_kernel(x, w, has_where, index, probs, scale, loss, grad, has_grad, n_rows, nw,
                   tiles, smoothing, has_ignore, ignore):
        lane, r, live = coordinates(n_rows)
        xr = x[r]
        pr = probs[r if soft else 0]
        wr = w[r if has_where else 0]
        grow = grad[r if has_grad else 0]
        vals = cuda.local.array(values, acc)
        scratch = cuda.shared.array(SCRATCH, acc)
        m, s, count = row_stats(xr, wr, has_where, live, nw, lane, tiles, vals, scratch)
        eps = acc(smoothing)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        target = index[r] if (live and not soft) else -1
        valid = live and (soft or not has_ignore or target != ignore)
        # a class target outside [0, n) that is not ignored makes the row NaN
        unknown = valid and not soft and (target < 0 or target >= nw * width)
        special = nan_row or inf_row or unknown
        shift = zero if (special or empty) else m
        safe = one if (special or empty) else s
        inv = one / safe
        share = eps / (count if count > zero else one)
        log_s = log(safe)
        terms = zero  # soft targets: sum of y * log p over y != 0
        g_scale = scale[0]
        zsum = zero  # sum of z over the included positions
        z_t = zero  # the target's z, held by the one thread that loads it
        for t in range(tiles):
            base = t * (threads * slots) + lane
            if not cached:
                load_tile(xr, wr, has_where, live, nw, base, vals)
            for j in range(slots):
                wi = base + j * threads
                for v in range(width):
                    k = j * width + v
                    i = wi * width + v
                    z = vals[k] - shift
                    included = live and wi < nw and z > neg_inf
                    if included:
                        zsum += z
                    if i == target:
                        z_t = z
                    y = share if included else zero
                    if soft:
                        if live and wi < nw:
                            y += (one - eps) * load_prob(pr, i)
                            if y != zero:
                                terms += y * (z - log_s)
                    elif i == target:
                        y += one - eps
                    if has_grad:
                        g = zero
                        if not valid:
                            g = zero
                        elif special:
                            g = nan
                        elif included:
                            g = (exp(z) * inv - y) * g_scale
                        vals[k] = g
                if has_grad and live and wi < nw:
                    store_word(grow, wi, vals, j * width)
        if soft:
            terms = sum_reduce(terms, scratch)
        else:
            if eps != zero:
                zsum = sum_reduce(zsum, scratch)
            z_t = sum_reduce(z_t, scratch)
        if live and lane == 0:
            res = cuda.local.array(1, acc)
            if not valid:
                res[0] = zero
            elif special:
                res[0] = nan
            elif soft:
                res[0] = zero - terms
            else:
                total = zero
                if eps != one:
                    total += (one - eps) * (z_t - log_s)
                if eps != zero and count > zero:
                    total += share * (zsum - count * log_s)
                res[0] = zero - total
            store_loss(loss[r], 0, res, 0)

    return row_kernel


@functools.cache
def vjp(op: str, kin: str, kc: str, kout: str, threads: int, slots: int, rows_per_block: int,
        cached: bool):
    """Kernel ``(y, c, w, has_where, out, n_rows, n, tiles)`` (softmax_vjp, log_softmax_vjp).

    softmax_vjp: ``p * (c - sum(p * c))`` with ``c`` zeroed where ``p == 0`` or excluded;
    log_softmax_vjp: ``c - exp(logp) * sum(c)`` over allowed positions (``logp > -inf``).
    Both accumulate in the accumulator dtype of the output dtype.
    """
    acc_name, acc = accumulator(kout)
    _, load_y, _ = word_io(kin, False)
    _, load_c, _ = word_io(kc, False)
    _, _, store = word_io(kout, False)
    sum_reduce = group_reducers(threads, acc_name)[1]
    exp = exponential(acc_name)
    coordinates = group_coordinates(threads, rows_per_block)
    is_log = op == "log_softmax_vjp"
    neg_inf, zero = acc(NEG_INF), acc(0.0)

    def load_pair(yr, cr, wr, has_where, live, n, base, ys, cs):
        part = zero
        for j in range(slots):
            i = base + j * threads
            ys[j] = zero
            cs[j] = zero
            if live and i < n:
                load_y(yr, i, ys, j)
                load_c(cr, i, cs, j)
                allowed = True
                if has_where:
                    allowed = wr[i]
                if is_log:
                    if not allowed or ys[j] == neg_inf:
                        cs[j] = zero
                        ys[j] = neg_inf
                else:
                    if not allowed:
                        ys[j] = zero
                        cs[j] = zero
                    if ys[j] == zero:
                        cs[j] = zero  # a zero-probability position contributes nothing
            part += cs[j] if is_log else ys[j] * cs[j]
        return part

    load_pair = device_function(load_pair)

    @kernel(threads * rows_per_block, 2 * slots, acc_name == "float64")
    def row_kernel(y, c, w, has_where, out, n_rows, n, tiles):
        lane, r, live = coordinates(n_rows)
        yr = y[r]
        cr = c[r]
        wr = w[r if has_where else 0]
        orow = out[r]
        ys = cuda.local.array(slots, acc)
        scratch = cuda.shared.array(SCRATCH, acc)
        cs = cuda.local.array(slots, acc)
        total = zero
        for t in range(tiles):
            total += load_pair(yr, cr, wr, has_where, live, n, t * (threads * slots) + lane,
                               ys, cs)
        total = sum_reduce(total, scratch)
        for t in range(tiles):
            base = t * (threads * slots) + lane
            if not cached:
                load_pair(yr, cr, wr, has_where, live, n, base, ys, cs)
            for j in range(slots):
                i = base + j * threads
                if live and i < n:
                    if is_log:
                        ys[j] = zero if ys[j] == neg_inf else cs[j] - exp(ys[j]) * total
                    elif ys[j] != zero:  # a position that takes no part stays 0, even
                        ys[j] = ys[j] * (cs[j] - total)  # when the total is NaN or inf
                    store(orow, i, ys, j)

    return row_kernel


@functools.cache
def logsumexp_weighted(kin: str, kb: str, kout: str, threads: int, slots: int,
                       rows_per_block: int):
    """Kernel ``(x, b, w, has_where, out, sign, return_sign, n_rows, n, tiles)``: ``log |sum b
    exp(x)|`` and its sign, elements one by one, in the accumulator dtype of ``kout``.

    A zero weight excludes its position; a NaN weight where ``where`` allows makes the row
    NaN; on a ``+inf`` row the result is ``+inf`` with the sign of the weights at ``+inf``
    (NaN when they have both signs), as in spec/semantics.md.  Each thread carries
    ``(m, h, r)``: the weight ``h`` at its maximum ``m`` apart from the rest ``r`` of
    ``b exp(x - m)``, so a row dominated by one term keeps the others' share (``log1p``).
    """
    acc_name, acc = accumulator(kout)
    load_x = loader(kin, acc_name)
    load_b = loader(kb, acc_name)
    _, _, store = word_io(kout, False)
    _, sum_reduce, max_reduce = group_reducers(threads, acc_name)
    exp = exponential(acc_name)
    log = logarithm(acc_name)
    coordinates = group_coordinates(threads, rows_per_block)
    nan, neg_inf, pos_inf, zero, one = (acc(v) for v in (NAN, NEG_INF, POS_INF, 0.0, 1.0))

    def load_tile(xr, br, wr, has_where, live, n, base, xs, bs, flags):
        """Load a tile of (x, b) with exclusions applied; count NaN / signed +inf weights."""
        m = neg_inf
        seen_nan = False
        for j in range(slots):
            i = base + j * threads
            x = neg_inf
            b = zero
            if live and i < n:
                x = load_x(xr, i)
                b = load_b(br, i)
                allowed = not has_where or wr[i]
                if b != b and allowed:
                    flags[0] += one  # NaN * exp(x) is NaN, even for x = -inf
                if b == zero or not allowed:
                    x = neg_inf  # excluded
                if x == neg_inf or b != b:
                    b = zero
                if x == POS_INF:
                    if b > zero:
                        flags[1] += one
                    elif b < zero:
                        flags[2] += one
            xs[j] = x
            bs[j] = b
            if x != x:
                seen_nan = True
            elif x > m:
                m = x
        return nan if seen_nan else m

    load_tile = device_function(load_tile)

    @kernel(threads * rows_per_block, 2 * slots, acc_name == "float64")
    def row_kernel(x, b, w, has_where, out, sign, return_sign, n_rows, n, tiles):
        lane, r, live = coordinates(n_rows)
        xr = x[r]
        br = b[r]
        wr = w[r if has_where else 0]
        xs = cuda.local.array(slots, acc)
        bs = cuda.local.array(slots, acc)
        flags = cuda.local.array(3, acc)  # NaN weights, +inf with b > 0, +inf with b < 0
        flags[0] = zero
        flags[1] = zero
        flags[2] = zero
        scratch = cuda.shared.array(SCRATCH, acc)
        m = neg_inf
        h = zero  # the weight at m
        s = zero  # the rest: b exp(x - m) below m
        for t in range(tiles):
            tm = load_tile(xr, br, wr, has_where, live, n, t * (threads * slots) + lane, xs,
                           bs, flags)
            th = zero
            ts = zero
            if tm > neg_inf and tm < POS_INF:
                for j in range(slots):
                    if bs[j] == bs[j]:
                        if xs[j] == tm:
                            th += bs[j]
                        else:
                            ts += bs[j] * exp(xs[j] - tm)
            if m != m or tm != tm:
                m = nan
            elif tm > m:
                if m > neg_inf:
                    s = (h + s) * exp(m - tm) + ts
                else:
                    s = ts
                h = th
                m = tm
            elif tm < m:
                if tm > neg_inf:
                    s += (th + ts) * exp(tm - m)
            else:
                h += th
                s += ts
        # the row's maximum, then each thread's (h, r) moved to it and summed
        row_m = max_reduce(m, scratch)
        if row_m > neg_inf and row_m < POS_INF and m == m and m > neg_inf and m != row_m:
            s = (h + s) * exp(m - row_m)
            h = zero
        elif not (row_m > neg_inf and row_m < POS_INF and m == row_m):
            h = zero
            s = zero
        m = row_m
        h = sum_reduce(h, scratch)
        s = sum_reduce(s, scratch)
        nan_b = sum_reduce(flags[0], scratch)
        up = sum_reduce(flags[1], scratch)
        down = sum_reduce(flags[2], scratch)
        if live and lane == 0:
            res = cuda.local.array(2, acc)
            inf_row = m == POS_INF
            bad = m != m or nan_b > zero or (inf_row and up > zero and down > zero)
            if bad:
                res[0], res[1] = nan, nan
            elif inf_row:
                res[0] = pos_inf
                res[1] = -one if down > zero else one
            elif m == neg_inf or h + s == zero:
                res[0], res[1] = neg_inf, zero
            else:
                total = h + s
                if h != zero and abs(s) <= acc(0.5) * abs(h):
                    res[0] = log(abs(h)) + math.log1p(s / h) + m
                else:
                    res[0] = log(abs(total)) + m
                res[1] = one if total > zero else -one
            if not return_sign and res[1] < zero:
                res[0] = nan
            store(out[r], 0, res, 0)
            if return_sign:
                store(sign[r], 0, res, 1)

    return row_kernel
