"""The summary kernels in the form the registry calls (``summarize``, ``merge``,
``normalize``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from softmaxkit.dtypes import accumulator_name, lookup

from . import summary_kernels
from .arrays import capturing, dummy, empty, kernel_view, library, rows, run, stream_of
from .rows import dtype_name, row_reduce
from .settings import SETTINGS, Settings


def _contiguous(a: Any, lib: str) -> Any:
    if lib == "torch":
        return a.detach().contiguous()
    if lib == "cupy":
        import cupy

        return cupy.ascontiguousarray(a)
    return np.ascontiguousarray(a)


def summarize(*, xp: Any, x: Any, where: Any, values: Any,
              settings: Settings = SETTINGS) -> tuple[Any, Any, Any]:
    """``(max [R], mass [R], numerator [R, Dv] or None)`` of each row of ``x`` [R, N]."""
    lib = library(x)
    kin = dtype_name(x.dtype)
    acc = lookup(xp, accumulator_name(kin))
    n_rows, n = x.shape
    m = empty(xp, x, (n_rows,), acc)
    mass = empty(xp, x, (n_rows,), acc)
    num = None
    if values is not None:
        num = empty(xp, x, (n_rows, values.shape[-1]), acc)
    if n_rows == 0:
        return m, mass, num
    row_reduce("summarize", xp, x, where, m, mass, True, settings)
    if num is not None and num.shape[-1] > 0:
        xr = rows(x, lib)
        w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
        stream = stream_of(x, lib)
        run(summary_kernels.numerators(kin), n_rows, 128, stream, kernel_view(xr, lib), w,
            where is not None, kernel_view(_contiguous(values, lib), lib),
            kernel_view(m.reshape(n_rows, 1), lib), kernel_view(num, lib), n)
    return m, mass, num


def merge(*, xp: Any, maxes: Any, masses: Any, numerators: Any) -> tuple[Any, Any, Any]:
    """Merge ``S`` summaries ``[S, R]`` (numerators ``[S, R, Dv]``) into one, exactly.

    The fields come in the accumulator dtype from ``summarize``; summaries a caller built in
    a 16-bit dtype are merged in float32 and returned in their own dtype, as the reference
    returns them.
    """
    lib = library(maxes)
    kind = dtype_name(maxes.dtype)
    n_rows = maxes.shape[1]
    dv = numerators.shape[-1] if numerators is not None else 0
    m = empty(xp, maxes, (n_rows,), maxes.dtype)
    mass = empty(xp, maxes, (n_rows,), maxes.dtype)
    num = empty(xp, maxes, (n_rows, dv), maxes.dtype) if numerators is not None else None
    threads = n_rows * max(dv, 1)
    if threads == 0:
        if num is not None and n_rows:  # Dv = 0: only the maxima and masses
            threads = n_rows
        else:
            return m, mass, num
    device = maxes.device
    nums = (kernel_view(_contiguous(numerators, lib), lib) if numerators is not None
            else dummy(lib, device, kind).reshape(1, 1, 1))
    nv = kernel_view(num, lib) if num is not None else dummy(lib, device, kind)
    stream = stream_of(maxes, lib)
    run(summary_kernels.merge(kind), -(-threads // 256), 256, stream,
        kernel_view(_contiguous(maxes, lib), lib),
        kernel_view(_contiguous(masses, lib), lib), nums, numerators is not None,
        kernel_view(m, lib), kernel_view(mass, lib), nv, n_rows, dv)
    return m, mass, num


UNCOVERED = (
    "the summaries do not cover x: an allowed logit is above its row's maximum or NaN "
    "(pass the summary of a set of positions that contains the row's)"
)


def normalize(*, xp: Any, x: Any, where: Any, maxes: Any, masses: Any, log: bool,
              masked: str, out_dtype: Any) -> Any:
    """Softmax (log_softmax with ``log``) of the rows of ``x`` [R, N] against their summaries
    ``maxes``, ``masses`` [R] (see ``softmaxkit.reference.summary.normalize``).

    The kernel flags a summary that does not cover its row in a device word, which is read
    back after the launch (the one synchronization of the call); on a stream that is
    capturing a CUDA graph it cannot be read, and the check is skipped.

    Raises
    ------
    ValueError
        When an allowed logit is above its row's maximum, or NaN under a maximum that is not.
    """
    lib = library(x)
    kin, kout = dtype_name(x.dtype), dtype_name(out_dtype)
    acc_name = accumulator_name(kin)
    n_rows, n = int(x.shape[0]), int(x.shape[-1])
    out = empty(xp, x, (n_rows, n), out_dtype)
    if n_rows == 0 or n == 0:
        return out
    acc = lookup(xp, acc_name)
    if dtype_name(maxes.dtype) != acc_name:
        maxes = xp.astype(maxes, acc)
    if dtype_name(masses.dtype) != acc_name:
        masses = xp.astype(masses, acc)
    device = getattr(x, "device", None)
    uncovered = xp.zeros((1,), dtype=lookup(xp, "int32"), device=device)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, device)
    tiles = -(-n // (summary_kernels.NORMALIZE_THREADS * summary_kernels.NORMALIZE_ITEMS))
    kernel_fn = summary_kernels.normalize(kin, kout, bool(log), masked == "nan",
                                          where is not None)
    run(kernel_fn, n_rows * tiles, summary_kernels.NORMALIZE_THREADS, stream_of(x, lib),
        kernel_view(rows(x, lib), lib), w, kernel_view(_contiguous(maxes, lib), lib),
        kernel_view(_contiguous(masses, lib), lib), kernel_view(out, lib),
        kernel_view(uncovered, lib), n, tiles)
    if not capturing(lib) and int(uncovered[0]):
        raise ValueError(UNCOVERED)
    return out
