"""Per-call hooks: what loopback can compute, and what it should leave to other backends."""

from __future__ import annotations

import math

import numpy as np

from softmaxkit.ops import Call

MAX_ELEMENTS = 1 << 22
"""Inputs larger than this are left to faster backends unless loopback is asked for by name."""


def can_run(call: Call) -> bool | str:
    """Loopback computes with numpy, so it accepts numpy arrays only."""
    x = call.args.get("x")
    if not isinstance(x, np.ndarray):
        return f"loopback computes on numpy arrays, not {type(x).__module__}.{type(x).__name__}"
    return True


def should_run(call: Call) -> bool | str:
    """Decline large inputs: loopback exists to test the plugin path, not to be fast."""
    size = math.prod(call.args["x"].shape)
    if size > MAX_ELEMENTS:
        return f"{size} elements is more than loopback's {MAX_ELEMENTS}"
    return True
