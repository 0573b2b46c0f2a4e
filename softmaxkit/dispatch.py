"""The frontend's single way into a backend: build a :class:`~softmaxkit.ops.Call`, choose, run."""

from __future__ import annotations

from typing import Any

from .dtypes import dtype_name
from .ops import Call
from .registry import choose, device_type

# dtype objects are few and hashable; naming one costs more than the rest of dispatch
_DTYPE_NAMES: dict[tuple[type, Any], str] = {}


def _dtype_name(dtype: Any) -> str:
    # keyed with the type first: array_api_strict warns when its dtypes meet numpy's in ==
    key = (type(dtype), dtype)
    try:
        return _DTYPE_NAMES[key]
    except KeyError:
        name = _DTYPE_NAMES[key] = dtype_name(dtype)
        return name
    except TypeError:  # an unhashable dtype object
        return dtype_name(dtype)


def run(op: str, xp: Any, like: Any, backend: str | None, **args: Any) -> Any:
    """Run operation ``op`` on the backend chosen for ``like``'s device and dtype."""
    call = Call(op=op, xp=xp, device=device_type(like), dtype=_dtype_name(like.dtype), args=args)
    _, kernel = choose(call, backend)
    return kernel(xp=xp, **args)
