"""Kernel launches without numba's per-call dispatch.

``kernel[grid, block, stream](*args)`` types every argument, looks the compiled kernel up,
wraps each array in a device array (``as_cuda_array``) and marshals it on every call: over
two hundred microseconds for a small row, where the kernel runs for a few.  Here an array
argument is a :class:`DeviceView` (address, shape, byte strides, dtype), the compiled kernel,
its function on the device and the packing of each argument are found once per argument
signature and device, and a call packs the values as numba's dispatcher would into a
parameter buffer (:mod:`softmaxkit.kernel_params`) and launches with the driver's
``cuLaunchKernel`` (``cuLaunchKernelEx`` with a cluster-dimension attribute for thread-block
clusters).  Not used under Numba's simulator, which runs numba's own launch.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any

import numpy as np

from softmaxkit.kernel_params import param_buffer


class DeviceView:
    """A device array as a kernel argument: its address, shape, strides in bytes and numpy
    dtype, and the object that owns the memory (kept alive until the launch is queued).

    ``key`` is what decides the array's numba type: dtype, rank and layout (``"C"``, ``"F"``
    or ``"A"``, decided as numba decides it for a device array).
    """

    __slots__ = ("dtype", "key", "owner", "ptr", "shape", "size", "strides")

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: np.dtype, owner: Any) -> None:
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.owner = owner
        itemsize = dtype.itemsize
        if len(shape) == 2 and strides[1] == itemsize and strides[0] == shape[1] * itemsize:
            self.size = shape[0] * shape[1]  # the common [rows, n] view, C-contiguous
            order = "C" if self.size else layout(shape, strides, itemsize)
        else:
            self.size = math.prod(shape)
            order = layout(shape, strides, itemsize)
        self.key = (dtype, len(shape), order)

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.shape)

    def view(self, dtype: Any) -> DeviceView:
        """The same memory read as ``dtype`` (of the same item size)."""
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise ValueError(f"cannot view {self.dtype} items as {dtype}")
        return DeviceView(self.ptr, self.shape, self.strides, dtype, self.owner)

    def reshape(self, *shape: int) -> DeviceView:
        """A C-contiguous view of the same elements in ``shape``."""
        if self.key[2] != "C":
            raise ValueError("only a C-contiguous view can be reshaped")
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return DeviceView(self.ptr, shape, c_strides(shape, self.dtype.itemsize), self.dtype,
                          self.owner)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3}


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    out = []
    step = itemsize
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> str:
    """numba's layout letter for a device array: ``"C"`` or ``"F"`` when contiguous that way
    (C first), ``"A"`` otherwise; an array with a zero stride is broadcast, so ``"A"`` unless
    it is empty (numpy's contiguity rules: axes of length one do not count)."""
    if 0 in shape:
        return "C"
    if 0 in strides:
        return "A"
    axes = range(len(shape))
    if _contiguous(shape, strides, itemsize, reversed(axes)):
        return "C"
    if _contiguous(shape, strides, itemsize, axes):
        return "F"
    return "A"


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                axes: Any) -> bool:
    expected = itemsize
    for i in axes:
        if shape[i] != 1:
            if strides[i] != expected:
                return False
            expected *= shape[i]
    return True


_SCALARS: dict[type, tuple[str, str]] = {
    bool: ("boolean", "?"),
    np.bool_: ("boolean", "?"),
    int: ("int64", "q"),
    float: ("float64", "d"),
    np.int32: ("int32", "i"),
    np.int64: ("int64", "q"),
    np.uint32: ("uint32", "I"),
    np.uint64: ("uint64", "Q"),
    np.float32: ("float32", "f"),
    np.float64: ("float64", "d"),
}
"""Scalar argument types: numba's type for them (as ``typeof`` gives it) and their parameter
code (:mod:`struct`)."""


def signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The cache key of an argument list: each array's ``key``, each scalar's type."""
    return tuple(a.key if type(a) is DeviceView else type(a) for a in args)


def argument_types(sig: tuple[Any, ...]) -> tuple[Any, ...]:
    """numba types for a :func:`signature`."""
    from numba import types
    from numba.cuda.np import numpy_support

    out = []
    for k in sig:
        if type(k) is tuple:
            dtype, ndim, order = k
            out.append(types.Array(numpy_support.from_dtype(dtype), ndim, order))
        elif k in _SCALARS:
            out.append(getattr(types, _SCALARS[k][0]))
        else:
            raise TypeError(f"no lean launch for a kernel argument of type {k.__name__}")
    return tuple(out)


def codes(sig: tuple[Any, ...]) -> str:
    """The kernel's parameters for a :func:`signature` as :mod:`struct` codes: an array is
    meminfo, parent, element count, item size, address, then its shape and byte strides
    (numba's flattened array argument), a scalar its own code."""
    return "".join("qqqqQ" + "qq" * k[1] if type(k) is tuple else _SCALARS[k][1] for k in sig)


def values(args: tuple[Any, ...]) -> list[Any]:
    """The parameter values of ``args``, in the order of :func:`codes`: an array is its
    meminfo and parent (null), element count, item size, address, shape and byte strides;
    a scalar itself."""
    out: list[Any] = []
    for a in args:
        if type(a) is DeviceView:
            out += (0, 0, a.size, a.dtype.itemsize, a.ptr, *a.shape, *a.strides)
        else:
            out.append(a)
    return out


class Compiled:
    """One kernel compiled for one argument signature, with its function on one device."""

    __slots__ = ("attributes", "codes", "compiled", "function", "handle")

    def __init__(self, kernel: Any, sig: tuple[Any, ...]) -> None:
        self.compiled = kernel.compile(argument_types(sig))
        self.function = self.compiled._codelibrary.get_cufunc()  # the current device's
        self.handle = int(self.function.handle)
        self.codes = codes(sig)
        # the function's attributes as set so far (dynamic shared memory allowed,
        # non-portable clusters allowed, cluster scheduling policy): the driver's defaults
        self.attributes: tuple[int, bool, int] = (0, False, 0)


_compiled: dict[tuple[Any, ...], Compiled] = {}
_lock = threading.Lock()


def compiled_for(kernel: Any, args: tuple[Any, ...], device: int) -> Compiled:
    """The compiled form of ``kernel`` for ``args`` on ``device`` (the current device),
    compiled and loaded on the first call with this signature there."""
    key = (kernel, signature(args), device)
    entry = _compiled.get(key)
    if entry is None:
        with _lock:
            entry = _compiled.get(key)
            if entry is None:
                entry = _compiled[key] = Compiled(kernel, key[1])
    return entry


_configs: dict[tuple[int, int, int, int], Any] = {}


def config(grid: int, block: int, shared: int, cluster: int) -> Any:
    """cuda.core's ``LaunchConfig`` for ``grid`` blocks (cached)."""
    key = (grid, block, shared, cluster)
    c = _configs.get(key)
    if c is None:
        from cuda import core

        if len(_configs) > 4096:
            _configs.clear()
        kwargs = cluster_launch(grid, block, shared, cluster, str(core.__version__))
        if cluster == 1:
            del kwargs["cluster"]
        c = _configs[key] = core.LaunchConfig(**kwargs)
    return c


def cluster_launch(grid: int, block: int, shared: int, cluster: int,
                   core_version: str) -> dict[str, int]:
    """Keyword arguments of cuda.core's ``LaunchConfig`` for ``grid`` blocks of ``block``
    threads in clusters of ``cluster`` blocks: cuda.core 1.0 and later count the grid in
    clusters when a cluster is given, earlier versions in blocks."""
    if cluster < 1 or grid % cluster:
        raise ValueError(f"a grid of {grid} blocks is not made of clusters of {cluster}")
    counts_clusters = int(core_version.split(".")[0]) >= 1
    return {"grid": grid // cluster if counts_clusters else grid, "cluster": cluster,
            "block": block, "shmem_size": shared}


class _Attribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padded to 8 bytes, then a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]


CLUSTER_DIMENSION = 4
"""``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``."""

_cluster_configs: dict[tuple[int, int, int, int, int], _Config] = {}


def cluster_config(grid: int, block: int, shared: int, cluster: int, stream: int) -> _Config:
    """The ``CUlaunchConfig`` of ``grid`` blocks in clusters of ``cluster`` (cached; read
    only by the driver, so threads share it)."""
    key = (grid, block, shared, cluster, stream)
    c = _cluster_configs.get(key)
    if c is None:
        if cluster < 1 or grid % cluster:
            raise ValueError(f"a grid of {grid} blocks is not made of clusters of {cluster}")
        attribute = _Attribute(id=CLUSTER_DIMENSION)
        attribute.value[:3] = [cluster, 1, 1]
        c = _Config(grid=(grid, 1, 1), block=(block, 1, 1), shared=shared, stream=stream,
                    count=1)
        c.attrs = ctypes.pointer(attribute)  # the pointer keeps the attribute alive
        if len(_cluster_configs) > 4096:
            _cluster_configs.clear()
        _cluster_configs[key] = c
    return c


_driver: list[Any] = []


def _functions() -> list[Any]:
    """``cuLaunchKernel``, ``cuLaunchKernelEx`` and ``cuGetErrorName`` of the CUDA driver,
    through ctypes (loaded once)."""
    if not _driver:
        lib = ctypes.CDLL("libcuda.so.1")
        plain = lib.cuLaunchKernel
        plain.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        plain.restype = ctypes.c_int
        ex = lib.cuLaunchKernelEx
        ex.argtypes = [ctypes.POINTER(_Config)] + [ctypes.c_void_p] * 3
        ex.restype = ctypes.c_int
        name = lib.cuGetErrorName
        name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver.extend((plain, ex, name))
    return _driver


def _error(code: int) -> str:
    text = ctypes.c_char_p()
    _driver[2](code, ctypes.byref(text))
    return (text.value or b"CUDA_ERROR_UNKNOWN").decode()


def address_slots(args: tuple[Any, ...], which: tuple[int, ...]) -> tuple[int, ...]:
    """Where the addresses of the arrays ``args[i]``, ``i`` in ``which``, stand among the
    parameter :func:`values` of ``args``."""
    starts, at = [], 0
    for a in args:
        starts.append(at)
        at += 5 + 2 * len(a.shape) if type(a) is DeviceView else 1
    for i in which:
        if type(args[i]) is not DeviceView:
            raise TypeError(f"argument {i} is not an array")
    return tuple(starts[i] + 4 for i in which)


def launch(entry: Compiled, stream: Any, grid: int, block: int, params: list[Any],
           shared: int = 0, cluster: int = 1) -> None:
    """Queue ``entry``'s kernel on ``stream`` (a :class:`~.arrays.Stream`) with the parameter
    :func:`values` ``params``, in clusters of ``cluster`` blocks when above 1 (``grid``
    counts blocks)."""
    params = param_buffer(entry.codes).pack(params)
    driver = _driver or _functions()
    if cluster > 1:
        code = driver[1](cluster_config(grid, block, shared, cluster, stream.handle),
                         entry.handle, params, None)
    else:
        code = driver[0](entry.handle, grid, 1, 1, block, 1, 1, shared, stream.handle,
                         params, None)
    if code:
        raise RuntimeError(f"kernel launch failed: {_error(code)} (grid {grid}, block {block}, "
                           f"cluster {cluster}, {shared} bytes of shared memory)")
