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

The gradient (``merge_attention_vjp``), with ``a_s = w_s / sum w``:

    d out_s = a_s * dout,   d lse_s = a_s * (<dout, out_s - out> + dlse)

takes one block per row.  Its threads stride over the value dimension: each forms ``out``
for its elements (kept in shared memory, one slot an element), writes every ``d out_s``,
then the block sums ``<dout, out_s - out>`` part by part in a fixed tree (the differences are
taken before the products, as the definition writes them, so parts close to ``out`` do not
lose their gradient to cancellation).  Empty parts and rows whose parts are all empty get 0;
a NaN part makes the row's gradients NaN.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from softmaxkit.dtypes import accumulator_name, lookup

from . import attention_kernels as kernels
from .arrays import dummy, empty, kernel_view, library, run, shared_limit, stream_of
from .primitives import (
    LOG2E,
    NAN,
    NEG_INF,
    POS_INF,
    accumulator,
    cuda,
    device_function,
    kernel,
    logarithm,
)
from .reductions import exponential
from .rows import dtype_name
from .storage import loader, storer
from .summaries import _contiguous

THREADS = 256
VJP_THREADS = 128
VJP_REGISTERS = 96


@functools.cache
def _weight(acc_name: str):
    """Device function ``weight(lse_s, M)``: ``exp(lse_s - M)``, exactly 1 where they are
    equal (two ``+inf`` never meet in a subtraction), 0 where ``M`` is ``+inf`` or NaN."""
    _, acc = accumulator(acc_name)
    exp = exponential(acc_name)
    zero, one = acc(0.0), acc(1.0)

    def weight(old, new):
        if old == new:
            return one
        if new == POS_INF or new != new:
            return zero
        return exp(old - new)

    return device_function(weight)


@functools.cache
def _parts_max(acc_name: str):
    """Device function ``parts_max(lses, r)``: the largest ``lses[s, r]`` over the parts,
    ``-inf`` when every part is empty, NaN when any part is NaN."""
    _, acc = accumulator(acc_name)
    nan, neg_inf = acc(NAN), acc(NEG_INF)

    def parts_max(lses, r):
        m = neg_inf
        for p in range(lses.shape[0]):
            v = lses[p, r]
            if v != v:
                m = nan
            elif v > m and m == m:
                m = v
        return m

    return device_function(parts_max)


@functools.cache
def _merge_kernel(kind: str):
    """Kernel ``(outs [S, R, Dv], lses [S, R], out [R, Dv], lse [R], n_rows, dv)``."""
    acc_name, acc = accumulator(kind)
    load = loader(kind, acc_name)
    store = storer(kind)
    log = logarithm(acc_name)
    weight = _weight(acc_name)
    parts_max = _parts_max(acc_name)
    neg_inf, zero, one = acc(NEG_INF), acc(0.0), acc(1.0)

    @kernel(THREADS, 1, acc_name == "float64")
    def merge_kernel(outs, lses, out, lse, n_rows, dv):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        per_row = dv if dv > 0 else 1
        if k >= n_rows * per_row:
            return
        r = k // per_row
        d = k - r * per_row
        parts = lses.shape[0]
        m = parts_max(lses, r)
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


def vjp_shared_bytes(kind: str, dv: int) -> int:
    """Shared memory the gradient of a merge of ``outs`` of dtype ``kind`` needs for ``Dv``
    (``can_run`` declines more than :data:`.manifest.VJP_SHARED_BYTES`, which launches take
    without an opt-in)."""
    return max(dv, 1) * (8 if accumulator_name(kind) == "float64" else 4)


@functools.cache
def _vjp_kernel(kind: str, dout_kind: str, has_dlse: bool):
    """Kernel ``(outs [S, R, Dv], lses [S, R], dout [R, Dv], dlse [R], douts [S, R, Dv],
    dlses [S, R], dv)``, one block of :data:`VJP_THREADS` a row, ``Dv`` accumulator slots of
    dynamic shared memory."""
    acc_name, acc = accumulator(kind)
    load = loader(kind, acc_name)
    load_dout = loader(dout_kind, acc_name)
    store = storer(kind)
    weight = _weight(acc_name)
    parts_max = _parts_max(acc_name)
    nan, zero, one = acc(NAN), acc(0.0), acc(1.0)

    # the per-part loops keep the row's state live: under 96 registers (sm_90) nothing spills
    @kernel(VJP_THREADS, 1, registers=VJP_REGISTERS)
    def vjp_kernel(outs, lses, dout, dlse, douts, dlses, dv):
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        merged = cuda.shared.array(0, acc)
        partial = cuda.shared.array(VJP_THREADS, acc)
        parts = lses.shape[0]
        m = parts_max(lses, r)
        total = zero
        if m == m:
            for p in range(parts):
                v = lses[p, r]
                if v != NEG_INF:
                    total += weight(v, m)
        if not total > zero:  # a NaN part: NaN gradients; every part empty: zero
            fill = nan if m != m else zero
            for d in range(tid, dv, VJP_THREADS):
                for p in range(parts):
                    store(douts[p, r], d, fill)
            for p in range(tid, parts, VJP_THREADS):
                dlses[p, r] = fill
            return
        inv = one / total
        for d in range(tid, dv, VJP_THREADS):
            o = zero
            for p in range(parts):
                v = lses[p, r]
                if v != NEG_INF:
                    o += weight(v, m) * inv * load(outs[p, r], d)
            merged[d] = o  # read back by this thread only
            g = load_dout(dout[r], d)
            for p in range(parts):
                v = lses[p, r]
                store(douts[p, r], d, weight(v, m) * inv * g if v != NEG_INF else zero)
        extra = dlse[r] if has_dlse else zero
        for p in range(parts):
            v = lses[p, r]
            present = v != NEG_INF
            s = zero
            if present:
                for d in range(tid, dv, VJP_THREADS):
                    s += load_dout(dout[r], d) * (load(outs[p, r], d) - merged[d])
            partial[tid] = s
            cuda.syncthreads()
            step = VJP_THREADS // 2
            while step > 0:
                if tid < step:
                    partial[tid] += partial[tid + step]
                cuda.syncthreads()
                step //= 2
            if tid == 0:
                dlses[p, r] = weight(v, m) * inv * (partial[0] + extra) if present else zero
            cuda.syncthreads()  # partial is refilled for the next part

    return vjp_kernel


def merge_attention_vjp(*, xp: Any, outs: Any, lses: Any, dout: Any,
                        dlse: Any) -> tuple[Any, Any]:
    """Gradient of :func:`merge_attention`: ``(douts [S, R, Dv]`` in ``outs``' dtype,
    ``dlses [S, R]`` in the accumulator dtype)."""
    lib = library(outs)
    parts, n_rows, dv = (int(n) for n in outs.shape)
    douts = empty(xp, outs, (parts, n_rows, dv), outs.dtype)
    dlses = empty(xp, outs, (parts, n_rows), lses.dtype)
    if parts * n_rows == 0:
        return douts, dlses
    kind = dtype_name(outs.dtype)
    device = outs.device
    if dlse is not None and dlse.dtype != lses.dtype:
        dlse = xp.astype(dlse, lses.dtype)
    dl = (kernel_view(_contiguous(dlse, lib), lib) if dlse is not None
          else dummy(lib, device, dtype_name(lses.dtype), 1))
    kernel_fn = _vjp_kernel(kind, dtype_name(dout.dtype), dlse is not None)
    run(kernel_fn, n_rows, VJP_THREADS, stream_of(outs, lib),
        kernel_view(_contiguous(outs, lib), lib), kernel_view(_contiguous(lses, lib), lib),
        kernel_view(_contiguous(dout, lib), lib), dl, kernel_view(douts, lib),
        kernel_view(dlses, lib), dv, shared=vjp_shared_bytes(kind, dv))
    return douts, dlses


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
    rm, cn = tiles or kernels.tiles_within(acc_name, d, dv, shared_limit(q, lib))
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
                  dlse: Any = None, tiles: tuple[int, int] | None = None, registers: int = 0,
                  ) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of exact attention, recomputing P from ``lse``.

    Two launches: the rows' lse in log2 units and ``delta = rowsum(dout * out)`` (less the
    lse's cotangent ``dlse`` where given, one elementwise operation), then the
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
    if dlse is not None:
        delta = delta - xp.reshape(xp.astype(dlse, acc, copy=False), (rows,))
    rn, cm = tiles or kernels.tiles_within(acc_name, d, dv, shared_limit(q, lib),
                                           backward=True)
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
