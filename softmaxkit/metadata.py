"""Integer metadata of packed and paged attention: its dtypes, host reads and spans.

``varlen_attention``'s cumulative lengths and ``paged_attention``'s block table and sequence
lengths follow one policy: int32 or int64 only, read on the host to be validated before any
kernel runs.  The backends that walk the packed sequences one by one read their spans here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import array_api_compat
import numpy as np

from .arguments import as_array
from .dtypes import dtype_name

INDEX_DTYPES = ("int32", "int64")
"""The integer dtypes accepted for ``cu_seqlens_q``, ``cu_seqlens_k``, ``block_table`` and
``seqlens``."""

Span = tuple[int, int, int, int]
"""``(q0, q1, k0, k1)``: a packed sequence's query rows ``q0:q1`` and key rows ``k0:k1``."""


def index_array(xp: Any, value: Any, name: str, like: Any, what: str | None = None) -> Any:
    """``value`` as an array of ``xp`` on ``like``'s device, checked to be int32 or int64.

    Parameters
    ----------
    xp : namespace
        The caller's array namespace.
    value : array or sequence of int
        The metadata argument.
    name : str
        The argument's name, for the error.
    like : array
        The array whose device a converted Python sequence goes to.
    what : str, optional
        What the integers are, appended to the error (``"cumulative sequence lengths"``).

    Returns
    -------
    array
        ``value`` unchanged when it is an array of ``xp``.

    Raises
    ------
    TypeError
        A dtype other than int32 or int64.
    """
    a = as_array(xp, value, name, like=like)
    found = dtype_name(a.dtype)
    if found not in INDEX_DTYPES:
        raise TypeError(
            f"{name} has dtype {found}: expected int32 or int64" + (f" {what}" if what else "")
        )
    return a


_VALIDATED: ContextVar[dict[int, tuple[Any, np.ndarray]] | None] = ContextVar(
    "softmaxkit_validated_metadata", default=None)


@contextmanager
def validated(*pairs: tuple[Any, np.ndarray]) -> Iterator[None]:
    """Within one call, the host values the frontend read to validate its metadata arrays.

    Each pair is ``(array, host values)``; while the context is open, :func:`host_integers`
    of one of these very arrays (a backend reading the lengths it launches with) returns the
    values already read instead of copying them from the device again, which would be one
    more synchronization per call.  The context holds the arrays, so their ``id`` stays
    theirs.
    """
    token = _VALIDATED.set({id(a): (a, host) for a, host in pairs})
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def host_integers(a: Any, name: str, reader: str) -> np.ndarray:
    """The values of the integer array ``a`` as a numpy int64 array in host memory.

    Free for host arrays and for arrays the frontend has read in this call
    (:func:`validated`), one device-to-host copy (and a synchronization) for other device
    arrays, one computation of the graph for Dask arrays: the price of validating the
    metadata before any kernel runs.

    Parameters
    ----------
    a : array
        Integer metadata, of any supported library.
    name : str
        The argument's name, for the error.
    reader : str
        Who reads it and what, for the error (``"paged_attention validates block_table and
        seqlens"``).

    Returns
    -------
    numpy.ndarray
        int64, a view of ``a`` where it can be.

    Raises
    ------
    TypeError
        ``a`` has no values to read (a value traced by ``jax.jit``, say).
    """
    known = _VALIDATED.get()
    if known is not None:
        entry = known.get(id(a))
        if entry is not None and entry[0] is a:
            return entry[1]
    try:
        if array_api_compat.is_torch_array(a):
            host = a.detach().cpu().numpy()
        elif array_api_compat.is_cupy_array(a):
            host = a.get()
        elif array_api_compat.is_dask_array(a):
            host = np.asarray(a.compute())
        else:
            try:
                host = np.from_dlpack(a)
            except Exception:  # libraries without DLPack export on their device
                host = np.asarray(a)
    except Exception as exc:
        raise TypeError(
            f"{name} could not be read on the host ({type(exc).__name__}): {reader} before any "
            "kernel runs, so they must be concrete arrays, not values traced by a compiler such "
            "as jax.jit"
        ) from exc
    return host.astype(np.int64, copy=False)


def sequence_spans(cu_q: Any, cu_k: Any) -> list[Span]:
    """The :data:`Span` of each packed sequence, from validated cumulative lengths."""
    reader = "packed attention reads cu_seqlens_q and cu_seqlens_k"
    hq = host_integers(cu_q, "cu_seqlens_q", reader).tolist()
    hk = host_integers(cu_k, "cu_seqlens_k", reader).tolist()
    return [(hq[b], hq[b + 1], hk[b], hk[b + 1]) for b in range(len(hq) - 1)]
