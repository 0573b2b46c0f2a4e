"""Raw device views of CuPy arrays and PyTorch CUDA tensors, allocation, and the launch context.

The kernels take raw pointers and element strides, so one code path serves both libraries and
PyTorch's bfloat16 (which CuPy has no dtype for).  Results are allocated in the caller's
library on the caller's device, and kernels run on the caller's current stream.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from softmaxkit.dtypes import dtype_name

from . import launches
from .configs import CLUSTER_CAPABILITY

_tensor_type: type | None = None
"""``torch.Tensor`` once torch is imported (found then, not imported here)."""


def is_torch(a: Any) -> bool:
    """Whether ``a`` is a PyTorch tensor (torch is imported by whoever made one)."""
    global _tensor_type
    if _tensor_type is None:  # a call on every launch: the module lookup done once
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _tensor_type = torch.Tensor
    return isinstance(a, _tensor_type)


def pointer(a: Any) -> int:
    """The device address of ``a``'s first element."""
    return int(a.data_ptr()) if is_torch(a) else int(a.data.ptr)


def element_strides(a: Any) -> tuple[int, ...]:
    """``a``'s strides in elements."""
    if is_torch(a):
        return tuple(a.stride())
    return tuple(s // a.itemsize for s in a.strides)


def itemsize(a: Any) -> int:
    """Bytes per element of ``a``."""
    return int(a.element_size()) if is_torch(a) else int(a.itemsize)


def as_rows(xp: Any, a: Any) -> tuple[Any, int]:
    """``a`` ([..., N]) as a [rows, N] array with unit stride along N, and its row stride.

    A view where the layout allows (broadcast masks keep a zero row stride), else a copy.
    """
    n = a.shape[-1]
    rows = math.prod(a.shape[:-1])
    strides = element_strides(a)
    if a.ndim == 1:
        if strides[0] == 1 or n <= 1:
            return xp.reshape(a, (1, n)), n
    elif strides[-1] == 1 or n <= 1:
        # the leading axes collapse into one row stride when they are nested evenly
        lead = [(d, s) for d, s in zip(a.shape[:-1], strides[:-1], strict=True) if d != 1]
        if not lead:
            return xp.reshape(a, (rows, n)), n
        ok = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
        if ok:
            view = _strided(a, (rows, n), (lead[-1][1], 1))
            return view, lead[-1][1]
    c = contiguous(a)
    return xp.reshape(c, (rows, n)), n


def row_pointer(xp: Any, a: Any) -> tuple[int, int, Any]:
    """The address of ``a``'s first row ([..., N]), its row stride in elements, and the array
    they describe (``a``, a view or a copy: keep it until the launch is queued).

    A C-contiguous ``a`` is read in place without making a view: the kernels take only an
    address and a row stride.
    """
    if a.is_contiguous() if is_torch(a) else a.flags.c_contiguous:
        return pointer(a), a.shape[-1], a
    view, ld = as_rows(xp, a)
    return pointer(view), ld, view


def _strided(a: Any, shape: tuple[int, int], strides: tuple[int, int]) -> Any:
    if is_torch(a):
        return a.as_strided(shape, strides)
    from cupy.lib.stride_tricks import as_strided

    return as_strided(a, shape=shape, strides=tuple(s * a.itemsize for s in strides))


def contiguous(a: Any) -> Any:
    """``a`` in C order (itself when it already is)."""
    if is_torch(a):
        return a.contiguous()
    import cupy

    return cupy.ascontiguousarray(a)


def empty(like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialized array of ``shape`` and dtype name ``dtype`` beside ``like``, from the
    caller's allocator: torch's caching allocator for tensors, CuPy's pool for CuPy arrays."""
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    if like.device.id == cupy.cuda.runtime.getDevice():
        return cupy.empty(shape, dtype=dtype)
    with cupy.cuda.Device(like.device.id):
        return cupy.empty(shape, dtype=dtype)


def zeros(like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """A zero-filled array of ``shape`` and dtype name ``dtype`` beside ``like``."""
    if is_torch(like):
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.zeros(shape, dtype=dtype)


def full(like: Any, shape: tuple[int, ...], value: float, dtype: str) -> Any:
    """An array of ``shape`` and dtype name ``dtype`` filled with ``value``, beside ``like``."""
    if is_torch(like):
        import torch

        return torch.full(shape, value, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.full(shape, value, dtype=dtype)


def to_host(a: Any) -> np.ndarray:
    """``a`` copied to a numpy array (one device-to-host copy, synchronous)."""
    if is_torch(a):
        return a.cpu().numpy()
    import cupy

    return cupy.asnumpy(a)


def from_host(like: Any, a: np.ndarray) -> Any:
    """The numpy array ``a`` copied beside ``like``, in ``like``'s library."""
    if is_torch(like):
        import torch

        return torch.as_tensor(a, device=like.device)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(a)


def name(a: Any) -> str:
    """The softmaxkit dtype name of ``a``."""
    return dtype_name(a.dtype)


class _StreamHandle:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_streams: dict[int, Any] = {}


def _cupy_stream(handle: int, device: int) -> Any:
    """A cached CuPy view of the stream ``handle`` (PyTorch's current stream)."""
    stream = _streams.get(handle)
    if stream is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            stream = from_external(_StreamHandle(handle))
        else:  # CuPy before 14
            stream = cupy.cuda.ExternalStream(handle, device)
        _streams[handle] = stream
    return stream


def _torch_stream(index: int) -> int:
    """The handle of PyTorch's current stream on device ``index``."""
    return torch_stream_reader()(index)


@functools.cache
def torch_stream_reader() -> Callable[[int], int]:
    """A function of a device index giving the handle of PyTorch's current stream there
    (looked up once; torch is imported by whoever made a tensor)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object made
    return raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


@functools.cache
def current_device_reader() -> Callable[[], int]:
    """A function giving the index of the current CUDA device (CuPy's ``getDevice``, looked
    up once)."""
    import cupy

    return cupy.cuda.runtime.getDevice


def device_index(a: Any) -> int:
    """The index of the CUDA device ``a`` lives on."""
    return a.get_device() if is_torch(a) else a.device.id


@functools.cache
def capability(device: int) -> int:
    """The compute capability of CUDA device ``device`` as a number (90 for 9.0)."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def has_clusters(device: int) -> bool:
    """Whether CUDA device ``device`` has thread-block clusters (compute capability 9.0 and
    newer); the row kernels of a cluster are launched only there."""
    return capability(device) >= CLUSTER_CAPABILITY


@functools.cache
def shared_limit(device: int) -> int:
    """The dynamic and static shared memory, in bytes, that a block may take on CUDA device
    ``device`` once its kernel opts in (227 KB on compute capability 9.0); asked once per
    device."""
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                          device))


def launch(kernel: Any, like: Any, grid: int | tuple[int, int, int], block: int, codes: str,
           args: tuple[Any, ...], shared: int = 0) -> None:
    """Launch ``kernel`` (a ``cupy.RawKernel``) on ``like``'s device and current stream, its
    ``args`` packed by :mod:`.launches` as its parameter list ``codes`` says.

    The stream is PyTorch's current stream for tensors, CuPy's for CuPy arrays; the device is
    switched only when ``like`` is not on the current one, so a call makes no context
    changes, no synchronization and no device query.
    """
    import cupy

    torch_array = is_torch(like)
    index = device_index(like)
    if index == cupy.cuda.runtime.getDevice():
        stream = _torch_stream(index) if torch_array else cupy.cuda.get_current_stream().ptr
        launches.launch(kernel, index, stream, grid, block, codes, args, shared)
        return
    with cupy.cuda.Device(index):
        stream = _torch_stream(index) if torch_array else cupy.cuda.get_current_stream().ptr
        launches.launch(kernel, index, stream, grid, block, codes, args, shared)


@contextlib.contextmanager
def on_device(a: Any) -> Iterator[None]:
    """Make a CuPy array's device current for array-API calls beside it (CuPy allocates on
    the current device whatever ``device=`` says); nothing for PyTorch, whose ``device=``
    places allocations."""
    if is_torch(a):
        yield
        return
    import cupy

    with cupy.cuda.Device(a.device.id):
        yield


@contextlib.contextmanager
def launch_context(a: Any) -> Iterator[None]:
    """Make ``a``'s device current and, for PyTorch, PyTorch's current stream CuPy's."""
    import cupy

    if is_torch(a):
        import torch

        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        stream = _cupy_stream(torch.cuda.current_stream(index).cuda_stream, index)
        with cupy.cuda.Device(index), stream:
            yield
    else:
        with cupy.cuda.Device(a.device.id):
            yield
