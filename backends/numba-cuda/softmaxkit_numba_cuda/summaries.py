"""The summary kernels in the form the registry calls (``summarize``, ``merge``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from softmaxkit.dtypes import accumulator_name, lookup

from . import summary_kernels
from .arrays import dummy, empty, kernel_view, library, rows, run, stream_of
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
    """Merge ``S`` summaries ``[S, R]`` (numerators ``[S, R, Dv]``) into one, exactly."""
    lib = library(maxes)
    acc_name = dtype_name(maxes.dtype)
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
            else dummy(lib, device, acc_name).reshape(1, 1, 1))
    nv = kernel_view(num, lib) if num is not None else dummy(lib, device, acc_name)
    stream = stream_of(maxes, lib)
    run(summary_kernels.merge(acc_name), -(-threads // 256), 256, stream,
        kernel_view(_contiguous(maxes, lib), lib),
        kernel_view(_contiguous(masses, lib), lib), nums, numerators is not None,
        kernel_view(m, lib), kernel_view(mass, lib), nv, n_rows, dv)
    return m, mass, num
