"""Adapter from the attention contract (softmaxkit/ops.py) to ``kernels/attention_tf32.cu``:
float32 inputs on TF32 tensor cores at ``precision="tf32"`` or ``"tf32x3"`` (spec "Attention",
"Precision").

The manifest serves float32 attention at those two precisions only; float32 calls at the
default ``"float32"`` and every float32 gradient stay on the exact kernels of the numba-cuda
backend.  :func:`softmaxkit_cupy.manifest.can_run` has accepted the call
(:func:`softmaxkit_cupy.manifest.tf32_reason`: D and Dv up to the largest head dimension of
``TF32_CONFIGS``, launch limits), so every call with work has a kernel, at its own head
dimension or on zero-padded copies; calls with no query row or no
key get the spec's fixed results without a launch.
"""

from __future__ import annotations

import functools
from typing import Any

from softmaxkit.options import note_kernel

from . import compiler, head_dims, interop
from .attention import FORWARD_PARAMS, _forward_without_work, _rows_ready
from .configs import (
    Tf32Config,
    tf32_alternative_names,
    tf32_config,
    tf32_names,
    tf32_width,
)
from .mask_bits import mask_bits


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` of kernels/attention_tf32.cu, built on first use with the module
    of every declared configuration (an alternative given explicitly: with the module of the
    alternatives)."""
    names = tf32_names()
    return compiler.function("attention_tf32.cu", names if name in names
                             else tf32_alternative_names(), name)


def attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool, precision: str,
    config: Tf32Config | None = None,
) -> tuple[Any, Any]:
    """Attention forward of float32 q, k, v on TF32 tensor cores; (out, lse or None).

    ``precision`` is ``"tf32"`` (one product of TF32-rounded operands per product) or
    ``"tf32x3"`` (three products of split operands); ``config`` overrides the tile
    configuration (by default :func:`.configs.tf32_config` of the head dimension).  A call
    whose D and Dv are not one built head dimension runs on copies of q, k, v zero-padded to
    :func:`.configs.tf32_width` (zero columns add nothing to a score, and the output's extra
    columns are dropped).
    """
    fixed = _forward_without_work(q, k, v)
    if fixed is not None:
        return fixed[0], (fixed[1] if return_lse else None)
    d, dv = int(q.shape[3]), int(v.shape[3])
    width = config.head_dim if config is not None else tf32_width(d, dv)
    if width is None:
        raise ValueError(f"no TF32 attention kernel for D={d}, Dv={dv}")
    with interop.on_device(q):
        return head_dims.forward_padded(
            xp, None if width == d == dv else width, lambda q, k, v: _attention(
                xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window, mask=mask,
                softcap=softcap, return_lse=return_lse, precision=precision, config=config),
            q, k, v)


def _attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool, precision: str, config: Tf32Config | None,
) -> tuple[Any, Any]:
    """:func:`attention` of a call with work at a built head dimension (D = Dv)."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    config = config or tf32_config(d, mask is not None)
    if config is None or config.head_dim != d or int(v.shape[3]) != d:
        raise ValueError(f"no TF32 attention kernel for D={d}, Dv={int(v.shape[3])}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    q, k, v = (_rows_ready(xp, a) for a in (q, k, v))
    m_ptr, m_strides = 0, (0, 0, 0)
    if mask is not None:
        bits, m_strides = mask_bits(mask)
        m_ptr = interop.pointer(bits)
    offset = 0 if causal == "top_left" else lk - lq
    left, right = (int(w) for w in window)
    qs, ks, vs = (interop.element_strides(a) for a in (q, k, v))
    out = interop.empty(q, (b, hq, lq, d), "float32")
    lse = interop.empty(q, (b, hq, lq), "float32")
    name = config.name(precision)
    note_kernel(name)
    args = (interop.pointer(q), interop.pointer(k), interop.pointer(v), m_ptr,
            interop.pointer(out), interop.pointer(lse), *qs[:3], *ks[:3], *vs[:3],
            *m_strides, hq, hk, lq, lk, scale, softcap if softcap is not None else 0.0,
            offset, causal is not None, left, right)
    interop.launch(_kernel(name), q, (-(-lq // config.block_m), hq, b), config.threads,
                   FORWARD_PARAMS, args, config.shared_bytes())
    return out, (lse if return_lse else None)
