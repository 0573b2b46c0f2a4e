"""The backend's summary kernels as softmaxkit calls them (contract: softmaxkit.ops).

``summarize``, ``merge``, ``normalize``, ``merge_attention`` and ``merge_attention_vjp`` adapt
the arrays (:mod:`.adapters`), choose the threaded or the one-thread loop and run the
compiled kernels of :mod:`.summary_kernels`; results are in the caller's library.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import summary_kernels as k
from .adapters import (
    Output,
    accumulator,
    compute_input,
    mask_rows,
    numpy_view,
    readable,
    rows,
    storage,
)
from .rows import PARALLEL_MIN_ELEMENTS, num_threads, parallel

PIECE_MIN = 1 << 17
"""Shortest piece of a row that a thread summarizes on its own (about the cost of a launch)."""

_NO_NUM = np.zeros((1, 1, 0))


def _contiguous(a: Any) -> np.ndarray:
    """The kernel's C-contiguous storage view of a numpy array or torch CPU tensor."""
    return readable(np.ascontiguousarray(storage(numpy_view(a))))


def _pieces(r: int, n: int) -> int:
    """Pieces per row so that every thread has work: 1 unless rows are fewer than threads."""
    threads = num_threads()
    if r == 0 or r >= threads:  # no rows: nothing to split
        return 1
    return max(1, min(-(-threads // r), n // PIECE_MIN))


def _elementwise_parallel(r: int, n: int) -> bool:
    """Whether ``normalize`` should use threads: it splits rows too, so one row may do."""
    return r * n >= PARALLEL_MIN_ELEMENTS and num_threads() > 1


def _from_numpy(a: np.ndarray, like: Any) -> Any:
    """``a`` (numpy, float32 or float64) in ``like``'s library, without a copy for torch."""
    if isinstance(like, np.ndarray):
        return a
    import torch

    return torch.from_numpy(a)


def summarize(xp: Any, *, x: Any, where: Any, values: Any) -> tuple[Any, Any, Any]:
    """``(max, mass, numerator)`` of each row of ``x`` [R, N], reading ``x`` once.

    See :func:`softmaxkit.reference.summary.summarize`; fields in the accumulator dtype.
    """
    view = numpy_view(x)
    acc = np.dtype(accumulator(view.dtype))
    x2 = rows(storage(view))
    r, n = x2.shape
    w2, wstep, has_where = mask_rows(where)
    if values is not None:
        v3 = _contiguous(values)
        dv, vstep = v3.shape[-1], 1
    else:
        v3, dv, vstep = np.zeros((1, 1, 1), dtype=x2.dtype), 0, 0
    pieces = _pieces(r, n)
    par = pieces > 1 or parallel(r, n)
    pm = np.empty((pieces, r), dtype=acc)
    ps = np.empty((pieces, r))
    pnum = np.empty((pieces, r, dv))
    run = k.summarize_par if par else k.summarize_ser
    run(x2, w2, wstep, has_where, v3, vstep, values is not None, pm, ps, pnum)
    if pieces == 1:
        m, mass, num = pm[0], ps[0], pnum[0]
    else:
        m, mass, num = np.empty(r, dtype=acc), np.empty(r), np.empty((r, dv))
        k.merge_ser(pm, ps, pnum, values is not None, m, mass, num)
    m = np.ascontiguousarray(m)
    result = (m, mass.astype(acc), num.astype(acc) if values is not None else None)
    return tuple(None if a is None else _from_numpy(a, x) for a in result)


def merge(xp: Any, *, maxes: Any, masses: Any, numerators: Any) -> tuple[Any, Any, Any]:
    """Merge ``S`` summaries ``[S, R]`` (numerators ``[S, R, Dv]``) into one, exactly.

    See :func:`softmaxkit.reference.summary.merge`; the result has ``maxes``' dtype.
    Summaries held in a 16-bit dtype are merged in float32 and each merged field is rounded
    once to their dtype (spec: Merge).
    """
    mx, ms, nums = (None if a is None else _in_accumulator(a)
                    for a in (maxes, masses, numerators))
    dtype = mx.dtype
    has_num = nums is not None
    if nums is None:
        nums = _NO_NUM.astype(dtype)
    s, r = mx.shape
    dv = nums.shape[-1]
    m, mass = (Output((r,), maxes.dtype, maxes, dtype) for _ in range(2))
    num = Output((r, dv) if has_num else (1, 0), maxes.dtype, maxes, dtype)
    # a part of a row costs an exponential and Dv products: about 64 row elements' work each
    run = k.merge_par if parallel(r, s * (dv + 1) * 64) else k.merge_ser
    run(mx, ms, nums, has_num, m.storage, mass.storage, num.storage)
    return m.finish(), mass.finish(), num.finish() if has_num else None


def normalize(
    xp: Any, *, x: Any, where: Any, maxes: Any, masses: Any, log: bool, masked: str,
    out_dtype: Any,
) -> Any:
    """Softmax (log_softmax) of the rows of ``x`` against their summaries, in one pass.

    See :func:`softmaxkit.reference.summary.normalize`.

    Raises
    ------
    ValueError
        When the summaries do not cover ``x``.
    """
    view = numpy_view(x)
    xin = compute_input(view, out_dtype)
    x2 = rows(storage(xin))
    r, n = x2.shape
    w2, wstep, has_where = mask_rows(where)
    acc = np.dtype(accumulator(view.dtype))
    mx = np.ascontiguousarray(numpy_view(maxes), dtype=acc)
    ms = np.ascontiguousarray(numpy_view(masses), dtype=acc)
    out = Output(view.shape, out_dtype, x, xin.dtype)
    o2 = out.storage.reshape(x2.shape)
    if _elementwise_parallel(r, n):
        ok = np.empty(r * max(1, -(-n // k.TILE)), dtype=np.bool_)
        k.normalize_par(x2, w2, wstep, has_where, mx, ms, bool(log), masked == "nan", o2, ok)
    else:
        ok = np.empty(r, dtype=np.bool_)
        k.normalize_ser(x2, w2, wstep, has_where, mx, ms, bool(log), masked == "nan", o2, ok)
    if not ok.all():
        raise ValueError(
            "the summaries do not cover x: an allowed logit is above its row's maximum or NaN "
            "(pass the summary of a set of positions that contains the row's)"
        )
    return out.finish()


def _in_accumulator(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous numpy array in its accumulator dtype.

    The attention merges are small next to the attention that made their parts, so 16-bit
    parts are widened once here rather than compiled for.
    """
    view = numpy_view(a)
    return readable(np.ascontiguousarray(view, dtype=accumulator(view.dtype)))


def merge_attention(xp: Any, *, outs: Any, lses: Any) -> tuple[Any, Any]:
    """Merge partial attention states ``outs [S, R, Dv]``, ``lses [S, R]`` into ``(out, lse)``.

    See :func:`softmaxkit.reference.attention.merge_attention`.
    """
    o3, l2 = _in_accumulator(outs), _contiguous(lses)
    s, r, dv = o3.shape
    out = Output((r, dv), outs.dtype, outs, o3.dtype)
    lse = np.empty(r, dtype=l2.dtype)
    run = k.merge_attention_par if parallel(r, s * dv * 16) else k.merge_attention_ser
    run(o3, l2, out.storage, lse)
    return out.finish(), _from_numpy(lse, lses)


def merge_attention_vjp(
    xp: Any, *, outs: Any, lses: Any, dout: Any, dlse: Any
) -> tuple[Any, Any]:
    """Gradient of :func:`merge_attention`: ``(douts [S, R, Dv], dlses [S, R])``.

    See :func:`softmaxkit.reference.attention.merge_attention_vjp`.
    """
    o3, l2 = _in_accumulator(outs), _contiguous(lses)
    d2 = readable(np.ascontiguousarray(numpy_view(dout), dtype=o3.dtype))
    s, r, dv = o3.shape
    dl = _contiguous(dlse) if dlse is not None else np.zeros(1, dtype=l2.dtype)
    douts = Output((s, r, dv), outs.dtype, outs, o3.dtype)
    dlses = np.empty((s, r), dtype=l2.dtype)
    par = parallel(r, s * dv * 16)
    run = k.merge_attention_vjp_par if par else k.merge_attention_vjp_ser
    run(o3, l2, d2, dl, dlse is not None, douts.storage, dlses)
    return douts.finish(), _from_numpy(dlses, lses)
