"""Arrays in and out of the kernels, and the ``can_run`` hook; imports no numba.

Inputs are numpy arrays or torch CPU tensors, read in place: torch through DLPack
(``np.from_dlpack``), float16 and bfloat16 as integer views of their bits (:mod:`.bits`).
Results are allocated in the caller's library and written in place, so a torch caller gets a
torch tensor that no copy produced.  A row layout that is not C-contiguous costs one copy
(``np.ascontiguousarray``) before the kernel; read-only inputs are only read.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from array_api_compat import is_numpy_namespace, is_torch_namespace

from softmaxkit.dtypes import FLOAT_DTYPES, accumulator_name, dtype_name
from softmaxkit.ops import Call

from .buffers import result_array

_STORAGE: dict[np.dtype, type | None] = {np.dtype(np.float16): np.int16}  # see bits.py
_NO_MASK = np.ones((1, 1), dtype=bool)


def library(xp: Any) -> str | None:
    """``"numpy"`` or ``"torch"`` for the namespaces this backend runs on, else ``None``."""
    if is_numpy_namespace(xp):
        return "numpy"
    if is_torch_namespace(xp):
        return "torch"
    return None


def _decline_array(name: str, value: Any, lib: str) -> str | None:
    if lib == "numpy":
        if not isinstance(value, np.ndarray):
            return None  # Python scalars (grad_scale) are fine
        if type(value) is not np.ndarray:
            return f"{name} is a {type(value).__name__}, a numpy subclass it does not read"
        if not value.dtype.isnative:
            return f"{name} is not in native byte order (dtype {value.dtype.str})"
        return None
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    if value.device.type != "cpu":
        return f"{name} is on {value.device}, not the CPU"
    if value.layout != torch.strided:
        return f"{name} has layout {value.layout}; only strided tensors are read"
    if value.is_quantized or value.is_conj():
        return f"{name} is a quantized or conjugated tensor"
    return None


def can_run(call: Call) -> bool | str:
    """Accept numpy arrays and torch CPU tensors of the four floating dtypes; say why not.

    Parameters
    ----------
    call
        The call the registry is placing.

    Returns
    -------
    bool or str
        ``True``, or the reason this backend declines (the registry then falls back).
    """
    lib = library(call.xp)
    if lib is None:
        return (f"numba-cpu reads numpy arrays and torch CPU tensors, not "
                f"{getattr(call.xp, '__name__', call.xp)}")
    if call.device != "cpu":
        return f"numba-cpu runs on the CPU, not {call.device}"
    if call.dtype not in FLOAT_DTYPES:
        return f"numba-cpu has no kernel for dtype {call.dtype}"
    out_dtype = call.args.get("out_dtype")
    if out_dtype is not None:
        try:
            name = numpy_dtype(out_dtype).name
        except TypeError:
            name = str(out_dtype)
        if name not in FLOAT_DTYPES:
            return f"numba-cpu cannot write dtype {name}"
    for name, value in call.args.items():
        reason = _decline_array(name, value, lib)
        if reason:
            return reason
    return True


def numpy_view(a: Any) -> np.ndarray:
    """A numpy view of a numpy array or torch CPU tensor, with its own dtype (no copy).

    Torch tensors are read through ``Tensor.numpy()``, which shares their memory and costs
    far less per call than a DLPack exchange; bfloat16 goes through its bits.
    """
    if isinstance(a, np.ndarray):
        return a
    if not a.requires_grad and a.dtype is not _torch_bfloat16():
        try:  # the common tensor (a failed try costs ~10 us: the cases above are excluded)
            return a.numpy()
        except (RuntimeError, TypeError):  # a negative or conjugate bit
            pass
    t = a.detach() if a.requires_grad else a
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype is _torch_bfloat16():
        return t.view(_torch_int16()).numpy().view(_bfloat16())
    return t.numpy()


@functools.cache
def _bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def _torch_bfloat16() -> Any:
    import torch

    return torch.bfloat16


@functools.cache
def _torch_int16() -> Any:
    import torch

    return torch.int16


def _storage_kind(dtype: np.dtype) -> type | None:
    """The integer type whose bits the kernels read for ``dtype``, or None (read as it is).

    Decided once per dtype, the answer None included: numpy's ``dtype.name`` is slow."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        kind = _STORAGE[dtype] = (np.uint16 if dtype.itemsize == 2 and dtype.name == "bfloat16"
                                  else None)
        return kind


def storage(a: np.ndarray) -> np.ndarray:
    """The kernel's view of ``a``: 16-bit floats as integer bits, the others unchanged."""
    kind = _storage_kind(a.dtype)
    return a.view(kind) if kind is not None else a


class _Alias:
    """Holds an array interface (and the array it describes, to keep its memory alive)."""

    def __init__(self, interface: dict[str, Any], base: np.ndarray):
        self.__array_interface__ = interface
        self.base = base


def readable(a: np.ndarray) -> np.ndarray:
    """``a``, or for a read-only ``a`` an alias of the same memory that Numba types as writable.

    Numba compiles a separate kernel for read-only arrays; the kernels never write their
    inputs, so an alias saves that compilation without copying.
    """
    if a.flags.writeable:
        return a
    interface = dict(a.__array_interface__)
    interface["data"] = (interface["data"][0], False)
    return np.asarray(_Alias(interface, a)).view(a.dtype)  # keeps ml_dtypes dtypes


def rows(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous ``[R, N]`` array: a view when the layout allows, else one copy."""
    n = a.shape[-1]
    r = math.prod(a.shape[:-1])
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return readable(a.reshape(r, n))


def mask_rows(where: Any) -> tuple[np.ndarray, int, bool]:
    """``(w, wstep, has_where)``: row ``i`` of the mask is ``w[i * wstep]``.

    A mask shared by every row (a broadcast view, stride 0 over the batch axes) is read from
    one row, without materializing it.
    """
    if where is None:
        return _NO_MASK, 0, False
    w = numpy_view(where)
    if w.ndim > 1 and w.size and all(s == 0 for s in w.strides[:-1]):
        first = np.ascontiguousarray(w[(0,) * (w.ndim - 1)])
        return first.reshape(1, -1), 0, True
    return rows(w), 1, True


def empty(shape: tuple[int, ...], dtype: Any, like: Any) -> tuple[Any, np.ndarray]:
    """A new array of ``dtype`` in ``like``'s library, and the kernel's storage view of it.

    Torch results are numpy allocations handed to torch (``torch.from_numpy``, no copy):
    numpy asks for transparent huge pages on large arrays, which makes the first write of a
    64 MiB result several times cheaper than on a ``torch.empty`` buffer.  Large results start
    on a cache line and reuse released buffers (:func:`~.buffers.result_array`).
    """
    np_dtype = numpy_dtype(dtype)
    if isinstance(like, np.ndarray):
        result = result_array(shape, np_dtype)
        return result, storage(result)
    import torch

    bf16 = _storage_kind(np_dtype) is np.uint16
    raw = result_array(shape, np.uint16 if bf16 else np_dtype)
    result = torch.from_numpy(raw)
    if bf16:
        result = result.view(torch.bfloat16)
    return result, storage(raw)


def accumulator(dtype: np.dtype) -> type:
    """The numpy accumulator type for inputs of ``dtype``, by the core's dtype policy."""
    return getattr(np, accumulator_name(dtype_name(dtype)))


class Output:
    """A result in the caller's library and the storage the kernel writes into.

    When the kernel's compute dtype is the result's dtype, the kernel writes the result in
    place; otherwise it writes a temporary in the compute dtype, converted once by
    :meth:`finish` (so no kernel is compiled for each pair of input and output dtypes).
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, like: Any, compute: np.dtype):
        self.result, direct = empty(shape, dtype, like)
        if numpy_dtype(dtype) == compute:
            self.storage, self._temp = direct, None
        else:
            self._temp = np.empty(shape, dtype=compute)
            self.storage = storage(self._temp)

    def finish(self) -> Any:
        """The result, after converting the temporary if there is one."""
        if self._temp is not None:
            numpy_view(self.result)[...] = self._temp
        return self.result


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype (ml_dtypes for bfloat16) of a numpy or torch dtype."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        pass
    try:
        found = np.dtype(dtype)  # numpy dtypes and scalar types, ml_dtypes included
    except TypeError:  # a torch dtype
        name = dtype_name(dtype)
        if name == "bfloat16":
            import ml_dtypes

            found = np.dtype(ml_dtypes.bfloat16)
        else:
            found = np.dtype(name)
    _NUMPY_DTYPES[dtype] = found
    return found


_NUMPY_DTYPES: dict[Any, np.dtype] = {}


def compute_input(view: np.ndarray, out_dtype: Any) -> np.ndarray:
    """``view`` itself when the result has its dtype; else ``view`` in its accumulator dtype."""
    if numpy_dtype(out_dtype) == view.dtype:
        return view
    acc = accumulator(view.dtype)
    return view if view.dtype == acc else view.astype(acc)
