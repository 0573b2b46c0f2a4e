"""Kernel launches with the arguments packed into one buffer, through the driver.

``cupy.RawKernel.__call__`` wraps every argument and resolves the stream and the function on
each call, which costs more than the launch itself for a small row.  Here each kernel family
states its parameter list once, as :mod:`struct` codes (``"Q"`` an address, ``"q"`` a
``long long``, ``"i"`` an ``int``, ``"f"`` a ``float``); a call packs its values into this
thread's parameter buffer for that list (:mod:`softmaxkit.kernel_params`) and launches the
kernel's function, cached per device, on the caller's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from softmaxkit.kernel_params import param_buffer

_functions: dict[tuple[int, int], list[Any]] = {}
_launch_kernel: Callable[..., None] | None = None

DEFAULT_SHARED = 48 * 1024
"""Dynamic shared memory a kernel may take without raising its limit."""


def function(kernel: Any, device: int, shared: int = 0) -> int:
    """The driver function of ``kernel`` (a ``cupy.RawKernel``) on ``device``, the current
    device (loaded there by CuPy on first use, then cached), its limit of dynamic shared
    memory raised there to ``shared`` bytes where that is above the default (which the
    kernel's static shared memory takes its share of)."""
    key = (id(kernel), device)
    found = _functions.get(key)
    if found is None:  # the kernel kept alive, its function, the limit set on this device
        ptr = kernel.kernel.ptr
        found = _functions[key] = [kernel, ptr, DEFAULT_SHARED - kernel.shared_size_bytes]
    if shared > found[2]:
        kernel.max_dynamic_shared_size_bytes = shared
        found[2] = shared
    return found[1]


def launch(kernel: Any, device: int, stream: int, grid: int | tuple[int, int, int],
           block: int, codes: str, args: tuple[Any, ...], shared: int = 0) -> None:
    """Queue ``kernel`` on ``grid`` blocks (a count, or x, y, z) of ``block`` threads on
    ``stream`` (a raw handle) of the current device ``device``, with ``args`` packed as the
    parameter list ``codes`` and ``shared`` bytes of dynamic shared memory."""
    gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
    launch_function(function(kernel, device, shared), stream, gx, gy, gz, block, codes, args,
                    shared)


def launch_function(func: int, stream: int, gx: int, gy: int, gz: int, block: int,
                    codes: str, args: tuple[Any, ...] | list[Any], shared: int = 0) -> None:
    """:func:`launch` of a driver function ``func`` from :func:`function` (its shared-memory
    limit already raised to ``shared``) on the current device: what a launch kept for a
    repeated call runs."""
    global _launch_kernel
    if _launch_kernel is None:
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    _launch_kernel(func, gx, gy, gz, block, 1, 1, shared, stream, param_buffer(codes).pack(args),
                   0)
