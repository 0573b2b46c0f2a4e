"""The golden vectors of spec/vectors/, read from the installed package ``softmaxkit._vectors``.

The JSON files are made by spec/vectors/make_vectors.py in 50-digit arithmetic; every number
is a string (``"inf"``, ``"-inf"`` and ``"nan"`` included) and arrays are stored flat with
their shape.  :func:`load` returns the cases of one file; :func:`array` decodes one field.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, overload

import numpy as np

FILES = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "vjp")
"""The vector files, by stem (``softmax`` is ``softmax.json``)."""


@functools.cache
def load(stem: str) -> tuple[dict[str, Any], ...]:
    """The cases of ``<stem>.json`` (one of :data:`FILES`)."""
    text = resources.files("softmaxkit._vectors").joinpath(f"{stem}.json").read_text("utf-8")
    return tuple(json.loads(text)["cases"])


@overload
def array(values: None, shape: list[int] | tuple[int, ...]) -> None: ...
@overload
def array(values: list[Any], shape: list[int] | tuple[int, ...]) -> np.ndarray: ...
def array(values: list[Any] | None, shape: list[int] | tuple[int, ...]) -> np.ndarray | None:
    """A flat list of number strings (or bools, or ints) as a float64 / bool / int array."""
    if values is None:
        return None
    if values and isinstance(values[0], bool):
        return np.asarray(values, dtype=bool).reshape(shape)
    if values and isinstance(values[0], int):
        return np.asarray(values, dtype=np.int64).reshape(shape)
    return np.asarray(values, dtype=np.float64).reshape(shape)


def axis(value: Any) -> int | tuple[int, ...] | None:
    """The ``axis`` field of a case as the API takes it (lists become tuples)."""
    return tuple(value) if isinstance(value, list) else value
