"""The backend's manifest and its ``can_run`` / ``should_run`` hooks; imports no CuPy.

``can_run`` declines, with the reason, every call the kernels would not compute exactly as
the reference does (an unsupported array library, dtype pair, row length or option), so the
registry falls back to the next backend instead of computing it wrongly.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from .configs import ITEMSIZE, ROW_DTYPE_PAIRS, ROW_OPS, max_row_length

DTYPES = ("float16", "bfloat16", "float32")

PRIORITY = 20
"""Above the Numba CUDA backend's rows and the reference; see docs/benchmarks-cupy.md."""


def manifest() -> dict[str, Any]:
    """The manifest of the ``cupy`` backend (see :mod:`softmaxkit.registry`)."""
    kernels = {op: f"softmaxkit_cupy.rows:{op}" for op in ROW_OPS}
    return {
        "name": "cupy",
        "serves": [{"ops": sorted(kernels), "devices": ["cuda"], "dtypes": list(DTYPES)}],
        "kernels": kernels,
        "priority": PRIORITY,
        "install_hint": "pip install softmaxkit-cupy (needs cupy-cuda13x and an NVIDIA GPU)",
        "can_run": "softmaxkit_cupy.manifest:can_run",
        "should_run": "softmaxkit_cupy.manifest:should_run",
    }


def _library(a: Any) -> str | None:
    import array_api_compat

    if array_api_compat.is_torch_array(a):
        return "torch" if a.device.type == "cuda" else None
    if array_api_compat.is_cupy_array(a):
        return "cupy"
    return None


def _name(dtype: Any) -> str:
    from softmaxkit.dtypes import dtype_name

    return dtype_name(dtype)


def can_run(call: Any) -> bool | str:
    """``True`` if the kernels compute ``call`` exactly as the reference does, else why not."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed"
    if call.op in ROW_OPS:
        return _can_run_rows(call)
    return f"no kernel for {call.op}"


def _can_run_rows(call: Any) -> bool | str:
    args = call.args
    x = args["x"]
    if _library(x) is None:
        return f"inputs must be CuPy arrays or PyTorch CUDA tensors, got {type(x).__name__}"
    if args.get("where") is not None and _library(args["where"]) != _library(x):
        return "where= must live in the same library as x"
    din = _name(x.dtype)
    dout = _name(args["out_dtype"])
    if (din, dout) not in ROW_DTYPE_PAIRS:
        return f"no row kernel from {din} to {dout}; pairs served: {ROW_DTYPE_PAIRS}"
    n = int(x.shape[-1]) if x.ndim else 1
    if x.ndim == 0 or n == 0 or math.prod(x.shape) == 0:
        return "zero-size rows are left to the reference"
    longest = max_row_length(ITEMSIZE[din])
    if n > longest:
        return f"rows of {n} elements exceed the {longest} the kernels hold on chip"
    if math.prod(x.shape[:-1]) >= 2**31 // 8:
        return "more rows than one launch addresses"
    if call.op == "logsumexp" and args.get("b") is not None:
        return "weights b= are left to the other backends"
    return True


def should_run(call: Any) -> bool | str:
    """Accept every call the kernels can run (launch cost is small next to any GPU call)."""
    return True
