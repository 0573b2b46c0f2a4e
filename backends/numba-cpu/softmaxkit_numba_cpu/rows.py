"""The backend's row kernels as softmaxkit calls them: ``fn(*, xp, **params)`` on ``[..., N]``.

Each function adapts the arrays (:mod:`.adapters`), picks the threaded or the one-thread
loop (:func:`parallel`) and runs the compiled kernel (:mod:`.row_kernels`); the result is in
the caller's library.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from . import row_kernels as k
from .adapters import accumulator, empty, mask_rows, numpy_view, rows, storage

PARALLEL_MIN_ELEMENTS = 1 << 15
"""Below this many elements one thread is faster than starting Numba's thread pool.

Measured on a 2-core machine: launching a ``prange`` loop costs about 150 us with the
OpenMP layer, about the time one core needs for softmax over 100 000 float32 elements.
"""


def parallel(r: int, n: int) -> bool:
    """Whether a call over ``r`` rows of ``n`` elements should use the threaded loop."""
    return r > 1 and r * n >= PARALLEL_MIN_ELEMENTS and numba.get_num_threads() > 1


def _input(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """The numpy view of ``x`` and its ``[R, N]`` storage rows."""
    view = numpy_view(x)
    return view, rows(storage(view))


def _cast_rows(a: Any, like: np.ndarray, acc: type) -> np.ndarray:
    """``a``'s rows in ``like``'s storage when the dtypes agree, else in the accumulator."""
    view = numpy_view(a)
    if view.dtype == like.dtype:
        return rows(storage(view))
    return rows(view.astype(acc))


def _normalize(which: str, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    view, x2 = _input(x)
    w2, wstep, has_where = mask_rows(where)
    result, out = empty(view.shape, out_dtype, x)
    o2 = out.reshape(x2.shape)
    nan = masked == "nan"
    par = parallel(*x2.shape)
    if which == "softmax":
        exact = out.dtype.kind == "f"
        run = k.softmax_par if par else k.softmax_ser
        run(x2, w2, wstep, has_where, nan, exact, o2)
    else:
        run = k.log_softmax_par if par else k.log_softmax_ser
        run(x2, w2, wstep, has_where, nan, o2)
    return result


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis (see the reference kernel of the same name)."""
    return _normalize("softmax", x, where, masked, out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Log-softmax along the last axis (see the reference kernel of the same name)."""
    return _normalize("log_softmax", x, where, masked, out_dtype)


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """``log |sum b exp(x)|`` along the last axis, and its sign when ``return_sign``."""
    view, x2 = _input(x)
    w2, wstep, has_where = mask_rows(where)
    batch = view.shape[:-1]
    lse, lse_s = empty(batch, out_dtype, x)
    sign, sign_s = empty(batch, out_dtype, x)
    lse_s, sign_s = lse_s.reshape(-1), sign_s.reshape(-1)
    if b is None:
        run = k.logsumexp_par if parallel(*x2.shape) else k.logsumexp_ser
        run(x2, w2, wstep, has_where, lse_s, sign_s)
    else:
        b2 = rows(numpy_view(b).astype(accumulator(view.dtype.name)))
        k.logsumexp_b_ser(x2, b2, w2, wstep, has_where, bool(return_sign), lse_s, sign_s)
    return (lse, sign) if return_sign else lse


def cross_entropy(
    xp: Any,
    *,
    logits: Any,
    index: Any,
    probs: Any,
    where: Any,
    ignore_index: int | None,
    label_smoothing: float,
    grad_scale: Any,
    out_dtype: Any,
) -> tuple[Any, Any]:
    """Per-row cross-entropy from logits and, when ``grad_scale`` is given, its gradient."""
    view, x2 = _input(logits)
    acc = accumulator(view.dtype.name)
    w2, wstep, has_where = mask_rows(where)
    r = x2.shape[0]
    if index is not None:
        target = numpy_view(index).astype(np.int64).reshape(-1)
        p2, pstep = np.zeros((1, 0), dtype=acc), 0
    else:
        target = np.zeros(1, dtype=np.int64)
        p2, pstep = rows(numpy_view(probs).astype(acc)), 1
    loss_dtype = xp.float64 if acc is np.float64 else xp.float32
    loss, loss_s = empty(view.shape[:-1], loss_dtype, logits)
    want_grad = grad_scale is not None
    if want_grad:
        grad, grad_s = empty(view.shape, out_dtype, logits)
        grad_s, gstep = grad_s.reshape(x2.shape), 1
    else:
        grad = None
        _, grad_s = empty((1, 0), out_dtype, logits)
        gstep = 0
    run = k.cross_entropy_par if parallel(*x2.shape) else k.cross_entropy_ser
    run(
        x2, w2, wstep, has_where, target, p2, pstep, index is not None,
        acc(label_smoothing), -1 if ignore_index is None else int(ignore_index),
        ignore_index is not None, acc(float(grad_scale) if want_grad else 0.0), want_grad,
        loss_s.reshape(r), grad_s, gstep,
    )
    return loss, grad


def _vjp(which: str, primal: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    view, p2 = _input(primal)
    c2 = _cast_rows(cotangent, view, accumulator(view.dtype.name))
    w2, wstep, has_where = mask_rows(where)
    result, out = empty(view.shape, out_dtype, primal)
    o2 = out.reshape(p2.shape)
    par = parallel(*p2.shape)
    if which == "softmax":
        run = k.softmax_vjp_par if par else k.softmax_vjp_ser
    else:
        run = k.log_softmax_vjp_par if par else k.log_softmax_vjp_ser
    run(p2, c2, w2, wstep, has_where, o2)
    return result


def softmax_vjp(xp: Any, *, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """``p * (g - sum(p * g))`` along the last axis."""
    return _vjp("softmax", probs, cotangent, where, out_dtype)


def log_softmax_vjp(
    xp: Any, *, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """``g - exp(logp) * sum(g)`` along the last axis."""
    return _vjp("log_softmax", logprobs, cotangent, where, out_dtype)

