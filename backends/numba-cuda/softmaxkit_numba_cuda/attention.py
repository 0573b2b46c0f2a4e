"""Attention on the device: exact float32 / float64 attention and its gradient
(``attention``, ``attention_vjp``; kernels in :mod:`.attention_kernels`) and the merge of
partial attention states (``merge_attention``).  Contracts in softmaxkit.ops, oracles in
``softmaxkit.reference.attention``.

Merging partial attention states:

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
import math
from typing import Any

from softmaxkit.dtypes import accumulator_name, lookup

from . import attention_kernels as kernels
from .arrays import dummy, empty, kernel_view, library, run, stream_of
from .primitives import (
    LOG2E,
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


def _band(q: Any, k: Any, causal: Any, window: tuple[int, int]) -> tuple[int, int, int]:
    """``(offset, lo, hi)``: query ``i`` sits on the diagonal key ``i + offset`` and key ``j``
    is in its band when ``lo <= j - (i + offset) <= hi``."""
    lq, lk = int(q.shape[2]), int(k.shape[2])
    offset = 0 if causal == "top_left" else lk - lq
    lo, hi = kernels.band_limits(causal, (int(window[0]), int(window[1])))
    return offset, lo, hi


def _score_factors(scale: float, softcap: Any) -> tuple[float, float]:
    """``(qk_mult, cap_mult)``: scores in log2 units are ``(q . k) * qk_mult``, or under a
    softcap ``tanh((q . k) * qk_mult) * cap_mult``."""
    if softcap is None:
        return float(scale) * LOG2E, 0.0
    return float(scale) / float(softcap), float(softcap) * LOG2E


def _view(a: Any, lib: str) -> Any:
    """:func:`.arrays.kernel_view` of ``a``; a read-only numpy array (the frontend's broadcast
    views) is copied first: Numba's simulator assigns to its host arguments after a launch."""
    if lib == "numpy" and not a.flags.writeable:
        a = a.copy()
    return kernel_view(a, lib)


def _mask_view(mask: Any, q: Any, lib: str) -> Any:
    return _view(mask, lib) if mask is not None else dummy(lib, q.device, "bool", 4)


def attention(*, xp: Any, q: Any, k: Any, v: Any, scale: float, causal: Any,
              window: tuple[int, int], mask: Any, softcap: Any, return_lse: bool,
              tiles: tuple[int, int] | None = None, registers: int = 0) -> tuple[Any, Any]:
    """Exact attention forward in the accumulator dtype; ``(out, lse or None)``.

    ``tiles`` overrides the (rows, keys) micro-tile of a thread (a block takes 16 * rows query
    rows and key tiles of 16 * keys; :data:`.attention_kernels.FORWARD_TILES` by default),
    ``registers`` the register cap (:data:`.attention_kernels.REGISTERS`): both for tuning.
    """
    lib = library(q)
    kind = dtype_name(q.dtype)
    acc_name = accumulator_name(kind)
    acc = lookup(xp, acc_name)
    b, hq, lq, d = (int(s) for s in q.shape)
    lk, dv = int(k.shape[2]), int(v.shape[3])
    if b * hq * lq == 0 or lk == 0:  # no row, or no key: out 0, lse -inf (spec)
        out = xp.zeros((b, hq, lq, dv), dtype=q.dtype, device=q.device)
        lse = xp.full((b, hq, lq), -math.inf, dtype=acc, device=q.device)
        return out, (lse if return_lse else None)
    out = empty(xp, q, (b, hq, lq, dv), q.dtype)
    lse = empty(xp, q, (b, hq, lq), acc)
    rm, cn = tiles or kernels.tiles(kernels.FORWARD_TILES, acc_name, d, dv)
    fn = kernels.forward(kind, d, dv, rm, cn, mask is not None, softcap is not None, registers)
    offset, lo, hi = _band(q, k, causal, window)
    qk_mult, cap_mult = _score_factors(scale, softcap)
    q_tiles = -(-lq // (kernels.LANES * rm))
    run(fn, q_tiles * b * hq, kernels.THREADS, stream_of(q, lib),
        _view(q, lib), _view(k, lib), _view(v, lib), _mask_view(mask, q, lib),
        _view(out, lib), _view(lse, lib), qk_mult, cap_mult, offset, lo, hi,
        q_tiles, shared=kernels.forward_shared(acc_name, d, dv, rm, cn))
    return out, (lse if return_lse else None)


def attention_vjp(*, xp: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
                  scale: float, causal: Any, window: tuple[int, int], mask: Any, softcap: Any,
                  tiles: tuple[int, int] | None = None, registers: int = 0,
                  ) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of exact attention, recomputing P from ``lse``.

    Two launches: the rows' lse in log2 units and ``delta = rowsum(dout * out)``, then the
    kernel parallel over key tiles, which writes dk and dv and adds dq's partial products
    atomically into dq (zeroed here; float32 and float64 are their own accumulators).
    ``tiles`` overrides the (keys, queries) micro-tile (:data:`.attention_kernels.BACKWARD_TILES`),
    ``registers`` the register cap.
    """
    lib = library(q)
    kind = dtype_name(q.dtype)
    acc_name = accumulator_name(kind)
    acc = lookup(xp, acc_name)
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk, dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    dq = xp.zeros((b, hq, lq, d), dtype=q.dtype, device=q.device)
    if b * hq * lq == 0 or lk == 0:  # no key gets a contribution, no row has a gradient
        return (dq, xp.zeros((b, hk, lk, d), dtype=k.dtype, device=q.device),
                xp.zeros((b, hk, lk, dv), dtype=v.dtype, device=q.device))
    dk = empty(xp, q, (b, hk, lk, d), k.dtype)
    dvv = empty(xp, q, (b, hk, lk, dv), v.dtype)
    rows = b * hq * lq
    lse2 = empty(xp, q, (rows,), acc)
    delta = empty(xp, q, (rows,), acc)
    stream = stream_of(q, lib)
    per_block = kernels.THREADS // kernels.LANES
    run(kernels.backward_rows(kind, dv), -(-rows // per_block), kernels.THREADS, stream,
        _view(out, lib), _view(dout, lib), _view(lse, lib),
        _view(lse2, lib), _view(delta, lib), rows)
    rn, cm = tiles or kernels.tiles(kernels.BACKWARD_TILES, acc_name, d, dv)
    fn = kernels.backward(kind, d, dv, rn, cm, mask is not None, softcap is not None,
                          registers)
    offset, lo, hi = _band(q, k, causal, window)
    qk_mult, cap_mult = _score_factors(scale, softcap)
    k_tiles = -(-lk // (kernels.LANES * rn))
    run(fn, k_tiles * b * hk, kernels.THREADS, stream,
        _view(q, lib), _view(k, lib), _view(v, lib), _view(dout, lib),
        _mask_view(mask, q, lib), _view(lse2, lib), _view(delta, lib),
        _view(dq, lib), _view(dk, lib), _view(dvv, lib), qk_mult, cap_mult,
        float(scale), offset, lo, hi,
        shared=kernels.backward_shared(acc_name, d, dv, rn, cm))
    return dq, dk, dvv
