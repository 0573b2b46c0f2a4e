"""Merging partial attention states on the device (``merge_attention``; contract in
softmaxkit.ops, oracle ``softmaxkit.reference.attention.merge_attention``).

Each part ``(out_s, lse_s)`` is the summary ``(max = lse_s, mass = 1, numerator = out_s)``:

    lse = M + log(sum_s w_s),  w_s = exp(lse_s - M),  M = max_s lse_s
    out = sum_s (w_s / sum w) * out_s

A part with ``lse_s = -inf`` is empty: weight 0, its ``out_s`` never read.  ``w_s`` is exactly
1 where ``lse_s == M`` (so two ``+inf`` never meet in a subtraction) and 0 where ``M`` is not
finite otherwise; all parts empty gives ``(0, -inf)``; a NaN ``lse_s`` makes the row's ``out``
and ``lse`` NaN (spec "Merging partial attention states").  One thread per output element:
the ``S`` log-sum-exps of its row are read by every thread of the row (a broadcast within a
warp), each ``out_s`` element once.
"""

from __future__ import annotations

import functools
from typing import Any

from .arrays import empty, kernel_view, library, run, stream_of
from .primitives import (
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    cuda,
    device_function,
    kernel,
    log_f32,
    log_f64,
)
from .reductions import exponential
from .rows import dtype_name
from .storage import loader, storer
from .summaries import _contiguous

THREADS = 256


@functools.cache
def _merge_kernel(kind: str):
    """Kernel ``(outs [S, R, Dv], lses [S, R], out [R, Dv], lse [R], n_rows, dv)``."""
    acc_name, acc = accumulator(kind)
    load = loader(kind, acc_name)
    store = storer(kind)
    exp = exponential(acc_name)
    log = log_f64 if acc_name == "float64" else log_f32
    neg_inf, zero, one = acc(NEG_INF), acc(0.0), acc(1.0)

    def weight(old, new):
        if old == new:
            return one
        if new == POS_INF or new != new:
            return zero
        return exp(old - new)

    weight = device_function(weight)

    @kernel(THREADS, 1, acc_name == "float64")
    def merge_kernel(outs, lses, out, lse, n_rows, dv):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        per_row = dv if dv > 0 else 1
        if k >= n_rows * per_row:
            return
        r = k // per_row
        d = k - r * per_row
        parts = lses.shape[0]
        m = neg_inf
        for p in range(parts):
            v = lses[p, r]
            if v != v:
                m = acc(NAN)
            elif v > m and m == m:
                m = v
        if m != m:  # a NaN part: the merged row is NaN
            if d == 0:
                lse[r] = m
            if dv > 0:
                store(out[r], d, m)
            return
        total = zero
        for p in range(parts):
            v = lses[p, r]
            if v != NEG_INF:
                total += weight(v, m)
        is_empty = not total > zero
        if d == 0:
            lse[r] = neg_inf if is_empty else m + log(total)
        if dv > 0:
            o = zero
            if not is_empty:
                inv = one / total
                for p in range(parts):
                    v = lses[p, r]
                    if v != NEG_INF:
                        o += weight(v, m) * inv * load(outs[p, r], d)
            store(out[r], d, o)

    return merge_kernel


def merge_attention(*, xp: Any, outs: Any, lses: Any) -> tuple[Any, Any]:
    """Merge ``S`` partial states ``outs [S, R, Dv]``, ``lses [S, R]`` into ``(out [R, Dv],
    lse [R])`` (``out`` in ``outs``' dtype, ``lse`` in the accumulator dtype)."""
    lib = library(outs)
    n_rows, dv = int(outs.shape[1]), int(outs.shape[2])
    out = empty(xp, outs, (n_rows, dv), outs.dtype)
    lse = empty(xp, outs, (n_rows,), lses.dtype)
    threads = n_rows * max(dv, 1)
    if threads == 0:
        return out, lse
    kernel_fn = _merge_kernel(dtype_name(outs.dtype))
    stream = stream_of(outs, lib)
    run(kernel_fn, -(-threads // THREADS), THREADS, stream,
        kernel_view(_contiguous(outs, lib), lib), kernel_view(_contiguous(lses, lib), lib),
        kernel_view(out, lib), kernel_view(lse, lib), n_rows, dv)
    return out, lse
