"""The frontend's single way into a backend: build a :class:`~softmaxkit.ops.Call`, choose, run."""

from __future__ import annotations

from typing import Any

from .dtypes import dtype_name
from .ops import Call
from .registry import choose, device_type


def run(op: str, xp: Any, like: Any, backend: str | None, **args: Any) -> Any:
    """Run operation ``op`` on the backend chosen for ``like``'s device and dtype."""
    call = Call(op, xp, device_type(like), dtype_name(like.dtype), args)
    _, kernel = choose(call, backend)
    return kernel(xp=xp, **args)
