"""The frontend's single way into a backend: choose the kernel for the call, run it."""

from __future__ import annotations

from typing import Any

from .registry import kernel_for


def run(op: str, xp: Any, like: Any, backend: str | None, **args: Any) -> Any:
    """Run operation ``op`` on the backend chosen for ``like``'s device and dtype."""
    return kernel_for(op, xp, like, args, backend)(xp=xp, **args)
