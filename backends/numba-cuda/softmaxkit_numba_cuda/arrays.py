"""The caller's arrays as kernel arguments, without copies, on the caller's device and stream.

CuPy arrays, torch CUDA tensors and Numba device arrays reach the kernels through the CUDA
array interface (``numba.cuda.as_cuda_array(..., sync=False)``: the launch is ordered on the
caller's current stream instead of synchronizing).  bfloat16 tensors travel as 16-bit integer
views of the same memory.  Results are allocated by the caller's library, on the input's
device.  Under Numba's CUDA simulator, numpy arrays stand for device arrays.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from softmaxkit.dtypes import dtype_name

from .primitives import SIMULATOR, cuda

_streams: dict[int, Any] = {}
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
    """The kernel argument for array ``a``: a device array view (numpy in the simulator)."""
    if dtype_name(a.dtype) == "bfloat16":
        if lib == "torch":
            import torch

            a = a.view(torch.int16)
        else:
            a = a.view(np.int16)
    if lib == "numpy" or (SIMULATOR and lib != "numba"):
        return a
    return cuda.as_cuda_array(a, sync=False)


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
    key = (lib, str(device), dtype, ndim)
    d = _dummies.get(key)
    if d is None:
        np_dtype = np.int16 if dtype == "bfloat16" else np.dtype(dtype)
        if lib == "numpy" or SIMULATOR:
            d = np.ones((1,) * ndim, dtype=np_dtype)
        else:
            with _on_device(device_index(device, lib)):
                d = cuda.device_array((1,) * ndim, dtype=np_dtype)
        _dummies[key] = d
    return d


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


def _torch() -> Any:
    import torch

    return torch


@contextlib.contextmanager
def _on_device(index: int) -> Iterator[None]:
    if SIMULATOR or len(cuda.gpus) == 1:
        yield
        return
    with cuda.gpus[index]:
        yield


def _stream_for(ptr: int) -> Any:
    s = _streams.get(ptr)
    if s is None:
        if ptr == 0:
            s = cuda.legacy_default_stream()
        elif ptr == 2:
            s = cuda.per_thread_default_stream()
        else:
            s = cuda.external_stream(ptr)
        _streams[ptr] = s
    return s


@contextlib.contextmanager
def launch(a: Any, lib: str) -> Iterator[Any]:
    """Select ``a``'s device and yield the caller's current stream there (0 in the simulator)."""
    if SIMULATOR or lib == "numpy":
        yield 0
        return
    if lib == "torch":
        torch = _torch()
        ptr = torch.cuda.current_stream(a.device).cuda_stream
        index = device_index(a.device, lib)
    elif lib == "cupy":
        import cupy

        index = int(a.device.id)
        with cupy.cuda.Device(index):
            ptr = cupy.cuda.get_current_stream().ptr
    else:
        index, ptr = 0, 0
    with _on_device(index):
        yield _stream_for(ptr)


_SHARED_ALLOWED: dict[tuple[int, int], int] = {}
"""(id of a compiled kernel, device id) -> the dynamic shared memory it has been allowed there
(the attribute belongs to the kernel's function on each device)."""
_NON_PORTABLE: set[tuple[int, int]] = set()
"""(id of a compiled kernel, device id) allowed clusters of more than 8 blocks there."""
PORTABLE_CLUSTER = 8


def _allow_shared(compiled: Any, config: Any) -> None:
    """Let ``compiled`` take ``config.sharedmem`` bytes of dynamic shared memory (above 48 KB
    a kernel must opt in) and prefer the largest shared-memory carveout."""
    _allow(compiled, int(config.sharedmem), 1)


_POLICY: dict[tuple[int, int], int] = {}
"""(id of a compiled kernel, device id) -> the cluster scheduling policy set there."""


def _allow(compiled: Any, size: int, cluster: int, policy: int = 0) -> None:
    """Set the function attributes of ``compiled`` on the current device for ``size`` bytes of
    dynamic shared memory, clusters of ``cluster`` blocks (non-portable above 8) and the
    cluster scheduling ``policy`` (``CUclusterSchedulingPolicy``: 0 the driver's default, 1
    spread, 2 load balancing)."""
    cufunc = compiled._codelibrary.get_cufunc()  # the function of the current device
    key = (id(compiled), cufunc.device.id)
    from numba.cuda.cudadrv.driver import binding, driver

    if _POLICY.get(key, 0) != policy:
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
        driver.cuKernelSetAttribute(attr, policy, cufunc.handle, cufunc.device.id)
        _POLICY[key] = policy

    if size and _SHARED_ALLOWED.get(key, -1) < size:
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, size, cufunc.handle, cufunc.device.id)
        cufunc.set_shared_memory_carveout(100)
        _SHARED_ALLOWED[key] = size
    if cluster > PORTABLE_CLUSTER and key not in _NON_PORTABLE:
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        driver.cuKernelSetAttribute(attr, 1, cufunc.handle, cufunc.device.id)
        _NON_PORTABLE.add(key)


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


def _launch_cluster(kernel: Any, grid: int, block: int, stream: Any, args: tuple,
                    shared: int, cluster: int, policy: int = 0) -> None:
    """Launch ``kernel`` on ``grid`` blocks in clusters of ``cluster`` (numba's launch passes no
    cluster dimensions): the kernel compiled for the arguments' types by its dispatcher, the
    arguments marshalled as numba marshals them, the launch made through cuda.core."""
    from cuda import core
    from numba.cuda.cudadrv.driver import _to_core_stream

    config = core.LaunchConfig(**cluster_launch(grid, block, shared, cluster,
                                                str(core.__version__)))
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    _allow(compiled, shared, cluster, policy)
    core_stream = _to_core_stream(stream)
    kernelargs: list[Any] = []
    retr: list[Any] = []
    for ty, value in zip(compiled.argument_types, args, strict=True):
        compiled._prepare_args(ty, value, core_stream, retr, kernelargs)
    core.launch(core_stream, config, compiled._codelibrary.get_cufunc().kernel, *kernelargs)
    for writeback in retr:  # none for device arrays; kept as numba's launch does
        writeback()


_RESIDENT: dict[tuple[int, ...], int] = {}
"""(id of a compiled kernel, device id, block, shared, cluster, policy) -> clusters that fit
at once."""
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
    from cuda import core
    from numba.cuda.cudadrv.driver import _to_core_stream

    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    _allow(compiled, shared, cluster, policy)  # the occupancy depends on the opt-ins
    cufunc = compiled._codelibrary.get_cufunc()
    key = (id(compiled), cufunc.device.id, block, shared, cluster, policy)
    count = _RESIDENT.get(key)
    if count is None:
        config = core.LaunchConfig(**cluster_launch(cluster, block, shared, cluster,
                                                    str(core.__version__)))
        count = int(cufunc.kernel.occupancy.max_active_clusters(
            config, stream=_to_core_stream(stream)))
        _RESIDENT[key] = count
    return max(1, count)


def run(kernel: Any, grid: int, block: int, stream: Any, *args: Any, shared: int = 0,
        cluster: int = 1, policy: int = 0) -> None:
    """Launch ``kernel`` with ``shared`` bytes of dynamic shared memory, in thread-block
    clusters of ``cluster`` blocks when above 1 (``grid`` a multiple of it; the simulator
    runs clusters of one block only) under the cluster scheduling ``policy`` (see
    :func:`_allow`); numba's occupancy advice for small grids is not shown to callers."""
    if cluster > 1:
        if SIMULATOR:
            raise NotImplementedError("the simulator runs clusters of one block only")
        _launch_cluster(kernel, grid, block, stream, args, shared, cluster, policy)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GPU under-utilization")
        if not shared:
            kernel[grid, block, stream](*args)
            return
        config = kernel[grid, block, stream, shared]
        if not SIMULATOR:
            config.pre_launch_callbacks.append(_allow_shared)
        config(*args)
