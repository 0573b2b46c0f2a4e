"""The call properties a backend's hooks may declare, and the key a cached decision is kept under.

A backend's ``can_run`` / ``should_run`` hooks answer from properties of the call; a manifest
lists the ones they read in ``hook_keys`` (see :mod:`softmaxkit.registry`).  The registry then
keeps each decision under the operation, namespace, device type and dtype of the call, the
active ``backend_opts``, and the values of the properties the candidates declare, read here.
Each property is cheap to read: a few attribute lookups per array argument, never a
conversion or a device query.

``"arrays"``
    for every argument of the kernel, in order: ``(type, dtype)`` of an array argument
    (the dtype object itself, so numpy's byte order counts), ``None`` otherwise;
``"shapes"``
    the shape of every array argument (``None`` for the others);
``"out_dtype"``
    the ``out_dtype`` argument (a dtype object), when the operation has one;
``"options"``
    every other argument: its value when it is ``None``, a bool, an int or a str, else its
    type (a hook that reads the value of a float argument must not declare it);
``"layout"``
    for torch tensors their layout, quantization and conjugation; ``None`` for other arrays;
``"chunks"``
    the chunk sizes of chunked (Dask) array arguments; ``None`` for other arrays;
``"devices"``
    the device of every array argument other than a numpy array (a torch tensor's
    ``device``, the ``id`` of a CuPy array's): for hooks whose answer differs between two
    devices of one type, such as GPUs of different compute capabilities.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

_PLAIN = (type(None), bool, int, str)

PROPERTIES: tuple[str, ...] = ("arrays", "shapes", "out_dtype", "options", "layout", "chunks",
                               "devices")
"""The names a manifest's ``hook_keys`` may list."""


_PLAIN_VALUE, _NUMPY_ARRAY, _TORCH_ARRAY, _FOREIGN_ARRAY, _OTHER = 1, 2, 3, 4, 5
_KINDS: dict[type, int] = {t: _PLAIN_VALUE for t in _PLAIN} | {np.ndarray: _NUMPY_ARRAY}
"""What each argument type is, decided once per type: arrays are what has a shape and a
dtype (an array library's types all do, or none of their instances do); torch tensors are
told apart by their module, so their layout flags are read without asking again."""


def _kind(t: type, v: Any) -> int:
    if isinstance(v, type) or t is float or not (hasattr(v, "shape") and hasattr(v, "dtype")):
        kind = _OTHER
    elif t.__module__.split(".", 1)[0] == "torch":
        kind = _TORCH_ARRAY
    else:
        kind = _FOREIGN_ARRAY
    _KINDS[t] = kind
    return kind


@functools.lru_cache(maxsize=64)
def value_reader(names: frozenset[str]) -> Callable[[Any], Any]:
    """A function giving what :func:`reader` reads of one kernel argument: its element of the
    tuple, from the parts of it the named properties ask for."""
    arrays, shapes, options = "arrays" in names, "shapes" in names, "options" in names
    layout, chunks, devices = "layout" in names, "chunks" in names, "devices" in names

    kinds = _KINDS

    def describe(v: Any, t: type, kind: int) -> Any:
        d: Any = (t, v.dtype) if arrays else None
        if shapes:
            d = (d, tuple(v.shape))
        if kind == _TORCH_ARRAY:
            if layout:
                d = (d, _torch_flags(v, v.dtype))
            if chunks:
                d = (d, None)
            if devices:
                d = (d, v.device)
        elif kind == _FOREIGN_ARRAY:
            if layout:
                d = (d, None)
            if chunks:
                d = (d, getattr(v, "chunks", None))
            if devices:
                device = getattr(v, "device", None)
                d = (d, getattr(device, "id", device))  # CuPy's Device is not hashable
        return d

    # the commonest descriptions are made inline: a plain value's, another object's, a
    # numpy array's when only its type and dtype are asked for, and a torch tensor's when
    # its layout flags are asked for too, with or without chunks and devices (what
    # describe() would give)
    numpy_inline = arrays and not shapes
    torch_inline = arrays and layout and not shapes

    def value(v: Any) -> Any:
        t = type(v)
        kind = kinds.get(t) or _kind(t, v)
        if kind == _PLAIN_VALUE:
            return v if options else None
        if kind == _OTHER:
            return t if options else None
        if kind == _NUMPY_ARRAY and numpy_inline:
            return (t, v.dtype)
        if kind == _TORCH_ARRAY and torch_inline:
            dtype = v.dtype
            d: Any = ((t, dtype), _torch_flags(v, dtype))
            if chunks:
                d = (d, None)
            return (d, v.device) if devices else d
        return describe(v, t, kind)

    return value


def _torch_flags(v: Any, dtype: Any) -> tuple[Any, bool, bool]:
    """A torch tensor's layout, quantization and conjugation.  A real floating tensor is
    neither quantized (those have their own dtypes) nor conjugated (complex only): two reads
    less."""
    if dtype.is_floating_point:
        return v.layout, False, False
    return v.layout, v.is_quantized, v.is_conj()


@functools.lru_cache(maxsize=64)
def reader(names: frozenset[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A function reading the named properties of a call from its kernel arguments
    (:attr:`Call.args <softmaxkit.ops.Call.args>`), as one hashable tuple.

    One pass over the arguments: each is described by the parts of it the properties ask
    for (:func:`value_reader`), so a call on numpy arrays costs a few attribute lookups.  It
    takes the arguments, not the :class:`~softmaxkit.ops.Call`, so a cached decision is
    found before any ``Call`` is built.
    """
    if not names:
        return lambda args: ()
    value = value_reader(names)
    out_dtype = "out_dtype" in names

    def read(args: dict[str, Any]) -> tuple[Any, ...]:
        out = [value(v) for v in args.values()]
        if out_dtype:  # the argument itself, where the operation has one
            out.append(args.get("out_dtype"))
        return tuple(out)

    return read
