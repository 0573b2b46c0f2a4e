"""Kernel launches with the arguments packed into one buffer, through the driver.

``cupy.RawKernel.__call__`` wraps every argument and resolves the stream and the function on
each call, which costs more than the launch itself for a small row.  Here a call packs its
arguments into this thread's parameter buffer for the kernel's parameter list
(:mod:`softmaxkit.kernel_params`) and launches the kernel's function, cached per device, on
the caller's stream.  The parameter list is given as :mod:`struct` codes, or read from the
types of numpy-scalar arguments (addresses as ``uint64``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from softmaxkit.kernel_params import param_buffer

_CODES = {np.uint64: "Q", np.int64: "q", np.uint32: "I", np.int32: "i", np.float32: "f",
          np.float64: "d"}
"""struct codes of the numpy scalar types a kernel argument may have."""


def codes_of(args: tuple[Any, ...]) -> str:
    """The parameter list of numpy-scalar ``args`` as struct codes."""
    try:
        return "".join([_CODES[type(a)] for a in args])
    except KeyError as e:
        raise TypeError(f"no packed launch for a kernel argument of type {e}") from None


_functions: dict[tuple[int, int], tuple[Any, int]] = {}


def function(kernel: Any, device: int) -> int:
    """The driver function of ``kernel`` (a ``cupy.RawKernel``) on ``device``, the current
    device (loaded there by CuPy on first use, then cached)."""
    key = (id(kernel), device)
    found = _functions.get(key)
    if found is None:
        found = _functions[key] = (kernel, kernel.kernel.ptr)  # the kernel kept alive
    return found[1]


def launch(kernel: Any, device: int, stream: int, grid: int, block: int,
           args: tuple[Any, ...], shared: int = 0, codes: str | None = None) -> None:
    """Queue ``kernel`` on ``grid`` blocks of ``block`` threads on ``stream`` (a raw handle)
    of the current device ``device``, with ``args`` packed as ``codes`` (by default, as the
    types of numpy-scalar ``args`` say)."""
    from cupy.cuda import driver

    params = param_buffer(codes or codes_of(args)).pack(args)
    driver.launchKernel(function(kernel, device), grid, 1, 1, block, 1, 1, shared, stream,
                        params, 0)
