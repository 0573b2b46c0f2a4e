"""The backend's manifest and its ``can_run`` / ``should_run`` hooks; imports no CuPy.

``can_run`` declines, with the reason, every call the kernels would not compute exactly as
the reference does (an unsupported array library, dtype pair, row length or option), so the
registry falls back to the next backend instead of computing it wrongly.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

from .configs import (
    ATTENTION_DTYPES,
    F32_BACKWARD_CONFIGS,
    F32_CONFIGS,
    F32_SERVED,
    GRAD_CONFIGS,
    GRAD_OPS,
    ITEMSIZE,
    MERGE_DTYPES,
    ROW_DTYPE_PAIRS,
    ROW_OPS,
    TF32_CONFIGS,
    TF32_PRECISIONS,
    attention_shared_bytes,
    decode_holds,
    f32_backward_shape,
    f32_config,
    f32_shape,
    max_row_length,
    row_lean,
    tf32_serves,
    tf32_width,
)
from .head_dims import LARGEST, head_dim_reason, served_head_dim

DTYPES = ("float16", "bfloat16", "float32")

PRIORITY = 25
"""Above the Numba CUDA backend (20) and the reference (-100): the attention kernels are the
only tensor-core ones, the 16-bit row kernels lead Numba CUDA's in eager calls, and a small
call costs less than Numba CUDA's (docs/benchmarks-cupy.md)."""

LARGE_FLOAT32_ROWS = 1 << 24
"""float32 softmax and log_softmax calls of at least this many elements are left to Numba
CUDA when it is installed: its float32 normalization kernels are faster on such inputs in
eager calls (docs/benchmarks-eager.md), and on inputs this large its per-call cost hides
behind the kernel.  Smaller calls stay here."""
LARGE_FLOAT32_SUMS = 1 << 26
"""The same for float32 logsumexp, whose kernel here leads up to larger inputs."""
LARGE_CROSS_ENTROPY = 1 << 26
"""Cross-entropy calls (any dtype) of at least this many logits are left to Numba CUDA: its
fused kernel is the faster one there (docs/benchmarks-eager.md)."""


NAME = "cupy"

MIN_CAPABILITY = 80
"""The oldest devices the kernels are built for: compute capability 8.0 (as a number)."""

VARLEN_OPS = ("varlen_attention", "varlen_attention_vjp")


def manifest() -> dict[str, Any]:
    """The manifest of the ``cupy`` backend (see :mod:`softmaxkit.registry`)."""
    kernels = {op: f"softmaxkit_cupy.rows:{op}" for op in (*ROW_OPS, *GRAD_OPS)}
    kernels["attention"] = "softmaxkit_cupy.attention:attention"
    kernels["attention_vjp"] = "softmaxkit_cupy.attention:attention_vjp"
    kernels["merge_attention"] = "softmaxkit_cupy.attention:merge_attention"
    kernels.update({op: f"softmaxkit_cupy.varlen:{op}" for op in VARLEN_OPS})
    kernels["paged_attention"] = "softmaxkit_cupy.paged:paged_attention"
    return {
        "name": NAME,
        "serves": [
            {"ops": sorted((*ROW_OPS, *GRAD_OPS)), "devices": ["cuda"], "dtypes": list(DTYPES)},
            {"ops": ["attention", "attention_vjp"], "devices": ["cuda"],
             "dtypes": list(ATTENTION_DTYPES)},
            # float32 on TF32 tensor cores at the reduced precisions and, once served
            # (configs.F32_SERVED), exact on CUDA cores; the exact gradient serves every
            # precision (none asks for more); the rest of float32 attention is numba-cuda's
            {"ops": ["attention"], "devices": ["cuda"], "dtypes": ["float32"],
             "precisions": [*(["float32"] if F32_SERVED else []), *TF32_PRECISIONS]},
            *([{"ops": ["attention_vjp"], "devices": ["cuda"], "dtypes": ["float32"],
                "precisions": ["float32", *TF32_PRECISIONS]}] if F32_SERVED else []),
            {"ops": ["merge_attention"], "devices": ["cuda"], "dtypes": list(MERGE_DTYPES)},
            # float32 packed sequences on the exact kernels, forward and gradient, at every
            # precision (none asks for more)
            {"ops": list(VARLEN_OPS), "devices": ["cuda"],
             "dtypes": [*ATTENTION_DTYPES, *(["float32"] if F32_SERVED else [])]},
            {"ops": ["paged_attention"], "devices": ["cuda"],
             "dtypes": [*ATTENTION_DTYPES, *(["float32"] if F32_SERVED else [])]},
        ],
        "kernels": kernels,
        "priority": PRIORITY,
        "install_hint": "pip install softmaxkit-cupy (needs cupy-cuda13x and an NVIDIA GPU)",
        "can_run": "softmaxkit_cupy.manifest:can_run",
        "should_run": "softmaxkit_cupy.manifest:should_run",
        # the hooks read the arrays' libraries, dtypes, shapes and devices (the row kernels
        # hold shorter rows on a GPU without thread-block clusters), out_dtype and the options
        "hook_keys": ["arrays", "shapes", "out_dtype", "options", "devices"],
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


@functools.cache
def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def can_run(call: Any) -> bool | str:
    """``True`` if the kernels compute ``call`` exactly as the reference does, else why not."""
    if not _cupy_installed():
        return "cupy is not installed"
    reason = _capability_reason(call.args)
    if reason:
        return reason
    if call.op in ROW_OPS:
        return _can_run_rows(call)
    if call.op in GRAD_OPS:
        return _can_run_grads(call)
    if call.op == "attention":
        return _can_run_attention(call)
    if call.op == "attention_vjp":
        return _can_run_attention_vjp(call)
    if call.op == "merge_attention":
        return _can_run_merge(call)
    if call.op in VARLEN_OPS:
        return _can_run_varlen(call)
    if call.op == "paged_attention":
        return _can_run_paged(call)
    return f"no kernel for {call.op}"


def _capability_reason(args: dict[str, Any]) -> str | None:
    """Why the kernels cannot run on the device of the call's first array, or None: they are
    built for compute capability 8.0 and newer (cp.async, bfloat16 tensor-core products)."""
    first = next((a for a in args.values() if hasattr(a, "shape")), None)
    index = None if first is None or _library(first) is None else _device(first)
    if index is None:
        return None
    from .interop import capability

    found = capability(index)
    if found < MIN_CAPABILITY:
        return (f"the cupy kernels need compute capability {MIN_CAPABILITY // 10}."
                f"{MIN_CAPABILITY % 10} or newer; device {index} is {found // 10}.{found % 10}")
    return None


def _can_run_attention(call: Any) -> bool | str:
    args = call.args
    q, k, v, mask = args["q"], args["k"], args["v"], args.get("mask")
    lib = _library(q)
    if lib is None:
        return f"inputs must be CuPy arrays or PyTorch CUDA tensors, got {type(q).__name__}"
    if any(_library(a) != lib for a in (k, v) + ((mask,) if mask is not None else ())):
        return "q, k, v and mask must live in one library"
    if _name(q.dtype) == "float32":
        shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        if tf32_serves(args.get("precision", "float32"), shapes[0][-1], shapes[2][-1]):
            return tf32_reason(*shapes) or True
        return f32_reason(*shapes, _shared_limit(q)) or True
    return attention_reason(
        _name(q.dtype), tuple(q.shape), tuple(k.shape), tuple(v.shape), _shared_limit(q)
    ) or True


def _device(a: Any) -> int | None:
    """The index of the CUDA device ``a`` lives on (the hooks declare ``devices``), or None
    for an array on no CUDA device (then no device limit applies)."""
    from .interop import device_index

    index = device_index(a)
    return index if index >= 0 else None


def _shared_limit(a: Any) -> int | None:
    """The shared memory a block may take on ``a``'s device, or None (:func:`_device`)."""
    from .interop import shared_limit

    index = _device(a)
    return None if index is None else shared_limit(index)


def shared_reason(head_dim: int, kind: str, limit: int | None) -> str | None:
    """Why the attention kernels of ``kind`` (:func:`.configs.attention_shared_bytes`) at
    ``head_dim`` cannot run on a device whose blocks may take ``limit`` bytes of shared
    memory, or None when they fit (or no limit is given)."""
    need = attention_shared_bytes(head_dim, kind, limit)
    if limit is None or need <= limit:
        return None
    return (f"the {kind} attention kernel at head dim {head_dim} takes {need} bytes of shared "
            f"memory a block; this device gives {limit}")


def _operands_reason(args: dict[str, Any], together: tuple[str, ...], library_note: str,
                     grads: bool) -> str | None:
    """Why the arrays of an attention call cannot reach one kernel, or None: ``q`` and the
    arrays named in ``together`` (those given) in one library, q, k, v (and out, dout for a
    gradient) in one dtype, and a gradient's lse in float32."""
    lib = _library(args["q"])
    if lib is None:
        return ("inputs must be CuPy arrays or PyTorch CUDA tensors, "
                f"got {type(args['q']).__name__}")
    if any(args.get(n) is not None and _library(args[n]) != lib for n in together):
        return library_note
    dtype = _name(args["q"].dtype)
    if any(_name(args[n].dtype) != dtype for n in ("k", "v", *(("out", "dout") if grads else ()))):
        return ("q, k, v, out and dout must share one dtype" if grads
                else "q, k and v must share one dtype")
    if grads and _name(args["lse"].dtype) != "float32":
        return "lse must be float32"
    return None


def _can_run_attention_vjp(call: Any) -> bool | str:
    args = call.args
    reason = _operands_reason(args, ("k", "v", "out", "lse", "dout", "mask"),
                              "q, k, v, out, lse, dout and mask must live in one library", True)
    if reason:
        return reason
    dtype = _name(args["q"].dtype)
    shapes = (tuple(args["q"].shape), tuple(args["k"].shape), tuple(args["v"].shape))
    if dtype == "float32":  # exact at every precision
        return f32_reason(*shapes, _shared_limit(args["q"]), backward=True) or True
    return attention_vjp_reason(dtype, *shapes, _shared_limit(args["q"])) or True


def attention_vjp_reason(
    dtype: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
    shared_limit: int | None = None,
) -> str | None:
    """Why the backward kernels cannot run these inputs, or None when they can.

    The forward's limits apply, with the backward's shared memory; calls with no query row or
    no key run without a launch.
    """
    return attention_reason(dtype, q_shape, k_shape, v_shape, shared_limit, "backward")


def _can_run_varlen(call: Any) -> bool | str:
    args = call.args
    reason = _operands_reason(
        args, ("k", "v", "cu_seqlens_q", "cu_seqlens_k", "out", "lse", "dout"),
        "the arrays and the cumulative lengths must live in one library",
        call.op == "varlen_attention_vjp")
    if reason:
        return reason
    dtype = _name(args["q"].dtype)
    batches = int(args["cu_seqlens_q"].shape[0]) - 1
    return varlen_reason(dtype, batches, tuple(args["q"].shape), tuple(args["k"].shape),
                         tuple(args["v"].shape), _shared_limit(args["q"]),
                         "backward" if call.op == "varlen_attention_vjp" else "varlen") or True


def varlen_reason(
    dtype: str, batches: int, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
    v_shape: tuple[int, ...], shared_limit: int | None = None, kind: str = "varlen",
) -> str | None:
    """Why the packed variable-length kernels cannot run these inputs, or None when they can.

    The dense kernels' limits (:func:`attention_reason`; in float32 :func:`f32_reason`) apply
    to a dense batch of ``batches`` sequences as long as the packed query rows padded to
    whole tiles (the backward's work arrays) and the packed keys, with the shared memory of
    ``kind`` (``"varlen"``, the forward, or ``"backward"``); calls with no query row or no
    key run without a launch.
    """
    tq, hq, d = q_shape
    tk, hk, _ = k_shape
    padded = tq + batches * 128  # at most one partial tile (of up to 128 rows) per sequence
    shapes = ((batches, hq, padded if tq else 0, d), (batches, hk, tk, d),
              (batches, hk, tk, v_shape[-1]))
    if dtype == "float32" and F32_SERVED:
        return f32_reason(*shapes, shared_limit, backward=kind == "backward")
    return attention_reason(dtype, *shapes, shared_limit, kind)


def _can_run_paged(call: Any) -> bool | str:
    args = call.args
    q, k_pages, v_pages = args["q"], args["k_pages"], args["v_pages"]
    lib = _library(q)
    if lib is None:
        return f"inputs must be CuPy arrays or PyTorch CUDA tensors, got {type(q).__name__}"
    if any(_library(args[n]) != lib for n in ("k_pages", "v_pages", "block_table", "seqlens")):
        return "q, k_pages, v_pages, block_table and seqlens must live in one library"
    dtype = _name(q.dtype)
    if _name(k_pages.dtype) != dtype or _name(v_pages.dtype) != dtype:
        return "q, k_pages and v_pages must share one dtype"
    return paged_reason(dtype, tuple(q.shape), tuple(k_pages.shape), tuple(v_pages.shape),
                        tuple(args["block_table"].shape), _shared_limit(q)) or True


def paged_reason(
    dtype: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
    table_shape: tuple[int, ...], shared_limit: int | None = None,
) -> str | None:
    """Why the paged decode kernel cannot run these inputs, or None when it can.

    ``q_shape`` is ``[B, Hq, Lq, D]``, ``k_shape`` and ``v_shape`` the pools'
    ``[P, Hk, S, D]`` and ``[P, Hk, S, Dv]``, ``table_shape`` the block table's
    ``[B, max_pages]``.  Every D and Dv from 1 to 256 is served, those the kernel is not built
    for on zero-padded copies of q and the pools (:mod:`.head_dims`).  The decode kernel
    holds at most ``DECODE_ROWS`` query rows (``Hq / Hk`` heads times ``Lq`` queries) per key
    head; a longer chunked prefill runs on the dense attention kernels over the gathered pages
    (:mod:`.paged`), whose limits then apply.  Calls with no query row or no page in the table
    run without a launch, at the dtypes and head dimensions the kernel serves.  float32 calls
    run on the exact dense kernels over the gathered pages (:func:`f32_reason`'s limits).
    """
    b, hq, lq, d = q_shape
    pages, hk, page_size, _ = k_shape
    capacity = table_shape[1] * page_size
    if dtype == "float32" and F32_SERVED:
        return f32_reason((b, hq, lq, d), (b, hk, capacity, d), (b, hk, capacity, v_shape[-1]),
                          shared_limit)
    if dtype not in ATTENTION_DTYPES:
        return f"the paged attention kernel takes {ATTENTION_DTYPES}, not {dtype}"
    reason = head_dim_reason(d, v_shape[-1])
    if reason:
        return reason
    if b * hq * lq == 0 or capacity == 0:
        return None  # no launch, so no launch limit applies
    if not decode_holds(hq, hk, lq):  # a long chunked prefill: the dense kernels' limits
        return attention_reason(dtype, (b, hq, lq, d), (b, hk, capacity, d),
                                (b, hk, capacity, v_shape[-1]), shared_limit)
    reason = shared_reason(served_head_dim(d, v_shape[-1]), "decode", shared_limit)
    if reason:
        return reason
    if b > 65535 or hk > 65535:
        return "more than 65535 sequences or key heads per launch"
    if capacity >= 2**31 // 256 or pages >= 2**31:
        return "block table or page pool too large for 32-bit key positions and page indices"
    return None


def _can_run_merge(call: Any) -> bool | str:
    outs, lses = call.args["outs"], call.args["lses"]
    if _library(outs) is None or _library(lses) != _library(outs):
        return "outs and lses must be CuPy arrays or PyTorch CUDA tensors of one library"
    return merge_reason(_name(outs.dtype), _name(lses.dtype), tuple(outs.shape)) or True


def merge_reason(dtype: str, lse_dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why the merge kernel cannot merge ``outs`` of this dtype and shape, or None."""
    if dtype not in MERGE_DTYPES or lse_dtype != "float32":
        return f"the merge kernel takes outs in {MERGE_DTYPES} with float32 lses"
    if len(shape) != 3 or math.prod(shape) == 0:
        return "zero-size merges are left to the reference"
    if shape[1] >= 2**31 // 8:
        return "more rows than one launch addresses"
    return None


def f32_reason(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
    shared_limit: int | None = None, backward: bool = False,
) -> str | None:
    """Why the exact float32 forward (kernels/attention_f32.cu), or its backward, cannot run
    these inputs on a device whose blocks may take ``shared_limit`` bytes of shared memory,
    or None when it can: each is built for the (D, Dv) pairs of its table (``F32_CONFIGS``,
    ``F32_BACKWARD_CONFIGS``) and runs other pairs within the largest on zero-padded copies
    (:func:`.configs.f32_shape`); larger ones, and tiles the device's shared memory cannot
    hold, run on numba-cuda's exact kernels.  Calls with no query row or no key run without
    a launch."""
    b, hq, lq, d = q_shape
    table, shape_of, kind = ((F32_BACKWARD_CONFIGS, f32_backward_shape, "backward")
                             if backward else (F32_CONFIGS, f32_shape, "forward"))
    shape = shape_of(d, v_shape[-1])
    if shape is None:
        return (f"the float32 attention {kind} takes D and Dv up to {max(table)[0]}, "
                f"not D={d}, Dv={v_shape[-1]}")
    if b * hq * lq == 0 or k_shape[2] == 0:
        return None
    tile = (table[shape] if backward
            else f32_config(*shape, masked=True, shared_limit=shared_limit))
    need = tile.shared_bytes()
    if shared_limit is not None and need > shared_limit:
        return (f"the float32 attention {kind} at D={shape[0]}, Dv={shape[1]} takes {need} "
                f"bytes of shared memory a block; this device gives {shared_limit}")
    return _launch_reason(b, hq, lq, k_shape[2])


def _launch_reason(b: int, hq: int, lq: int, lk: int) -> str | None:
    """Why one launch of the dense attention kernels cannot address these sizes, or None."""
    if b > 65535 or hq > 65535:
        return "more than 65535 batches or heads per launch"
    if max(lq, lk) >= 2**31 // 256:
        return "sequences too long for 32-bit indexing"
    return None


def tf32_reason(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...]
) -> str | None:
    """Why the float32 TF32 forward (kernels/attention_tf32.cu) cannot run these inputs, or
    None when it can: it is built for D = Dv in ``TF32_CONFIGS`` and runs smaller D and Dv on
    zero-padded copies (:func:`.configs.tf32_width`); larger ones run on the exact kernels
    of kernels/attention_f32.cu (:func:`f32_reason` decides those).
    Calls with no query row or no key run without a launch."""
    b, hq, lq, d = q_shape
    if tf32_width(d, v_shape[-1]) is None:
        return (f"the TF32 attention kernels take D and Dv up to {max(TF32_CONFIGS)}, "
                f"not D={d}, Dv={v_shape[-1]}")
    if b * hq * lq == 0 or k_shape[2] == 0:
        return None
    return _launch_reason(b, hq, lq, k_shape[2])


def attention_reason(
    dtype: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
    shared_limit: int | None = None, kind: str = "forward",
) -> str | None:
    """Why the forward kernel (the kernels of ``kind``, :func:`shared_reason`) cannot run
    these inputs on a device whose blocks may take ``shared_limit`` bytes of shared memory,
    or None when it can.

    Every key dimension D from 1 to 256 is served, with any value dimension Dv: those the
    kernels are not built for (D != Dv, or D outside ``ATTENTION_HEAD_DIMS``) on zero-padded
    copies of the arrays, a Dv above 256 in blocks of value columns, a call each
    (:mod:`.head_dims`).  Calls with no query row or no key are served at the same head
    dimensions: their results are fixed by the spec and made without a launch.
    """
    if dtype not in ATTENTION_DTYPES:
        return f"the attention kernels take {ATTENTION_DTYPES}, not {dtype}"
    b, hq, lq, d = q_shape
    reason = head_dim_reason(d, v_shape[-1], split=True)
    if reason:
        return reason
    if b * hq * lq == 0 or k_shape[2] == 0:
        return None  # no launch, so no launch limit applies
    # the widest block of value columns (value_blocks) decides the width
    width = served_head_dim(d, min(v_shape[-1], LARGEST))
    return shared_reason(width, kind, shared_limit) or _launch_reason(b, hq, lq, k_shape[2])


def _can_run_rows(call: Any) -> bool | str:
    args = call.args
    x = args["x"]
    if _library(x) is None:
        return f"inputs must be CuPy arrays or PyTorch CUDA tensors, got {type(x).__name__}"
    if args.get("where") is not None and _library(args["where"]) != _library(x):
        return "where= must live in the same library as x"
    from .interop import has_clusters

    index = _device(x)
    return row_reason(
        call.op, _name(x.dtype), _name(args["out_dtype"]), tuple(x.shape),
        weighted=args.get("b") is not None,
        clusters=index is None or has_clusters(index),
    ) or True


def row_reason(
    op: str, din: str, dout: str, shape: tuple[int, ...], weighted: bool = False,
    clusters: bool = True,
) -> str | None:
    """Why the row kernels cannot run ``op`` on rows of ``shape`` on a device with
    thread-block clusters or (``clusters=False``) without, or None when they can."""
    if (din, dout) not in ROW_DTYPE_PAIRS:
        return f"no row kernel from {din} to {dout}; pairs served: {ROW_DTYPE_PAIRS}"
    if len(shape) == 0 or math.prod(shape) == 0:
        return "zero-size rows are left to the reference"
    n = shape[-1]
    longest = max_row_length(ITEMSIZE[din], row_lean(op, din, dout), clusters)
    if n > longest:
        where = "" if clusters else " of a device without thread-block clusters"
        return f"rows of {n} elements exceed the {longest} the kernels{where} hold on chip"
    if math.prod(shape[:-1]) >= 2**31 // 8:
        return "more rows than one launch addresses"
    if op == "logsumexp" and weighted:
        return "weights b= are left to the other backends"
    return None


_PRIMAL = {"softmax_vjp": "probs", "log_softmax_vjp": "logprobs", "cross_entropy": "logits"}


def _can_run_grads(call: Any) -> bool | str:
    args = call.args
    primal = args[_PRIMAL[call.op]]
    lib = _library(primal)
    if lib is None:
        return f"inputs must be CuPy arrays or PyTorch CUDA tensors, got {type(primal).__name__}"
    others = [args.get(name) for name in ("cotangent", "where", "index")]
    if any(a is not None and _library(a) != lib for a in others):
        return "every array argument must live in the library and device of the first"
    if call.op == "cross_entropy":
        if args.get("probs") is not None:
            return "probability targets are left to the other backends"
        dtypes = (_name(primal.dtype), _name(args["out_dtype"]))
        scale = args.get("grad_scale")
        if scale is not None and not isinstance(scale, (int, float)):
            if _library(scale) != lib or math.prod(getattr(scale, "shape", ())) != 1:
                return "grad_scale must be a number or a one-element array beside the logits"
    else:
        dtypes = (_name(primal.dtype), _name(args["cotangent"].dtype), _name(args["out_dtype"]))
    return grad_reason(dtypes, tuple(primal.shape)) or True


def grad_reason(dtypes: tuple[str, ...], shape: tuple[int, ...]) -> str | None:
    """Why the gradient kernels cannot run rows of ``shape`` and these dtypes, or None."""
    if len(set(dtypes)) != 1 or dtypes[0] not in DTYPES:
        return f"the gradient kernels take one dtype of {DTYPES} throughout, got {dtypes}"
    if len(shape) == 0 or math.prod(shape) == 0:
        return "zero-size rows are left to the reference"
    longest = GRAD_CONFIGS[-1].capacity(ITEMSIZE[dtypes[0]])
    if shape[-1] > longest:
        return f"rows of {shape[-1]} elements exceed the {longest} the gradient kernels hold"
    if math.prod(shape[:-1]) >= 2**31 // 8:
        return "more rows than one launch addresses"
    return None


def _large(call: Any) -> int | None:
    """The element count of a call this backend leaves to Numba CUDA when it can, or None."""
    if call.op == "cross_entropy":
        size = math.prod(tuple(call.args["logits"].shape))
        return size if size >= LARGE_CROSS_ENTROPY else None
    if call.op not in ROW_OPS or call.dtype != "float32":
        return None
    size = math.prod(tuple(call.args["x"].shape))
    large = LARGE_FLOAT32_SUMS if call.op == "logsumexp" else LARGE_FLOAT32_ROWS
    return size if size >= large else None


def should_run(call: Any) -> bool | str:
    """Accept every call the kernels can run, except large float32 row calls and large
    cross-entropy calls when Numba CUDA is installed to take them (see
    :data:`LARGE_FLOAT32_ROWS`, :data:`LARGE_FLOAT32_SUMS`, :data:`LARGE_CROSS_ENTROPY`) and
    the user has not prioritized this backend.

    It reads the operation, dtype and shape of the primary argument (declared in
    ``hook_keys``) and the registry's backends (a change there empties the decision cache).
    """
    size = _large(call)
    if size is None:
        return True
    from softmaxkit.registry import candidates, prioritized

    # only when numba-cuda is tried for this call (installed, not disabled): a call it takes
    # goes there, never to the reference
    if NAME in prioritized() or "numba-cuda" not in candidates(call.op, call.device,
                                                                call.dtype)[0]:
        return True
    return (f"{call.op} of {size} {call.dtype} elements is left to numba-cuda, whose kernels "
            "are faster on large inputs")
