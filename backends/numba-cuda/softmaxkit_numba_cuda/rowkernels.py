"""The row kernels, built per (operation, dtypes, plan) and compiled on first use.

Every kernel takes 2-D C-contiguous ``[rows, N]`` arrays.  The first pass reads each tile of
the row, takes the tile's maximum and sum of shifted exponentials, and folds it into the
thread's running summary (the online recurrence); the group then merges the threads'
summaries.  Excluded positions (``where`` False) and the masked tail of the last tile enter
as ``-inf``, which the maximum ignores and the exponential sends to zero: nothing is ever
multiplied by zero to exclude it.  The second pass writes the outputs, from registers when the
row fits in one tile, else reading the tile again.  Special rows (a NaN, a ``+inf``, nothing
allowed) follow spec/semantics.md exactly as the reference kernels do.
"""

from __future__ import annotations

import functools

from numba import float32, float64

from .intrinsics import NAN, NEG_INF, POS_INF, cuda, kernel, log_f32, log_f64
from .reductions import exponential, group_reducers, summary_ops
from .storage import loader, storer


def _acc(kind: str) -> tuple[str, object]:
    return ("float64", float64) if kind == "float64" else ("float32", float32)


@functools.cache
def _row_summary(kin: str, threads: int, slots: int):
    """Device function for the first pass: the row's ``(m, s)`` over all tiles.

    ``vals`` keeps the last tile (the whole row when there is one tile) for the second pass.
    """
    acc_name, acc = _acc(kin)
    load = loader(kin, acc_name)
    nanmax, merge = summary_ops(acc_name)
    exp = exponential(acc_name)
    neg_inf = acc(NEG_INF)
    zero = acc(0.0)

    @cuda.jit(device=True)
    def load_tile(x, w, has_where, r, live, n, base, vals):
        tm = neg_inf
        for j in range(slots):
            i = base + j * threads
            v = neg_inf
            if live and i < n:
                v = load(x, r, i)
                if has_where:
                    if not w[r, i]:
                        v = neg_inf  # excluded by the max/exp contract
            vals[j] = v
            tm = nanmax(tm, v)
        return tm

    @cuda.jit(device=True)
    def row_summary(x, w, has_where, r, live, n, lane, tiles, vals):
        m = neg_inf
        s = zero
        for t in range(tiles):
            tm = load_tile(x, w, has_where, r, live, n, t * (threads * slots) + lane, vals)
            ts = zero
            if tm > neg_inf and tm < POS_INF:
                for j in range(slots):
                    ts += exp(vals[j] - tm)
            m, s = merge(m, s, tm, ts)
        return m, s

    return load_tile, row_summary


def _coordinates(threads: int, rows_per_block: int):
    @cuda.jit(device=True)
    def coordinates(n_rows):
        tid = cuda.threadIdx.x
        if threads == 32:
            lane = tid % 32
            row = cuda.blockIdx.x * rows_per_block + tid // 32
        else:
            lane = tid
            row = cuda.blockIdx.x
        live = row < n_rows
        return lane, (row if live else 0), live

    return coordinates


@functools.cache
def normalize(op: str, kin: str, kout: str, threads: int, slots: int, rows_per_block: int,
              cached: bool):
    """Kernel ``(x, w, has_where, masked_nan, out, n_rows, n, tiles)`` (softmax, log_softmax)."""
    acc_name, acc = _acc(kin)
    load_tile, row_summary = _row_summary(kin, threads, slots)
    pair_reduce = group_reducers(threads, acc_name)[0]
    exp = exponential(acc_name)
    log = log_f64 if acc_name == "float64" else log_f32
    store = storer(kout)
    coordinates = _coordinates(threads, rows_per_block)
    is_log = op == "log_softmax"
    nan, neg_inf, zero, one = acc(NAN), acc(NEG_INF), acc(0.0), acc(1.0)

    @kernel(threads * rows_per_block, slots, acc_name == "float64")
    def row_kernel(x, w, has_where, masked_nan, out, n_rows, n, tiles):
        lane, r, live = coordinates(n_rows)
        vals = cuda.local.array(slots, acc)
        m, s = row_summary(x, w, has_where, r, live, n, lane, tiles, vals)
        m, s = pair_reduce(m, s)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        special = nan_row or inf_row or empty
        shift = zero if special else m
        safe = one if special else s
        bad = nan_row or inf_row or (masked_nan and empty)
        log_s = log(safe)
        inv = one / safe
        for t in range(tiles):
            base = t * (threads * slots) + lane
            if not cached:
                load_tile(x, w, has_where, r, live, n, base, vals)
            for j in range(slots):
                i = base + j * threads
                if live and i < n:
                    v = vals[j]
                    if is_log:
                        if nan_row or (masked_nan and empty):
                            o = nan
                        elif inf_row:
                            o = nan if v == POS_INF else neg_inf
                        else:
                            o = (v - shift) - log_s
                    else:
                        o = nan if bad else exp(v - shift) * inv
                    store(out, r, i, o)

    return row_kernel


@functools.cache
def logsumexp(kin: str, kout: str, threads: int, slots: int, rows_per_block: int,
              ):
    """Kernel ``(x, w, has_where, out, sign, return_sign, n_rows, n, tiles)``.

    ``out`` and ``sign`` are ``[rows, 1]``.
    """
    acc_name, acc = _acc(kin)
    _, row_summary = _row_summary(kin, threads, slots)
    pair_reduce = group_reducers(threads, acc_name)[0]
    log = log_f64 if acc_name == "float64" else log_f32
    store = storer(kout)
    coordinates = _coordinates(threads, rows_per_block)
    nan, neg_inf, pos_inf, zero, one = (acc(v) for v in (NAN, NEG_INF, POS_INF, 0.0, 1.0))

    @kernel(threads * rows_per_block, slots, acc_name == "float64")
    def row_kernel(x, w, has_where, out, sign, return_sign, n_rows, n, tiles):
        lane, r, live = coordinates(n_rows)
        vals = cuda.local.array(slots, acc)
        m, s = row_summary(x, w, has_where, r, live, n, lane, tiles, vals)
        m, s = pair_reduce(m, s)
        if live and lane == 0:
            if m != m:
                lse, sg = nan, nan
            elif m == POS_INF:
                lse, sg = pos_inf, one
            elif m == neg_inf:
                lse, sg = neg_inf, zero
            else:
                lse, sg = m + log(s), one
            store(out, r, 0, lse)
            if return_sign:
                store(sign, r, 0, sg)

    return row_kernel


@functools.cache
def cross_entropy(kin: str, kout: str, threads: int, slots: int, rows_per_block: int,
                  cached: bool):
    """Kernel ``(x, w, has_where, index, scale, loss, grad, has_grad, n_rows, n, tiles,
    smoothing, has_ignore, ignore)``.

    ``loss`` is ``[rows, 1]`` in the accumulator dtype; ``grad`` (``[rows, N]``) is written
    when ``has_grad``: ``scale * (softmax(x) - y)`` with ``y`` the (smoothed) one-hot target.
    """
    acc_name, acc = _acc(kin)
    load = loader(kin, acc_name)
    load_tile, row_summary = _row_summary(kin, threads, slots)
    pair_reduce, sum_reduce, _ = group_reducers(threads, acc_name)
    exp = exponential(acc_name)
    log = log_f64 if acc_name == "float64" else log_f32
    store = storer(kout)
    store_acc = storer(acc_name)
    coordinates = _coordinates(threads, rows_per_block)
    nan, neg_inf, zero, one = acc(NAN), acc(NEG_INF), acc(0.0), acc(1.0)

    @kernel(threads * rows_per_block, slots, acc_name == "float64")
    def row_kernel(x, w, has_where, index, scale, loss, grad, has_grad, n_rows, n, tiles, smoothing,
               has_ignore, ignore):
        lane, r, live = coordinates(n_rows)
        vals = cuda.local.array(slots, acc)
        m, s = row_summary(x, w, has_where, r, live, n, lane, tiles, vals)
        m, s = pair_reduce(m, s)
        eps = acc(smoothing)
        count = acc(n)
        if has_where:
            c = zero
            if live:
                for i in range(lane, n, threads):
                    if w[r, i]:
                        c += one
            count = sum_reduce(c)
        nan_row = m != m
        inf_row = m == POS_INF
        empty = m == neg_inf
        special = nan_row or inf_row or empty
        shift = zero if special else m
        safe = one if special else s
        inv = one / safe
        share = eps / (count if count > zero else one)
        target = index[r] if live else 0
        valid = live and (not has_ignore or target != ignore)
        g_scale = scale[0]
        zsum = zero
        for t in range(tiles):
            base = t * (threads * slots) + lane
            if not cached:
                load_tile(x, w, has_where, r, live, n, base, vals)
            for j in range(slots):
                i = base + j * threads
                if live and i < n:
                    z = vals[j] - shift
                    allowed = True
                    if has_where:
                        allowed = w[r, i]
                    if allowed:
                        zsum += z
                    if has_grad:
                        if not valid:
                            g = zero
                        else:
                            if nan_row or inf_row:
                                p = nan
                            elif empty:
                                p = zero
                            else:
                                p = exp(z) * inv
                            y = share if allowed else zero
                            if i == target:
                                y += one - eps
                            g = (p - y) * g_scale
                        store(grad, r, i, g)
        if eps != zero:
            zsum = sum_reduce(zsum)
        if live and lane == 0:
            if not valid:
                out = zero
            elif nan_row or inf_row:
                out = nan
            else:
                log_s = log(safe)
                z_t = neg_inf
                if not has_where or w[r, target]:
                    z_t = load(x, r, target) - shift
                total = zero
                if eps != one:
                    total += (one - eps) * (z_t - log_s)
                if eps != zero and count > zero:
                    total += share * (zsum - count * log_s)
                out = -total
            store_acc(loss, r, 0, out)

    return row_kernel


@functools.cache
def vjp(op: str, kin: str, kc: str, kout: str, threads: int, slots: int, rows_per_block: int,
        cached: bool):
    """Kernel ``(y, c, w, has_where, out, n_rows, n, tiles)`` (softmax_vjp, log_softmax_vjp).

    softmax_vjp: ``p * (c - sum(p * c))`` with ``c`` zeroed where ``p == 0`` or excluded;
    log_softmax_vjp: ``c - exp(logp) * sum(c)`` over allowed positions (``logp > -inf``).
    """
    acc_name, acc = _acc(kin)
    load_y = loader(kin, acc_name)
    load_c = loader(kc, acc_name)
    sum_reduce = group_reducers(threads, acc_name)[1]
    exp = exponential(acc_name)
    store = storer(kout)
    coordinates = _coordinates(threads, rows_per_block)
    is_log = op == "log_softmax_vjp"
    neg_inf, zero = acc(NEG_INF), acc(0.0)

    @cuda.jit(device=True)
    def load_pair(y, c, w, has_where, r, live, n, base, ys, cs):
        part = zero
        for j in range(slots):
            i = base + j * threads
            yv = zero
            cv = zero
            if live and i < n:
                yv = load_y(y, r, i)
                cv = load_c(c, r, i)
                allowed = True
                if has_where:
                    allowed = w[r, i]
                if is_log:
                    if not allowed or yv == neg_inf:
                        cv = zero
                        yv = neg_inf
                else:
                    if not allowed:
                        yv = zero
                        cv = zero
                    if yv == zero:
                        cv = zero  # a zero-probability position contributes nothing
            ys[j] = yv
            cs[j] = cv
            part += cv if is_log else yv * cv
        return part

    @kernel(threads * rows_per_block, slots, acc_name == "float64")
    def row_kernel(y, c, w, has_where, out, n_rows, n, tiles):
        lane, r, live = coordinates(n_rows)
        ys = cuda.local.array(slots, acc)
        cs = cuda.local.array(slots, acc)
        total = zero
        for t in range(tiles):
            total += load_pair(y, c, w, has_where, r, live, n, t * (threads * slots) + lane, ys,
                               cs)
        total = sum_reduce(total)
        for t in range(tiles):
            base = t * (threads * slots) + lane
            if not cached:
                load_pair(y, c, w, has_where, r, live, n, base, ys, cs)
            for j in range(slots):
                i = base + j * threads
                if live and i < n:
                    if is_log:
                        g = zero if ys[j] == neg_inf else cs[j] - exp(ys[j]) * total
                    else:
                        g = ys[j] * (cs[j] - total)
                    store(out, r, i, g)

    return row_kernel
