"""The backend's kernels in the form the registry calls: ``fn(*, xp, **params)``.

Each function takes the frontend's ``[..., N]`` arrays (validated, dtype policy applied),
views them as ``[rows, N]`` without copying when they are contiguous -- as rows of 8-byte
words when the dtype allows (float32, bfloat16) -- chooses the plan for the row length
(:mod:`.plan`), and launches the row kernel on the caller's device and current stream.
Results are arrays of the caller's library.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from softmaxkit.dtypes import FLOAT_DTYPES, accumulator_name, lookup
from softmaxkit.dtypes import dtype_name as _dtype_name

from . import plan as plans
from . import rowkernels
from .arrays import (
    dummy,
    empty,
    kernel_view,
    launch,
    library,
    rows,
    run,
    vectorizable,
    words,
)
from .intrinsics import SIMULATOR
from .storage import VECTOR_WIDTH

MAX_VALUES = 16
"""Values a thread holds in registers per tile (half of it for float64); twice as many for
rows that would otherwise not fit one block (up to 32768 elements), so they are read once."""


def dtype_name(dtype: Any) -> str:
    """The name of a dtype, also for numpy scalar types such as ``np.float32``."""
    name = _dtype_name(dtype)
    if name not in FLOAT_DTYPES and isinstance(dtype, type):
        name = np.dtype(dtype).name
    return name


def _plan(n_words: int, kind: str, width: int = 1, arrays: int = 1,
          grow: bool = True) -> plans.Plan:
    """The plan for rows of ``n_words`` words of ``width`` values of storage ``kind``."""
    values = MAX_VALUES // arrays // (2 if kind == "float64" else 1)
    if grow and n_words * width > plans.MAX_THREADS * values and arrays == 1:
        values *= 2
    return plans.choose(n_words, simulator=SIMULATOR, max_slots=max(1, values // width))


def _layout(lib: str, kin: str, kout: str, arrays: list[Any]) -> tuple[bool, int, list[Any]]:
    """Whether to use word loads, the word width, and the kernel views of ``arrays``."""
    width = VECTOR_WIDTH.get(kin, 1)
    vector = kin == kout and vectorizable(arrays, lib, width)
    if not vector:
        return False, 1, [kernel_view(a, lib) for a in arrays]
    return True, width, [kernel_view(words(a, lib), lib) for a in arrays]


def _normalize(op: str, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    lib = library(x)
    out = empty(xp, x, tuple(x.shape), out_dtype)
    if out.size == 0:
        return out
    xr = rows(x, lib)
    n_rows, n = xr.shape
    kin, kout = dtype_name(x.dtype), dtype_name(out_dtype)
    vector, width, (xv, ov) = _layout(lib, kin, kout, [xr, out.reshape(n_rows, n)])
    p = _plan(n // width, kin, width)
    kernel = rowkernels.normalize(op, kin, kout, vector, p.threads, p.slots,
                                  p.rows_per_block, p.cached)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    with launch(x, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            xv, w, where is not None, masked == "nan", ov, n_rows, n // width, p.tiles)
    return out


def softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis (see ``softmaxkit.reference.rows.softmax``)."""
    return _normalize("softmax", xp, x, where, masked, out_dtype)


def log_softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Log-softmax along the last axis (see ``softmaxkit.reference.rows.log_softmax``)."""
    return _normalize("log_softmax", xp, x, where, masked, out_dtype)


def logsumexp(
    *, xp: Any, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """``log |sum(b * exp(x))|`` along the last axis, and its sign with ``return_sign``."""
    lib = library(x)
    batch = tuple(x.shape[:-1])
    out = empty(xp, x, batch, out_dtype)
    sign = empty(xp, x, batch, out_dtype) if return_sign else None
    if out.size == 0:
        return (out, sign) if return_sign else out
    xr = rows(x, lib)
    n_rows, n = xr.shape
    kin, kout = dtype_name(x.dtype), dtype_name(out_dtype)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    s = (kernel_view(sign.reshape(n_rows, 1), lib) if return_sign
         else dummy(lib, x.device, kout))
    if b is not None:
        p = _plan(n, kout, arrays=2)
        kernel = rowkernels.logsumexp_weighted(kin, dtype_name(b.dtype), kout, p.threads,
                                               p.slots, p.rows_per_block)
        with launch(x, lib) as stream:
            run(kernel, p.grid(n_rows), p.block, stream,
                kernel_view(xr, lib), kernel_view(rows(b, lib), lib), w, where is not None,
                kernel_view(out.reshape(n_rows, 1), lib), s, bool(return_sign), n_rows, n,
                p.tiles)
        return (out, sign) if return_sign else out
    vector, width, (xv,) = _layout(lib, kin, kin, [xr])
    p = _plan(n // width, kin, width)
    kernel = rowkernels.logsumexp(kin, kout, vector, p.threads, p.slots, p.rows_per_block,
                                  p.cached)
    with launch(x, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            xv, w, where is not None, kernel_view(out.reshape(n_rows, 1), lib), s,
            bool(return_sign), n_rows, n // width, p.tiles)
    return (out, sign) if return_sign else out


def cross_entropy(
    *,
    xp: Any,
    logits: Any,
    index: Any,
    probs: Any,
    where: Any,
    ignore_index: int | None,
    label_smoothing: float,
    grad_scale: Any,
    out_dtype: Any,
) -> tuple[Any, Any]:
    """Per-row loss and, when ``grad_scale`` is given, the fused gradient, in one kernel."""
    lib = library(logits)
    if xp is None:
        import array_api_compat

        xp = array_api_compat.array_namespace(logits)
    kin, kout = dtype_name(logits.dtype), dtype_name(out_dtype)
    acc = lookup(xp, accumulator_name(kin))
    batch = tuple(logits.shape[:-1])
    loss = empty(xp, logits, batch, acc)
    grad = empty(xp, logits, tuple(logits.shape), out_dtype) if grad_scale is not None else None
    if loss.size == 0:
        return loss, grad
    xr = rows(logits, lib)
    n_rows, n = xr.shape
    device = getattr(logits, "device", None)
    if grad is not None:
        vector, width, (xv, gv) = _layout(lib, kin, kout, [xr, grad.reshape(n_rows, n)])
    else:
        vector, width, (xv,) = _layout(lib, kin, kin, [xr])
        gv = dummy(lib, device, "int64" if vector else kout)
    p = _plan(n // width, kin, width, grow=False)  # its second pass needs more registers
    kp = dtype_name(probs.dtype) if probs is not None else ""
    kernel = rowkernels.cross_entropy(kin, kout, vector, p.threads, p.slots,
                                      p.rows_per_block, p.cached, kp)
    if grad_scale is None or not hasattr(grad_scale, "shape"):
        value = 1.0 if grad_scale is None else float(grad_scale)
        scale = xp.full((1,), value, dtype=acc, device=device)
    else:
        scale = xp.reshape(xp.astype(grad_scale, acc), (1,))
    if index is not None:
        idx = xp.reshape(xp.astype(index, xp.int64), (-1,))
        if lib == "torch":
            idx = idx.contiguous()
        idx = kernel_view(idx, lib)
    else:
        idx = kernel_view(xp.zeros((1,), dtype=xp.int64, device=device), lib)
    pv = kernel_view(rows(probs, lib), lib) if probs is not None else dummy(lib, device, kin)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, device)
    ignore = 0 if ignore_index is None else int(ignore_index)
    with launch(logits, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            xv, w, where is not None, idx, pv, kernel_view(scale, lib),
            kernel_view(loss.reshape(n_rows, 1), lib), gv, grad is not None,
            n_rows, n // width, p.tiles, float(label_smoothing), ignore_index is not None,
            ignore)
    return loss, grad


def _vjp(op: str, xp: Any, y: Any, c: Any, where: Any, out_dtype: Any) -> Any:
    lib = library(y)
    out = empty(xp, y, tuple(y.shape), out_dtype)
    if out.size == 0:
        return out
    yr, cr = rows(y, lib), rows(c, lib)
    n_rows, n = yr.shape
    p = _plan(n, dtype_name(y.dtype), arrays=2)
    kernel = rowkernels.vjp(
        op, dtype_name(y.dtype), dtype_name(c.dtype), dtype_name(out_dtype), p.threads,
        p.slots, p.rows_per_block, p.cached,
    )
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, y.device)
    with launch(y, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            kernel_view(yr, lib), kernel_view(cr, lib), w, where is not None,
            kernel_view(out.reshape(n_rows, n), lib), n_rows, n, p.tiles)
    return out


def softmax_vjp(*, xp: Any, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """``p * (c - sum(p * c))`` along the last axis."""
    return _vjp("softmax_vjp", xp, probs, cotangent, where, out_dtype)


def log_softmax_vjp(
    *, xp: Any, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """``c - exp(logp) * sum(c)`` along the last axis."""
    return _vjp("log_softmax_vjp", xp, logprobs, cotangent, where, out_dtype)


__all__ = [
    "cross_entropy",
    "log_softmax",
    "log_softmax_vjp",
    "logsumexp",
    "softmax",
    "softmax_vjp",
]
