"""Cross-entropy with logits and its fused gradient (index targets), as row kernels that read
each row once and hold it on chip, laid out as :mod:`.row_kernels` lays out softmax: the
row's summary, with the allowed count and the sum of ``x - M`` for label smoothing, then the
gradient written from registers and the loss by the block of the row's first chunk.
"""


from __future__ import annotations

import functools

from numba import int32

from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    cuda,
    device_function,
    kernel,
    logarithm,
)
from .reductions import SCRATCH, exponential, group_reducers
from .row_kernels import (
    _chunk_io,
    _last_arriver,
    _placement,
    _row_summary,
    _slots,
    _thread_sum,
    _values,
)
from .storage import loader, storer, word_io


@functools.cache
def row_loss(acc_name: str, smooth: bool):
    """Device function ``loss(valid, special, normal, x_t, m, log_s, eps, cnt, share, zsum)``:
    a row's loss from its summary (``m``, ``log_s``; ``cnt`` allowed positions whose ``x - m``
    sum to ``zsum``), its target's logit ``x_t`` and the smoothing ``eps`` (``share = eps /
    cnt``); zero for an ignored row, NaN for a special one.  The register and the staged
    kernels share it."""
    acc = accumulator(acc_name)[1]
    nan, zero, one = acc(NAN), acc(0.0), acc(1.0)

    def loss(valid, special, normal, x_t, m, log_s, eps, cnt, share, zsum):
        if not valid:
            return zero
        if special:
            return nan
        z = x_t - (m if normal else zero)
        total = zero
        if eps != one:
            total += (one - eps) * (z - log_s)
        if smooth and cnt > zero:
            total += share * (zsum - cnt * log_s)
        return zero - total

    return device_function(loss, inline=True)


@functools.cache
def smoothing_sums(threads: int, acc_name: str, smooth: bool):
    """Device function ``sums(c_t, z_t, m_t, m, scratch) -> (cnt, zsum)``: the group's count
    of allowed positions and the sum of their ``x - m`` (each thread's ``z_t`` is relative to
    its own maximum ``m_t``), which label smoothing needs; zeros without ``smooth``.  The
    register and the staged kernels share it."""
    sum_reduce = group_reducers(threads, acc_name)[1]
    zero = accumulator(acc_name)[1](0.0)

    def sums(c_t, z_t, m_t, m, scratch):
        cnt = zero
        zsum = zero
        if smooth:
            cnt = sum_reduce(c_t, scratch)
            zsum = sum_reduce(z_t + c_t * (m_t - m) if c_t > zero else zero, scratch)
        return cnt, zsum

    return device_function(sums, inline=True)


@functools.cache
def row_terms(acc_name: str):
    """Device function ``terms(m, s, cnt, eps, valid, target, n) -> (special, normal, log_s,
    inv, share)``: the case of a row of summary ``(m, s)`` and ``n`` positions and what its
    outputs are formed from.  ``special``: an allowed NaN or ``+inf``, or a target outside
    ``[0, n)`` that is not ignored (``valid``): the row is NaN; ``normal``: neither special
    nor empty; ``log s`` and ``1 / s`` (0 unless ``normal``); ``share = eps / cnt``, the
    smoothing of each allowed position.  The register and the staged kernels share it."""
    acc = accumulator(acc_name)[1]
    log = logarithm(acc_name)
    neg_inf, zero, one = acc(NEG_INF), acc(0.0), acc(1.0)

    def terms(m, s, cnt, eps, valid, target, n):
        special = m != m or m == POS_INF or (valid and (target < 0 or target >= n))
        normal = not special and m > neg_inf
        log_s = log(s) if normal else zero
        inv = one / s if normal else zero
        share = eps / cnt if cnt > zero else eps
        return special, normal, log_s, inv, share

    return device_function(terms, inline=True)


@functools.cache
def target_logit(kind: str, acc_name: str, has_where: bool):
    """Device function ``logit(xr, wr, target) -> x_t``: the target's logit in the
    accumulator, ``-inf`` where ``where`` excludes it.  The register and the staged kernels
    share it."""
    load = loader(kind, acc_name)
    neg_inf = accumulator(acc_name)[1](NEG_INF)

    def logit(xr, wr, target):
        x_t = load(xr, target)
        if has_where:
            if not wr[target]:
                x_t = neg_inf
        return x_t

    return device_function(logit, inline=True)


@functools.cache
def target_gradient(kind: str, acc_name: str, smooth: bool):
    """Device function ``rewrite(grow, target, x_t, m, inv, eps, share, g_scale)``: the
    target's element of the gradient row ``grow``, ``scale * (softmax - y)``, stored over the
    one written with ``y`` the smoothing share only.  The register and the staged kernels
    share it."""
    acc = accumulator(acc_name)[1]
    store = storer(kind)
    exp = exponential(acc_name)
    one = acc(1.0)

    def rewrite(grow, target, x_t, m, inv, eps, share, g_scale):
        g = exp(x_t - m) * inv - (one - eps)
        if smooth:
            g -= share
        store(grow, target, g * g_scale)

    return device_function(rewrite, inline=True)


@functools.cache
def cross_entropy(kin: str, kout: str, vector: bool, threads: int, slots: int,
                  rows_per_block: int, split: bool, has_where: bool, has_grad: bool,
                  smooth: bool):
    """Kernel ``(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
    smoothing, has_ignore, ignore)``: the loss of each row against the class ``index[r]``
    (smoothed by ``smoothing`` when ``smooth``) into ``loss [rows, 1]`` (accumulator dtype)
    and, with ``has_grad``, ``grad = scale * (softmax(x) - y)`` into ``grad [rows, N]``.

    The target's logit is read once per row; the gradient is written from registers with
    ``y`` the smoothing share only, then the thread that owns the target position rewrites
    that one element.  A target outside ``[0, n)`` that is not ``ignore`` gives a NaN row.
    """
    acc_name, acc = accumulator(kin)
    values = _values(kin, vector, slots)
    width = word_io(kin, vector)[0]
    load_chunk, _ = _chunk_io(kin, vector, threads, slots, has_where)
    _, store_chunk = _chunk_io(kout, vector, threads, slots, False)
    keep_exp = has_grad and not smooth
    thread_sum = _thread_sum(acc_name, values, keep_exp, smooth)
    pair_reduce = group_reducers(threads, acc_name)[0]
    fields = 4 if smooth else 2
    publish, gather, gather_counts = _last_arriver(threads, acc_name, fields)
    publish_slot = _slots(acc_name, fields)[0]
    collect = _row_summary(kin, vector, threads, slots, has_where, fields)
    place = _placement(threads, rows_per_block, split)
    logit = target_logit(kin, acc_name, has_where)
    rewrite = target_gradient(kout, acc_name, smooth)
    store_loss = storer(acc_name)
    exp = exponential(acc_name)
    loss_of = row_loss(acc_name, smooth)
    smooth_sums = smoothing_sums(threads, acc_name, smooth)
    terms = row_terms(acc_name)
    nan, neg_inf, zero = acc(NAN), acc(NEG_INF), acc(0.0)

    @kernel(threads * rows_per_block, values, acc_name == "float64")
    def row_kernel(x, w, index, scale, loss, grad, n_rows, nw, chunks, ws, sync, wsp,
                   smoothing, has_ignore, ignore):
        flag = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, acc)
        lane, r, c, live = place(n_rows, chunks)
        xr = x[r]
        wr = w[r if has_where else 0]
        base = c * (threads * slots) + lane
        vals = cuda.local.array(values, acc)
        m_t = load_chunk(xr, wr, live, nw, base, vals)
        s_t, c_t, z_t = thread_sum(vals, m_t)
        m, s = pair_reduce(m_t, s_t, scratch)
        cnt, zsum = smooth_sums(c_t, z_t, m_t, m, scratch)
        writes_loss = c == 0
        if split:
            if has_grad:
                if lane == 0:
                    publish_slot(wsp, r * chunks + c, m, s, cnt, zsum)
                m, s, cnt, zsum = collect(wsp, xr, wr, nw, r, chunks, scratch, flag)
            else:
                if not publish(ws, sync, r, c, chunks, m, s, cnt, zsum, flag):
                    return
                writes_loss = True
                m, s = gather(ws, r, chunks, scratch)
                if smooth and m > neg_inf and m < POS_INF:
                    cnt, zsum = gather_counts(ws, r, chunks, m, scratch)
        eps = acc(smoothing)
        n = nw * width
        target = index[r] if live else -1
        valid = live and (not has_ignore or target != ignore)
        # a target outside [0, n) that is not ignored makes the row NaN (never read there)
        special, normal, log_s, inv, share = terms(m, s, cnt, eps, valid, target, n)
        g_scale = scale[0]
        in_row = valid and target >= 0 and target < n
        # the thread whose word holds the target (it rewrites that gradient element)
        tw = target // width - c * (threads * slots)
        owns = in_row and tw >= 0 and tw < threads * slots and tw % threads == lane
        x_t = nan
        if in_row and (owns or (writes_loss and lane == 0)):
            x_t = logit(xr, wr, target)
        if has_grad:
            if not valid:
                for k in range(values):
                    vals[k] = zero
            elif special:
                for k in range(values):
                    vals[k] = nan
            elif not normal:
                for k in range(values):
                    vals[k] = zero
            elif smooth:
                for k in range(values):
                    v = vals[k]
                    vals[k] = (exp(v - m) * inv - share) * g_scale if v > neg_inf else zero
            else:
                f = zero if m_t == neg_inf else exp(m_t - m) * inv * g_scale
                for k in range(values):
                    vals[k] = vals[k] * f
            store_chunk(grad[r], live, nw, base, vals)
            if owns and normal and x_t > neg_inf:
                rewrite(grad[r], target, x_t, m, inv, eps, share, g_scale)
        if writes_loss and live and lane == 0:
            res = loss_of(valid, special, normal, x_t, m, log_s, eps, cnt, share, zsum)
            store_loss(loss[r], 0, res)

    return row_kernel
