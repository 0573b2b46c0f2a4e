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
    the chunk sizes of chunked (Dask) array arguments; ``None`` for other arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .ops import Call

_PLAIN = (type(None), bool, int, str)

PROPERTIES: tuple[str, ...] = ("arrays", "shapes", "out_dtype", "options", "layout", "chunks")
"""The names a manifest's ``hook_keys`` may list."""


def _torch_flags(value: Any) -> Any:
    if type(value).__module__.split(".", 1)[0] != "torch":
        return None
    return (value.layout, value.is_quantized, value.is_conj())


_PLAIN_VALUE, _NUMPY_ARRAY, _FOREIGN_ARRAY, _OTHER = 1, 2, 3, 4
_KINDS: dict[type, int] = {t: _PLAIN_VALUE for t in _PLAIN} | {np.ndarray: _NUMPY_ARRAY}
"""What each argument type is, decided once per type: arrays are what has a shape and a
dtype (an array library's types all do, or none of their instances do)."""


def _kind(t: type, v: Any) -> int:
    if isinstance(v, type) or t is float or not (hasattr(v, "shape") and hasattr(v, "dtype")):
        kind = _OTHER
    else:
        kind = _FOREIGN_ARRAY
    _KINDS[t] = kind
    return kind


@functools.lru_cache(maxsize=64)
def reader(names: frozenset[str]) -> Callable[[Call], tuple[Any, ...]]:
    """A function reading the named properties of a call, as one hashable tuple.

    One pass over the arguments: each is described by the parts of it the properties ask
    for, so a call on numpy arrays costs a few attribute lookups.
    """
    arrays, shapes, options = "arrays" in names, "shapes" in names, "options" in names
    layout, chunks = "layout" in names, "chunks" in names

    def describe(v: Any) -> Any:
        t = type(v)
        kind = _KINDS.get(t) or _kind(t, v)
        if kind == _PLAIN_VALUE:
            return v if options else None
        if kind == _OTHER:
            return t if options else None
        d: Any = (t, v.dtype) if arrays else None
        if shapes:
            d = (d, tuple(v.shape))
        if kind == _FOREIGN_ARRAY:
            if layout:
                d = (d, _torch_flags(v))
            if chunks:
                d = (d, getattr(v, "chunks", None))
        return d

    if not names:
        return lambda call: ()
    if "out_dtype" in names:
        return lambda call: (tuple(map(describe, call.args.values())),
                             call.args.get("out_dtype"))
    return lambda call: tuple(map(describe, call.args.values()))
