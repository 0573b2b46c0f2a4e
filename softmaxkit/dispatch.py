"""The frontend's single way into a backend: choose the kernel for the call, run it."""

from __future__ import annotations

from typing import Any

from .registry import Binding, bind, kernel_for


def run(op: str, xp: Any, like: Any, backend: str | None, **args: Any) -> Any:
    """Run operation ``op`` on the backend chosen for ``like``'s device and dtype."""
    return kernel_for(op, xp, like, args, backend)(xp=xp, **args)


def run_bound(op: str, xp: Any, like: Any, args: dict[str, Any]) -> tuple[Any, Binding | None]:
    """:func:`run` with no ``backend=``, and the binding of the decision taken, where the
    caller may keep it for later calls of the same kind (:func:`~.registry.bind`)."""
    kernel, binding = bind(op, xp, like, args)
    return kernel(xp=xp, **args), binding
