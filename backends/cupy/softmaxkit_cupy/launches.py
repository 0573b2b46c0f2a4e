"""Kernel launches with the arguments packed into one buffer, through the driver.

``cupy.RawKernel.__call__`` wraps every argument and resolves the stream and the function on
each call, which costs more than the launch itself for a small row.  Here each kernel family
states its parameter list once, as :mod:`struct` codes (``"Q"`` an address, ``"q"`` a
``long long``, ``"i"`` an ``int``, ``"f"`` a ``float``); a call packs its values into this
thread's parameter buffer for that list (:mod:`softmaxkit.kernel_params`) and launches the
kernel's function, cached per device, on the caller's stream.
"""

from __future__ import annotations

from typing import Any

from softmaxkit.kernel_params import param_buffer

_functions: dict[tuple[int, int], tuple[Any, int]] = {}


def function(kernel: Any, device: int) -> int:
    """The driver function of ``kernel`` (a ``cupy.RawKernel``) on ``device``, the current
    device (loaded there by CuPy on first use, then cached)."""
    key = (id(kernel), device)
    found = _functions.get(key)
    if found is None:
        found = _functions[key] = (kernel, kernel.kernel.ptr)  # the kernel kept alive
    return found[1]


def launch(kernel: Any, device: int, stream: int, grid: int | tuple[int, int, int],
           block: int, codes: str, args: tuple[Any, ...], shared: int = 0) -> None:
    """Queue ``kernel`` on ``grid`` blocks (a count, or x, y, z) of ``block`` threads on
    ``stream`` (a raw handle) of the current device ``device``, with ``args`` packed as the
    parameter list ``codes``."""
    from cupy.cuda import driver

    gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
    params = param_buffer(codes).pack(args)
    driver.launchKernel(function(kernel, device), gx, gy, gz, block, 1, 1, shared, stream,
                        params, 0)
