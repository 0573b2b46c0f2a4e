"""The loopback backend's manifest: cheap to call, it imports nothing but this module."""

from __future__ import annotations

from typing import Any

OPS = ("softmax", "log_softmax", "logsumexp")
DTYPES = ("float16", "float32", "float64")


def manifest() -> dict[str, Any]:
    """Declare three row operations on CPU for numpy's floating dtypes, opt-in only."""
    return {
        "name": "loopback",
        "serves": [{"ops": list(OPS), "devices": ["cpu"], "dtypes": list(DTYPES)}],
        "kernels": {op: f"softmaxkit_loopback.kernels:{op}" for op in OPS},
        "priority": 10,
        "requires_opt_in": True,
        "can_run": "softmaxkit_loopback.hooks:can_run",
        "should_run": "softmaxkit_loopback.hooks:should_run",
        "install_hint": "pip install ./tests/loopback (from the softmaxkit source tree)",
    }
