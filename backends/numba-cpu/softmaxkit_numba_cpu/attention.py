"""Attention as softmaxkit calls it: ``attention(*, xp, q, k, v, ...)`` and its gradient.

The compiled kernels (:mod:`.attention_kernels`, :mod:`.attention_grad_kernels`) read
C-contiguous arrays in the accumulator dtype: float32 and float64 inputs are used in place
when their layout allows, float16 and bfloat16 are converted to float32 once (the output is
rounded once at the end).  Boolean masks are read in place, broadcast views included, through
a flat view and four element strides (:func:`mask_view`).

Threads: Numba's threads (``NUMBA_NUM_THREADS``, ``numba.set_num_threads``) share the tiles;
the BLAS products inside them must then run on one thread each, or OpenBLAS's own threads
would compete with Numba's for the same cores.  :func:`single_threaded_blas` limits every
loaded BLAS library to one thread for the duration of a call on several threads and restores
it after.  Which OpenBLAS kernel runs also matters: OpenBLAS picks it from the CPU unless the
environment variable ``OPENBLAS_CORETYPE`` names one (docs/benchmarks-cpu.md, "Attention").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numba
import numpy as np

from softmaxkit.dtypes import accumulator_dtype

from .adapters import Output, accumulator, empty, numpy_view, readable

PARALLEL_MIN_SCORES = 1 << 20
"""Below this many scores (``B * Hq * Lq * Lk``, about 4 ms of one core's work at D = 64) one
thread does all the work: waking the others can cost milliseconds on a busy machine."""

_NO_MASK = (np.ones(1, dtype=np.bool_), (0, 0, 0, 0))
_controller: Any = None


def single_threaded_blas(workers: int) -> AbstractContextManager:
    """A context in which every loaded BLAS library (SciPy's included) runs on one thread
    while ``workers`` of Numba's threads run a kernel: nothing for one worker, whose products
    compete with no other thread of the call (and setting the libraries' threads costs tens
    of microseconds, as much as a small call's work)."""
    global _controller
    if workers <= 1:
        return nullcontext()
    if _controller is None:
        import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS the kernels call)
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="blas")


@contextmanager
def numba_threads(workers: int) -> Iterator[None]:
    """Run the enclosed kernel with ``workers`` of Numba's threads.

    A parallel region wakes every thread of Numba's pool even when fewer have work, and on a
    busy machine each wake-up can cost milliseconds: small calls run on one thread alone.
    """
    before = numba.get_num_threads()
    if workers >= before:
        yield
        return
    numba.set_num_threads(workers)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def mask_view(mask: Any) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """``(flat, strides)``: mask element ``[b, h, i, j]`` is ``flat[b*s0 + h*s1 + i*s2 + j*s3]``.

    ``flat`` is a 1-D view of the memory the mask spans (no copy, also for stride-0
    broadcast views); a mask with negative strides is copied first.
    """
    if mask is None:
        return _NO_MASK
    m = numpy_view(mask)
    if m.size == 0:
        return _NO_MASK
    if m.dtype != np.bool_ or any(s < 0 for s in m.strides):
        m = np.ascontiguousarray(m, dtype=np.bool_)
    extent = 1 + sum((n - 1) * s for n, s in zip(m.shape, m.strides, strict=True))
    flat = np.lib.stride_tricks.as_strided(m, shape=(extent,), strides=(1,), writeable=False)
    return readable(flat), tuple(int(s) for s in m.strides)


def compute_arrays(*arrays: Any) -> tuple[np.ndarray, ...]:
    """The arrays as C-contiguous numpy arrays in their accumulator dtype (views when possible).

    Read-only arrays are passed as writable aliases (:func:`~.adapters.readable`): the kernels
    never write their inputs, and one compiled kernel serves both.
    """
    dtype = np.dtype(accumulator(numpy_view(arrays[0]).dtype))
    return tuple(readable(np.ascontiguousarray(numpy_view(a), dtype=dtype)) for a in arrays)


def workers_for(tasks: int, scores: int) -> int:
    """Numba threads worth using: one below :data:`PARALLEL_MIN_SCORES`, never more than tasks."""
    if scores < PARALLEL_MIN_SCORES:
        return 1
    return max(1, min(numba.get_num_threads(), tasks))


def band(causal: Any, window: tuple[int, int], lq: int, lk: int) -> tuple[int, bool, int, int]:
    """``(offset, causal, left, right)``: query ``i``'s diagonal is key ``i + offset``."""
    offset = 0 if causal == "top_left" else lk - lq
    return offset, causal is not None, int(window[0]), int(window[1])


def attention(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    mask: Any,
    softcap: Any,
    return_lse: bool,
) -> tuple[Any, Any]:
    """``softmax(scale q k^T) v`` per head, and the natural-log log-sum-exp of each row."""
    qn, kn, vn = compute_arrays(q, k, v)
    bsz, hq, lq, _ = qn.shape
    lk, dv = kn.shape[2], vn.shape[3]
    result = Output((bsz, hq, lq, dv), q.dtype, q, qn.dtype)
    lse, lse_s = empty((bsz, hq, lq), accumulator_dtype(xp, q.dtype), q)
    offset, is_causal, left, right = band(causal, window, lq, lk)
    forward_into(qn, kn, vn, result.storage, lse_s, scale, offset, is_causal, left, right,
                 softcap, mask)
    return result.finish(), (lse if return_lse else None)


def forward_into(
    qn: np.ndarray, kn: np.ndarray, vn: np.ndarray, out: np.ndarray, lse: np.ndarray,
    scale: float, offset: int, is_causal: bool, left: int, right: int, softcap: Any,
    mask: Any = None,
) -> None:
    """Run the compiled forward on C-contiguous arrays in the accumulator dtype.

    Writes ``out [B, Hq, Lq, Dv]`` and the natural-log ``lse [B, Hq, Lq]`` (both in the
    accumulator dtype); query ``i``'s diagonal is key ``i + offset`` (:func:`band`).  Dense
    attention and each key chunk of paged attention (:mod:`.paged`) run through here.
    """
    from . import attention_kernels as kernels  # compiled on first use, not on import

    bsz, hq, lq, d = qn.shape
    lk, dv = kn.shape[2], vn.shape[3]
    flat, strides = mask_view(mask)
    tile_q, tile_k = kernels.TILE_Q, -(-kernels.TILE_K // 16) * 16
    workers = workers_for(bsz * hq * math.ceil(lq / tile_q), bsz * hq * lq * lk)
    # float32 keys and values in panels for the register-blocked products
    # (attention_microkernels.py); float64, and value dims not a multiple of 16, use BLAS
    heads, keys = kn.shape[0] * kn.shape[1], 16 * math.ceil(lk / 16)
    f32 = qn.dtype == np.float32
    kp = np.empty((heads, keys * d) if f32 and d else (0, 0), dtype=np.float32)
    vp = np.empty((heads, keys * dv) if f32 and dv and dv % 16 == 0 else (0, 0),
                  dtype=np.float32)
    with single_threaded_blas(workers), numba_threads(workers):
        kernels.forward(qn, kn, vn, out, lse, float(scale), offset, is_causal, left,
                        right, float(softcap or 0.0), flat, strides, mask is not None, workers,
                        tile_q, tile_k, kp, vp)


def attention_vjp(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    mask: Any,
    softcap: Any,
    dlse: Any = None,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of attention by recomputation from ``lse`` (natural log); the lse's
    cotangent ``dlse``, where given, enters as ``D = rowsum(dout * out) - dlse``."""
    from . import attention_grad_kernels as kernels

    qn, kn, vn, on, don = compute_arrays(q, k, v, out, dout)
    lse_n = readable(np.ascontiguousarray(numpy_view(lse), dtype=qn.dtype))
    bsz, hq, lq, d = qn.shape
    hk, lk = kn.shape[1], kn.shape[2]
    # D_i = <dout_i, out_i>; 0 on rows with no key (their gradient is 0 whatever out holds)
    delta = np.einsum("bhid,bhid->bhi", don, on)
    if dlse is not None:
        delta -= numpy_view(dlse).astype(delta.dtype, copy=False)
    delta[lse_n == -np.inf] = 0
    grads = [Output(a.shape, x.dtype, q, qn.dtype) for a, x in ((qn, q), (kn, k), (vn, v))]
    flat, strides = mask_view(mask)
    offset, is_causal, left, right = band(causal, window, lq, lk)
    tile_q, tile_k = kernels.TILE_Q, kernels.TILE_K
    workers = workers_for(bsz * hk * math.ceil(lk / tile_k), bsz * hq * lq * lk)
    parts = np.zeros((workers, bsz, hq, lq, d), dtype=qn.dtype)
    with single_threaded_blas(workers), numba_threads(workers):
        kernels.backward(qn, kn, vn, don, lse_n, delta, parts, grads[1].storage,
                         grads[2].storage, float(scale), offset, is_causal, left, right,
                         float(softcap or 0.0), flat, strides, mask is not None, workers,
                         tile_q, tile_k)
    np.sum(parts, axis=0, out=grads[0].storage)
    return tuple(g.finish() for g in grads)
