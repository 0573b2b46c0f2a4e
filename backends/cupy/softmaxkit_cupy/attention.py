"""Adapter from the attention contract (softmaxkit/ops.py) to ``kernels/attention.cu``.

The frontend hands q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] of one 16-bit dtype
and the mask, if any, as a (possibly stride-0) boolean view of [B, Hq, Lq, Lk].
:func:`softmaxkit_cupy.manifest.can_run` has accepted the call (library, dtype, head
dimensions, sizes), so every call here has a kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import compiler, interop
from .configs import attention_config, attention_names

_configured: set[str] = set()


def _rows_ready(xp: Any, a: Any) -> Any:
    """``a`` with unit stride along its last axis and 16-byte aligned rows (a copy if not)."""
    strides = interop.element_strides(a)
    size = interop.itemsize(a)
    ok = strides[-1] == 1 and interop.pointer(a) % 16 == 0
    ok = ok and all((s * size) % 16 == 0 for s in strides[:-1])
    if ok:
        return a
    if interop.is_torch(a):
        return a.contiguous() if not a.is_contiguous() else a.clone()
    import cupy

    return cupy.array(a, copy=True, order="C")


def attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool,
) -> tuple[Any, Any]:
    """Exact attention forward on tensor cores; (out, lse or None)."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    q, k, v = (_rows_ready(xp, a) for a in (q, k, v))
    dtype = interop.name(q)
    config = attention_config(d)
    out = interop.empty(q, (b, hq, lq, d), dtype)
    lse = interop.empty(q, (b, hq, lq), "float32")
    name = config.name(dtype)
    kernel = compiler.function("attention.cu", attention_names(), name)
    if name not in _configured:
        kernel.max_dynamic_shared_size_bytes = config.shared_bytes()
        _configured.add(name)
    m_ptr, m_strides = 0, (0, 0, 0, 0)
    if mask is not None:
        m_ptr, m_strides = interop.pointer(mask), interop.element_strides(mask)
    offset = 0 if causal == "top_left" else lk - lq
    left, right = (int(w) for w in window)
    qs, ks, vs = (interop.element_strides(a) for a in (q, k, v))
    args = (
        np.uint64(interop.pointer(q)), np.uint64(interop.pointer(k)),
        np.uint64(interop.pointer(v)), np.uint64(m_ptr), np.uint64(interop.pointer(out)),
        np.uint64(interop.pointer(lse)),
        *(np.int64(s) for s in qs[:3]), *(np.int64(s) for s in ks[:3]),
        *(np.int64(s) for s in vs[:3]), *(np.int64(s) for s in m_strides),
        np.int32(hq), np.int32(hk), np.int32(lq), np.int32(lk),
        np.float32(scale), np.float32(softcap if softcap is not None else 0.0),
        np.int32(offset), np.int32(causal is not None), np.int32(left), np.int32(right),
    )
    grid = (-(-lq // config.block_m), hq, b)
    with interop.launch_context(q):
        kernel(grid, (config.threads,), args, shared_mem=config.shared_bytes())
    return out, (lse if return_lse else None)
