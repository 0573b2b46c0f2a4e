"""The caller's arrays as kernel arguments, without copies, on the caller's device and stream.

CuPy arrays, torch CUDA tensors and Numba device arrays reach the kernels as
:class:`~.launches.DeviceView` s (address, shape, strides, dtype, read once from the array),
and kernels are launched through :mod:`.launches` on the caller's current stream, never
synchronizing.  bfloat16 tensors travel as 16-bit integer views of the same memory.  Results
are allocated by the caller's library, on the input's device.  Under Numba's CUDA simulator,
numpy arrays stand for device arrays and kernels run through numba's own launch.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from softmaxkit.dtypes import dtype_name

from . import launches
from .launches import DeviceView, c_strides
from .primitives import SIMULATOR, cuda

_dummies: dict[Any, Any] = {}


def library(a: Any) -> str:
    """``"torch"``, ``"cupy"``, ``"numba"`` or ``"numpy"``: the library that owns ``a``."""
    module = type(a).__module__.split(".", 1)[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    if hasattr(a, "__cuda_array_interface__"):
        return "numba"
    raise TypeError(f"arrays of type {type(a).__name__} are not supported by numba-cuda")


def rows(a: Any, lib: str) -> Any:
    """``a`` (``[..., N]``) as a C-contiguous ``[rows, N]`` array of its own library."""
    n = a.shape[-1] if a.ndim else 1
    count = math.prod(a.shape[:-1]) if a.ndim else 1
    if lib == "torch":
        a = a.detach()
        if not a.is_contiguous():
            a = a.contiguous()
    elif lib == "cupy":
        import cupy

        if not a.flags.c_contiguous:
            a = cupy.ascontiguousarray(a)
    elif lib == "numpy":
        a = np.ascontiguousarray(a)
    return a.reshape(count, n)


def kernel_view(a: Any, lib: str) -> Any:
    """The kernel argument for array ``a``: a :class:`DeviceView` of its memory (bfloat16 read
    as int16), or ``a`` itself in the simulator."""
    if lib == "numpy" or SIMULATOR:
        if dtype_name(a.dtype) == "bfloat16":
            a = a.view(_torch().int16) if lib == "torch" else a.view(np.int16)
        return cuda.as_cuda_array(a, sync=False) if lib == "numba" else a
    if lib == "torch":
        size = a.element_size()
        return DeviceView(a.data_ptr(), tuple(a.shape), tuple([s * size for s in a.stride()]),
                          _torch_dtype(a.dtype), a)
    if lib == "cupy":
        dtype = a.dtype if dtype_name(a.dtype) != "bfloat16" else np.dtype(np.int16)
        return DeviceView(a.data.ptr, tuple(a.shape), tuple(a.strides), dtype, a)
    cai = a.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides") or c_strides(shape, dtype.itemsize)
    return DeviceView(cai["data"][0], shape, tuple(strides), dtype, a)


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _torch_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype a kernel reads a torch dtype as (bfloat16 as int16)."""
    np_dtype = _TORCH_DTYPES.get(dtype)
    if np_dtype is None:
        name = str(dtype).rsplit(".", 1)[-1]
        np_dtype = np.dtype(np.int16 if name == "bfloat16" else "bool" if name == "bool"
                            else name)
        _TORCH_DTYPES[dtype] = np_dtype
    return np_dtype


def _address(a: Any, lib: str) -> int:
    if lib == "torch":
        return a.data_ptr()
    if lib == "cupy":
        return a.data.ptr
    if lib == "numpy":
        return a.ctypes.data
    return a.__cuda_array_interface__["data"][0]


def vectorizable(arrays: list[Any], lib: str, width: int) -> bool:
    """Whether ``[rows, N]`` arrays can be read and written in 16-byte words of ``width``
    values: every row starts on a 16-byte boundary and holds whole words."""
    if width <= 1 or lib == "numba":
        return False
    for a in arrays:
        n = a.shape[-1]
        if n == 0 or n % width or _address(a, lib) % 16:
            return False
        if lib == "torch" and a.stride(-1) != 1:  # a broadcast view reports contiguous
            return False
    return True


def empty(xp: Any, like: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialized array of the caller's library on ``like``'s device."""
    return xp.empty(shape, dtype=dtype, device=getattr(like, "device", None))


def dummy(lib: str, device: Any, dtype: str = "bool", ndim: int = 2) -> Any:
    """A tiny array (``ndim`` axes of length 1) standing for an absent argument of ``dtype``."""
    host = lib == "numpy" or SIMULATOR
    index = 0 if host else device_index(device, lib)  # CuPy's Device objects are unhashable
    key = (lib, index, dtype, ndim)
    d = _dummies.get(key)
    if d is None:
        np_dtype = np.int16 if dtype == "bfloat16" else np.dtype(dtype)
        if host:
            d = np.ones((1,) * ndim, dtype=np_dtype)
        else:
            with _on_device(index):
                d = kernel_view(cuda.device_array((1,) * ndim, dtype=np_dtype), "numba")
        _dummies[key] = d
    return d


_constants: dict[tuple[Any, ...], Any] = {}


def capturing(lib: str) -> bool:
    """Whether the caller's current stream is capturing a CUDA graph."""
    if lib == "torch":
        return bool(_torch().cuda.is_current_stream_capturing())
    if lib == "cupy":
        import cupy

        return bool(cupy.cuda.get_current_stream().is_capturing())
    return False


def constant(value: float, dtype: str, device: Any, lib: str) -> Any:
    """A one-element device array holding ``value`` (kernels only read it), kept per value,
    dtype and device, or None where one cannot be made now (the simulator, a stream that is
    capturing a graph).  Its copy to the device is finished when it is returned, so a kernel
    on any stream may read it."""
    if SIMULATOR or lib == "numpy" or capturing(lib):
        return None
    index = device_index(device, lib)
    key = (value, dtype, index)
    c = _constants.get(key)
    if c is None:
        if len(_constants) > 1024:
            _constants.clear()
        with _on_device(index):
            c = kernel_view(cuda.to_device(np.array([value], dtype=np.dtype(dtype))), "numba")
        _constants[key] = c
    return c


def is_placeholder(a: Any) -> bool:
    """Whether ``a`` is one of the :func:`dummy` arrays (the same in every call)."""
    return any(a is d for d in _dummies.values())


def device_index(device: Any, lib: str) -> int:
    """The CUDA ordinal of a torch / CuPy device object."""
    if lib == "torch":
        return device.index if device.index is not None else _torch().cuda.current_device()
    if lib == "cupy":
        return int(device.id)
    return 0


_device_values: dict[tuple[str, int], Any] = {}


def _device_value(a: Any, lib: str, name: str, read: Callable[[Any], Any]) -> Any:
    """``read(device)`` for the device that holds ``a``, computed once per device."""
    index = device_index(getattr(a, "device", None), lib)
    key = (name, index)
    if key not in _device_values:
        with _on_device(index):
            _device_values[key] = read(cuda.get_current_device())
    return _device_values[key]


NOMINAL_BANDWIDTH = 3e12
"""Bytes per second assumed where the device does not report its memory clock and bus."""


def _peak_bandwidth(dev: Any) -> float:
    try:  # double data rate: two transfers a clock (kHz) across the bus (bits)
        return 2e3 * dev.MEMORY_CLOCK_RATE * dev.GLOBAL_MEMORY_BUS_WIDTH / 8 or NOMINAL_BANDWIDTH
    except (AttributeError, TypeError, ValueError):  # a driver without these attributes
        return NOMINAL_BANDWIDTH


def memory_bandwidth(a: Any, lib: str) -> float:
    """Peak bytes per second of the memory of the device that holds ``a``: its double data
    rate clock times its bus width (numba's device attributes; :data:`NOMINAL_BANDWIDTH` in
    the simulator)."""
    if SIMULATOR:
        return NOMINAL_BANDWIDTH
    return _device_value(a, lib, "bandwidth", _peak_bandwidth)


def shared_limit(a: Any, lib: str) -> int:
    """Bytes of shared memory a block may take on the device that holds ``a`` once its kernel
    opts in (227 KB on compute capability 9.0; no limit in the simulator)."""
    if SIMULATOR:
        return 1 << 30
    return _device_value(a, lib, "shared",
                         lambda dev: int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))


def has_clusters(a: Any, lib: str) -> bool:
    """Whether the device that holds ``a`` has thread-block clusters (compute capability 9.0
    and newer; the simulator runs clusters of one block)."""
    if SIMULATOR:
        return True
    return _device_value(a, lib, "clusters", lambda dev: dev.compute_capability >= (9, 0))


def _torch() -> Any:
    import torch

    return torch


_device_count: list[int] = []


_SAME_DEVICE = contextlib.nullcontext()


def _on_device(index: int) -> contextlib.AbstractContextManager:
    """A context that makes device ``index`` current (nothing to do with one device)."""
    if SIMULATOR:
        return _SAME_DEVICE
    if not _device_count:
        _device_count.append(len(cuda.gpus))
    return _SAME_DEVICE if _device_count[0] == 1 else cuda.gpus[index]


class Stream:
    """The caller's current stream on a device: the device's ordinal and cuda.core's view of
    the stream, which kernels are queued on."""

    __slots__ = ("core", "device", "handle")

    def __init__(self, handle: int, device: int) -> None:
        from cuda import core

        self.handle = handle
        self.device = device
        self.core = core.Stream.from_handle(handle)


_streams: dict[tuple[int, int], Stream] = {}
_ready = threading.local()


def _stream(handle: int, device: int) -> Stream:
    s = _streams.get((handle, device))
    if s is None:
        s = _streams[(handle, device)] = Stream(handle, device)
    return s


def _ensure_context(device: int) -> None:
    """Make numba's context for ``device`` current on this thread, once per thread (a launch
    on a thread where no library has touched the device yet would have no context)."""
    seen = getattr(_ready, "devices", None)
    if seen is None:
        seen = _ready.devices = set()
    if device not in seen:
        cuda.current_context()
        seen.add(device)


def stream_of(a: Any, lib: str) -> Any:
    """The caller's current stream on ``a``'s device (0 in the simulator): PyTorch's for
    tensors, CuPy's for CuPy arrays, the default stream for Numba device arrays."""
    if SIMULATOR or lib == "numpy":
        return 0
    if lib == "torch":
        torch = _torch()
        index = a.get_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # makes no Stream object
        ptr = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    elif lib == "cupy":
        import cupy

        index = int(a.device.id)
        with cupy.cuda.Device(index):
            ptr = cupy.cuda.get_current_stream().ptr
    else:
        index, ptr = 0, 0
    with _on_device(index):
        _ensure_context(index)
    return _stream(ptr, index)


PORTABLE_CLUSTER = 8


def _allow(entry: launches.Compiled, size: int, cluster: int, policy: int = 0) -> None:
    """Set the function attributes of ``entry`` (a kernel's function on one device) for
    ``size`` bytes of dynamic shared memory (above 48 KB a kernel must opt in; the largest
    shared-memory carveout is then preferred), clusters of ``cluster`` blocks (non-portable
    above 8) and the cluster scheduling ``policy`` (``CUclusterSchedulingPolicy``: 0 the
    driver's default, 1 spread, 2 load balancing); each set once, kept in
    ``entry.attributes``."""
    allowed, wide, current = entry.attributes
    grow, widen = size > allowed, cluster > PORTABLE_CLUSTER and not wide
    if not (grow or widen or policy != current):
        return
    from numba.cuda.cudadrv.driver import binding, driver

    fn = entry.function
    attribute = binding.CUfunction_attribute
    if policy != current:
        driver.cuKernelSetAttribute(
            attribute.CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE, policy,
            fn.handle, fn.device.id)
    if grow:
        driver.cuKernelSetAttribute(attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    size, fn.handle, fn.device.id)
        fn.set_shared_memory_carveout(100)
    if widen:
        driver.cuKernelSetAttribute(
            attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, fn.handle,
            fn.device.id)
    entry.attributes = (max(size, allowed), wide or widen, policy)


def _prepare(kernel: Any, stream: Stream, args: tuple, shared: int, cluster: int,
             policy: int) -> launches.Compiled:
    """``kernel`` compiled for ``args`` on ``stream``'s device, its attributes set for
    ``shared`` bytes of dynamic shared memory, clusters of ``cluster`` and ``policy``."""
    entry = launches.compiled_for(kernel, args, stream.device)
    _allow(entry, shared, cluster, policy)
    return entry


_RESIDENT: dict[tuple[int, ...], int] = {}
"""(id of a kernel's function on a device, block, shared, cluster, policy) -> clusters that
fit at once."""
SIMULATED_CLUSTERS = 2
"""Clusters of a persistent grid in the simulator (each then walks several rows)."""


def resident_clusters(kernel: Any, block: int, stream: Any, args: tuple, shared: int,
                      cluster: int, policy: int = 0) -> int:
    """Clusters of ``cluster`` blocks of ``kernel`` (``block`` threads, ``shared`` bytes of
    dynamic shared memory) that the device holds at once (``cuOccupancyMaxActiveClusters``
    through cuda.core, at least 1): the grid of a persistent kernel, whose clusters never
    wait for each other (a grid larger than what fits is correct, only slower)."""
    if SIMULATOR:
        return SIMULATED_CLUSTERS
    with _on_device(stream.device):
        entry = _prepare(kernel, stream, args, shared, cluster, policy)  # occupancy needs them
        key = (id(entry), block, shared, cluster, policy)
        count = _RESIDENT.get(key)
        if count is None:
            config = launches.config(cluster, block, shared, cluster)
            count = int(entry.function.kernel.occupancy.max_active_clusters(
                config, stream=stream.core))
            _RESIDENT[key] = count
    return max(1, count)


class Replay:
    """A launch kept for one call shape and replayed with the addresses of new arrays: the
    kernel's function (its attributes set), the launch geometry, and the packed parameter
    values with the places of the addresses that change from call to call."""

    __slots__ = ("block", "cluster", "entry", "grid", "params", "shared", "slots")

    def __init__(self, entry: launches.Compiled, grid: int, block: int, params: list[Any],
                 slots: tuple[int, ...], shared: int, cluster: int) -> None:
        self.entry, self.grid, self.block, self.shared = entry, grid, block, shared
        self.params, self.slots, self.cluster = params, slots, cluster

    def __call__(self, stream: Stream, *addresses: int) -> None:
        """Launch on ``stream`` with ``addresses`` in the places of the recorded arrays."""
        params = self.params.copy()
        for i, address in zip(self.slots, addresses, strict=True):
            params[i] = address
        with _on_device(stream.device):
            launches.launch(self.entry, stream, self.grid, self.block, params, self.shared,
                            self.cluster)


def record(kernel: Any, grid: int, block: int, stream: Any, *args: Any, live: tuple[int, ...],
           shared: int = 0, cluster: int = 1, policy: int = 0) -> Replay | None:
    """:func:`run` the launch, and return it as a :class:`Replay` whose addresses are those
    of the arrays ``args[i]``, ``i`` in ``live`` (None in the simulator).  The other
    arguments must be the same in every call the replay serves: placeholders, sizes,
    flags."""
    run(kernel, grid, block, stream, *args, shared=shared, cluster=cluster, policy=policy)
    if SIMULATOR:
        return None
    entry = launches.compiled_for(kernel, args, stream.device)
    return Replay(entry, grid, block, launches.values(args), launches.address_slots(args, live),
                  shared, cluster)


def run(kernel: Any, grid: int, block: int, stream: Any, *args: Any, shared: int = 0,
        cluster: int = 1, policy: int = 0) -> None:
    """Launch ``kernel`` on ``stream`` (from :func:`stream_of`) with ``shared`` bytes of dynamic
    shared memory, in thread-block clusters of ``cluster`` blocks when above 1 (``grid`` a
    multiple of it; the simulator runs clusters of one block only) under the cluster
    scheduling ``policy`` (see :func:`_allow`)."""
    if not SIMULATOR:
        with _on_device(stream.device):
            entry = _prepare(kernel, stream, args, shared, cluster, policy)
            launches.launch(entry, stream, grid, block, launches.values(args), shared,
                            cluster)
        return
    if cluster > 1:
        raise NotImplementedError("the simulator runs clusters of one block only")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GPU under-utilization")
        if not shared:
            kernel[grid, block, stream](*args)
            return
        kernel[grid, block, stream, shared](*args)
