"""The backend's kernels in the form the registry calls: ``fn(*, xp, **params)``.

Each function takes the frontend's ``[..., N]`` arrays (validated, dtype policy applied),
views them as ``[rows, N]`` without copying when they are contiguous, chooses the plan for
``N`` (:mod:`.plan`), and launches the row kernel on the caller's device and current stream.
Results are arrays of the caller's library.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from softmaxkit.dtypes import FLOAT_DTYPES, accumulator_name, lookup
from softmaxkit.dtypes import dtype_name as _dtype_name

from . import plan as plans
from . import rowkernels
from .arrays import dummy, empty, kernel_view, launch, library, rows, run
from .intrinsics import SIMULATOR


def dtype_name(dtype: Any) -> str:
    """The name of a dtype, also for numpy scalar types such as ``np.float32``."""
    name = _dtype_name(dtype)
    if name not in FLOAT_DTYPES and isinstance(dtype, type):
        name = np.dtype(dtype).name
    return name


def _plan(n: int, kind: str, arrays: int = 1) -> plans.Plan:
    """The plan for rows of ``n`` of storage ``kind``, caching ``arrays`` arrays per row."""
    slots = plans.MAX_SLOTS // arrays // (2 if kind == "float64" else 1)
    return plans.choose(n, simulator=SIMULATOR, max_slots=slots)


def _normalize(op: str, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    lib = library(x)
    out = empty(xp, x, tuple(x.shape), out_dtype)
    if out.size == 0:
        return out
    xr = rows(x, lib)
    n_rows, n = xr.shape
    p = _plan(n, dtype_name(x.dtype))
    kernel = rowkernels.normalize(
        op, dtype_name(x.dtype), dtype_name(out_dtype), p.threads, p.slots,
        p.rows_per_block, p.cached,
    )
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    with launch(x, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            kernel_view(xr, lib), w, where is not None, masked == "nan",
            kernel_view(out.reshape(n_rows, n), lib), n_rows, n, p.tiles,
        )
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
    """``log(sum(exp(x)))`` along the last axis; weights ``b`` are declined by ``can_run``."""
    if b is not None:
        raise ValueError("numba-cuda logsumexp does not take weights b; use another backend")
    lib = library(x)
    batch = tuple(x.shape[:-1])
    out = empty(xp, x, batch, out_dtype)
    sign = empty(xp, x, batch, out_dtype) if return_sign else None
    if out.size:
        xr = rows(x, lib)
        n_rows, n = xr.shape
        p = _plan(n, dtype_name(x.dtype))
        kernel = rowkernels.logsumexp(
            dtype_name(x.dtype), dtype_name(out_dtype), p.threads, p.slots, p.rows_per_block,
        )
        kout = dtype_name(out_dtype)
        w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
        s = (kernel_view(sign.reshape(n_rows, 1), lib) if return_sign
             else dummy(lib, x.device, kout))
        with launch(x, lib) as stream:
            run(kernel, p.grid(n_rows), p.block, stream,
                kernel_view(xr, lib), w, where is not None,
                kernel_view(out.reshape(n_rows, 1), lib), s, bool(return_sign),
                n_rows, n, p.tiles,
            )
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
    if probs is not None:
        raise ValueError("numba-cuda cross_entropy takes class-index targets only")
    lib = library(logits)
    kin = dtype_name(logits.dtype)
    acc = lookup(xp, accumulator_name(kin))
    batch = tuple(logits.shape[:-1])
    loss = empty(xp, logits, batch, acc)
    grad = empty(xp, logits, tuple(logits.shape), out_dtype) if grad_scale is not None else None
    if loss.size == 0:
        return loss, grad
    xr = rows(logits, lib)
    n_rows, n = xr.shape
    p = _plan(n, kin)
    kernel = rowkernels.cross_entropy(
        kin, dtype_name(out_dtype), p.threads, p.slots, p.rows_per_block, p.cached,
    )
    device = getattr(logits, "device", None)
    if grad_scale is None or not hasattr(grad_scale, "shape"):
        value = 1.0 if grad_scale is None else float(grad_scale)
        scale = xp.full((1,), value, dtype=acc, device=device)
    else:
        scale = xp.reshape(xp.astype(grad_scale, acc), (1,))
    idx = xp.reshape(xp.astype(index, xp.int64), (-1,))
    if lib == "torch":
        idx = idx.contiguous()
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, device)
    g = (kernel_view(grad.reshape(n_rows, n), lib) if grad is not None
         else dummy(lib, device, dtype_name(out_dtype)))
    ignore = 0 if ignore_index is None else int(ignore_index)
    with launch(logits, lib) as stream:
        run(kernel, p.grid(n_rows), p.block, stream,
            kernel_view(xr, lib), w, where is not None, kernel_view(idx, lib),
            kernel_view(scale, lib), kernel_view(loss.reshape(n_rows, 1), lib), g,
            grad is not None, n_rows, n, p.tiles, float(label_smoothing),
            ignore_index is not None, ignore,
        )
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
            kernel_view(out.reshape(n_rows, n), lib), n_rows, n, p.tiles,
        )
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
