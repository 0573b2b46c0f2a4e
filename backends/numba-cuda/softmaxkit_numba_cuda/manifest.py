"""The backend's manifest and its ``can_run`` hook; importing this module imports no numba.

Served: the row operations (softmax, log_softmax, logsumexp, cross_entropy with its fused
gradient, softmax_vjp, log_softmax_vjp), online summaries (summarize, merge, and normalize,
the second pass of chunked softmax), the merge of partial attention states (merge_attention,
which ``merge_attention_states`` calls) and its gradient (merge_attention_vjp) on CUDA
devices, for float16, bfloat16, float32 and float64, with torch CUDA tensors and CuPy arrays;
attention and attention_vjp for float32 and float64 only (exact, on CUDA cores: float32
products and sums, float64 for float64), and in those dtypes paged_attention (the pages in
use gathered into a dense cache for the attention kernel) and varlen_attention with its
gradient varlen_attention_vjp (the packed sequences padded into dense batches of similar
lengths, their lengths and alignment as a mask).  merge is keyed by the summaries' dtype:
the accumulator's for summaries from summarize, 16-bit for summaries a caller built in it
(merged in float32, returned in their dtype).  Declined, with the reason: rows longer than
2**31 - 1; merge_attention_vjp with value dimensions beyond its shared memory (12288,
float64: 6144); attention (dense, paged or packed) with a key or value head dimension above
256.  Not served, so the registry chooses another backend: 16-bit attention forward and
backward (numba-cuda has no access to the tensor-core instructions that make them fast; the
cupy backend serves them).
Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the kernels also serve numpy arrays
on the CPU: that is how CI runs them without a GPU.
"""

from __future__ import annotations

from typing import Any

from softmaxkit.dtypes import accumulator_name, dtype_name

from .attention_tiles import MAX_HEAD_DIM, smallest_shared
from .settings import simulator_requested as _simulated

NAME = "numba-cuda"
ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")
SUMMARY_OPS = ("summarize", "merge", "normalize")
MERGE_ATTENTION_OPS = ("merge_attention", "merge_attention_vjp")
ATTENTION_OPS = ("attention", "attention_vjp")
PAGED_OPS = ("paged_attention",)
VARLEN_OPS = ("varlen_attention", "varlen_attention_vjp")
ATTENTION_DTYPES = ("float32", "float64")
DTYPES = ("float16", "bfloat16", "float32", "float64")
_PRIMARY = {"softmax": "x", "log_softmax": "x", "logsumexp": "x", "cross_entropy": "logits",
            "softmax_vjp": "probs", "log_softmax_vjp": "logprobs", "summarize": "x",
            "merge": "maxes", "normalize": "x", "merge_attention": "outs",
            "merge_attention_vjp": "outs", "attention": "q", "attention_vjp": "q",
            "paged_attention": "q", "varlen_attention": "q", "varlen_attention_vjp": "q"}
VJP_SHARED_BYTES = 48 * 1024
"""Shared memory merge_attention_vjp keeps a row's merged ``out`` in (accumulator values)."""


def manifest() -> dict[str, Any]:
    """What the backend serves and where its kernels live (see softmaxkit.registry)."""
    devices = ["cuda", "cpu"] if _simulated() else ["cuda"]
    kernels = {op: f"softmaxkit_numba_cuda.rows:{op}" for op in ROW_OPS}
    kernels.update({op: f"softmaxkit_numba_cuda.summaries:{op}" for op in SUMMARY_OPS})
    kernels.update({op: f"softmaxkit_numba_cuda.attention:{op}"
                    for op in (*MERGE_ATTENTION_OPS, *ATTENTION_OPS)})
    kernels.update({op: f"softmaxkit_numba_cuda.paged:{op}" for op in PAGED_OPS})
    kernels.update({op: f"softmaxkit_numba_cuda.varlen:{op}" for op in VARLEN_OPS})
    return {
        "name": NAME,
        "serves": [{"ops": list(ROW_OPS), "devices": devices, "dtypes": list(DTYPES)},
                   {"ops": list(SUMMARY_OPS), "devices": devices, "dtypes": list(DTYPES)},
                   {"ops": list(MERGE_ATTENTION_OPS), "devices": devices,
                    "dtypes": list(DTYPES)},
                   # 16-bit attention stays with the tensor-core kernels of the cupy backend
                   {"ops": [*ATTENTION_OPS, *PAGED_OPS, *VARLEN_OPS], "devices": devices,
                    "dtypes": list(ATTENTION_DTYPES)}],
        "kernels": kernels,
        # below the CPU backends on simulated numpy arrays, above everything on CUDA
        "priority": 20 if not _simulated() else -50,
        "install_hint": "pip install softmaxkit-numba-cuda (needs numba-cuda and a CUDA GPU)",
        "can_run": "softmaxkit_numba_cuda.manifest:can_run",
        # can_run reads the primary argument's library, row length and (merge_attention_vjp)
        # value dimension with the dtype, which is always part of the key, and (attention)
        # the shared memory of its device
        "hook_keys": ["arrays", "shapes", "devices"],
    }


def can_run(call: Any) -> bool | str:
    """``True``, or why the backend cannot run ``call``."""
    args = call.args
    x = args.get(_PRIMARY.get(call.op, "x"))
    module = type(x).__module__.split(".", 1)[0]
    if call.device == "cpu":
        if not (_simulated() and module == "numpy"):
            return "runs on CUDA devices (numpy arrays only under NUMBA_ENABLE_CUDASIM=1)"
    elif module not in ("torch", "cupy"):
        return f"takes torch CUDA tensors and CuPy arrays, not {type(x).__name__}"
    if call.op in ATTENTION_OPS or call.op in VARLEN_OPS:
        return _attention_verdict(x, args.get("v"), call.op.endswith("_vjp"))
    if call.op in PAGED_OPS:
        return _attention_verdict(x, args.get("v_pages"), False)
    shape = getattr(x, "shape", ())
    if shape and shape[-1] >= 2**31:
        return "rows of 2**31 or more positions are not supported"
    if call.op == "merge_attention_vjp" and len(shape) == 3:
        wide = dtype_name(x.dtype) == "float64"
        if shape[-1] * (8 if wide else 4) > VJP_SHARED_BYTES:
            return (f"merge_attention_vjp keeps a row in shared memory: value dimensions up "
                    f"to {VJP_SHARED_BYTES // (8 if wide else 4)}")
    return True


def _attention_verdict(q: Any, v: Any, backward: bool) -> bool | str:
    """Whether the attention kernels are built for ``q``'s and ``v``'s head dimensions, and
    the forward's (or the ``backward``'s) smallest tile fits the shared memory a block may
    take on ``q``'s device (the hooks declare ``devices``)."""
    d = int(q.shape[-1])
    dv = int(v.shape[-1]) if v is not None else d
    if max(d, dv) > MAX_HEAD_DIM:
        return (f"attention kernels serve head dimensions up to {MAX_HEAD_DIM} "
                f"(got D={d}, Dv={dv})")
    if _simulated():  # the simulator's blocks have no shared memory limit
        return True
    acc = accumulator_name(dtype_name(q.dtype))
    need = smallest_shared(acc, d, dv, backward)
    from .arrays import library, shared_limit

    limit = shared_limit(q, library(q))
    if need > limit:
        return (f"the {'backward' if backward else 'forward'} attention kernel at D={d}, "
                f"Dv={dv} in {acc} takes {need} bytes of shared memory a block on its "
                f"smallest tile; this device gives {limit}")
    return True
