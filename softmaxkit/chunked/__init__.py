"""The ``dask`` backend: row operations and attention over chunked Dask arrays.

A row split into chunks is reduced by summaries: each chunk is summarized by the backend that
serves the chunk's own array type (numpy chunks by the fastest CPU backend, CuPy chunks by a
CUDA backend), and the summaries merge exactly, in any tree, by rescaling to the larger
maximum.  ``logsumexp`` therefore reads every chunk once; ``softmax`` and ``log_softmax`` read it
twice (summaries, then normalization with the merged summary broadcast back).  No task ever
holds more than one chunk of a row.

This module is the manifest; it imports neither dask nor any kernel library.  The kernels are
in :mod:`softmaxkit.chunked.rows` and :mod:`softmaxkit.chunked.attention`.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from ..ops import Call

OPERATIONS = ("logsumexp", "softmax", "log_softmax", "attention")

# the argument whose type decides: a dask array there means the call is ours
_PRIMARY = {"attention": "q"}


def manifest() -> dict[str, Any]:
    """The manifest of the ``dask`` backend: chunked arrays on any device, above the reference."""
    return {
        "name": "dask",
        "serves": [{"ops": list(OPERATIONS), "devices": ["*"], "dtypes": ["*"]}],
        "kernels": {
            op: f"softmaxkit.chunked.{'attention' if op == 'attention' else 'rows'}:{op}"
            for op in OPERATIONS
        },
        "priority": 100,
        "install_hint": "pip install 'softmaxkit[dask]'",
        "can_run": "softmaxkit.chunked:can_run",
        # can_run reads whether the primary argument is a Dask array, and its chunks
        "hook_keys": ["arrays", "chunks"],
    }


def can_run(call: Call) -> bool | str:
    """Accept calls on Dask arrays whose chunk sizes are known; decline everything else."""
    x = call.args.get(_PRIMARY.get(call.op, "x"))
    if not array_api_compat.is_dask_array(x):
        return "serves Dask arrays only"
    if any(c != c for dim in x.chunks for c in dim):  # NaN: unknown chunk sizes
        return "the array has unknown chunk sizes; call compute_chunk_sizes() first"
    return True
