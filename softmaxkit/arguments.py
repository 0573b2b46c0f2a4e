"""Validation and normalization of the frontend's arguments.

Every public function validates its arguments here, once, before any backend sees them, so
that each error names the argument at fault and says what was expected, and the caller's
arrays are never modified.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from . import dtypes

MASKED_POLICIES = ("zero", "nan", "raise")


class AxisError(ValueError, IndexError):
    """An axis argument is out of range or repeated (like numpy's ``AxisError``)."""


class EmptyRowError(ValueError):
    """A row has no allowed position and the ``masked="raise"`` policy was asked for."""


def namespace(**arrays: Any) -> Any:
    """The array namespace shared by the named arrays; ``None`` values are ignored.

    Python scalars and sequences adopt the namespace of the other arrays (numpy when every
    argument is array-like), like SciPy.  Mixing two array libraries, or two devices, is an
    error that names both arguments.
    """
    found: dict[str, Any] = {}
    for name, value in arrays.items():
        if value is not None and array_api_compat.is_array_api_obj(value):
            found[name] = value
    if not found:
        return array_api_compat.array_namespace(np.empty(0))
    names = list(found)
    first = names[0]
    xp = array_api_compat.array_namespace(found[first])
    for name in names[1:]:
        other = array_api_compat.array_namespace(found[name])
        if other is not xp:
            raise TypeError(
                f"{first} and {name} belong to different array libraries "
                f"({xp.__name__} and {other.__name__}); pass arrays of one library"
            )
    dev = array_api_compat.device(found[first])
    for name in names[1:]:
        other_dev = array_api_compat.device(found[name])
        if other_dev != dev:
            raise ValueError(
                f"{first} is on device {dev} but {name} is on device {other_dev}; "
                "move them to one device"
            )
    return xp


def as_array(xp: Any, value: Any, name: str, like: Any = None) -> Any:
    """``value`` as an array of ``xp``, on the device of ``like`` when given."""
    if array_api_compat.is_array_api_obj(value):
        return value
    device = None if like is None else array_api_compat.device(like)
    try:
        return xp.asarray(value, device=device)
    except Exception as exc:
        raise TypeError(f"{name} could not be converted to an array: {exc}") from exc


def real(xp: Any, x: Any, name: str) -> Any:
    """``x`` itself if its dtype is real floating, integer or boolean; else a ``TypeError``
    that names ``name``."""
    if dtypes.is_float(xp, x.dtype) or dtypes.is_integral(xp, x.dtype):
        return x
    return floating(xp, x, name)  # raises the error that fits the dtype


def floating(xp: Any, x: Any, name: str) -> Any:
    """``x`` itself if it is real floating; integers and booleans promote to the default float.

    Complex and other dtypes are rejected with an error that names ``name``.
    """
    if dtypes.is_float(xp, x.dtype):
        return x
    if dtypes.is_integral(xp, x.dtype):
        dev = array_api_compat.device(x)
        return xp.astype(x, dtypes.default_float(xp, dev))
    if dtypes.is_complex(xp, x.dtype):
        raise TypeError(
            f"{name} has complex dtype {dtypes.dtype_name(x.dtype)}: softmaxkit defines these "
            "operations for real logits only"
        )
    raise TypeError(
        f"{name} has dtype {dtypes.dtype_name(x.dtype)}: expected a real floating, integer "
        "or boolean dtype"
    )


def axes(axis: Any, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """Normalize ``axis`` (None, an int or a tuple of ints) to a sorted tuple of axes."""
    if axis is None:
        return tuple(range(ndim))
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for item in items:
        try:
            index = operator.index(item)
        except TypeError:
            raise TypeError(
                f"{name}={axis!r} is not valid: expected None, an int or a tuple of ints"
            ) from None
        if not -ndim <= index < ndim and not (ndim == 0 and index in (0, -1)):
            raise AxisError(
                f"{name}={axis!r} is out of range for an array of {ndim} dimension(s)"
            )
        out.append(index % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise AxisError(f"{name}={axis!r} repeats an axis")
    return tuple(sorted(out)) if ndim else ()


def single_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    """Normalize an ``axis`` that must name exactly one axis."""
    if isinstance(axis, (tuple, list)) or axis is None:
        raise TypeError(f"{name}={axis!r} is not valid: expected a single int")
    (index,) = axes(axis, ndim, name) or (0,)
    return index


def mask(xp: Any, where: Any, shape: tuple[int, ...], like: Any, name: str = "where") -> Any:
    """Validate a boolean mask and broadcast it to ``shape`` (a view where possible)."""
    if where is None:
        return None
    where = as_array(xp, where, name, like=like)
    if dtypes.dtype_name(where.dtype) != "bool":
        raise TypeError(
            f"{name} must be a boolean array (True keeps a position, False excludes it); "
            f"got dtype {dtypes.dtype_name(where.dtype)}"
        )
    if tuple(where.shape) == tuple(shape):
        return where
    try:
        return xp.broadcast_to(where, shape)
    except Exception:
        raise ValueError(
            f"{name} of shape {tuple(where.shape)} does not broadcast to shape {tuple(shape)}"
        ) from None


def broadcast_operand(xp: Any, value: Any, shape: tuple[int, ...], like: Any, name: str) -> Any:
    """Broadcast a real operand (``b``, a cotangent) to ``shape``, naming it on failure."""
    value = floating(xp, as_array(xp, value, name, like=like), name)
    if tuple(value.shape) == tuple(shape):
        return value
    try:
        return xp.broadcast_to(value, shape)
    except Exception:
        raise ValueError(
            f"{name} of shape {tuple(value.shape)} does not broadcast to shape {tuple(shape)}"
        ) from None


def masked_policy(masked: Any) -> str:
    """Validate the fully-masked-row policy."""
    if masked not in MASKED_POLICIES:
        raise ValueError(f"masked={masked!r} is not a policy: expected one of {MASKED_POLICIES}")
    return masked


def choice(value: Any, allowed: Sequence[Any], name: str) -> Any:
    """Validate that ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {tuple(allowed)}")
    return value


def finite_scalar(value: Any, name: str, low: float, high: float) -> float:
    """Validate a real scalar in ``[low, high]``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} is not a real number") from None
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"{name}={value!r} is out of range: expected a number in [{low}, {high}]")
    return number
