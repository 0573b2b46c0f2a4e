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
import math
from typing import Any

import array_api_compat

from softmaxkit.options import note_kernel

from . import compiler, head_dims, interop
from .attention import (
    BACKWARD_PARAMS,
    _backward_without_work,
    _forward_without_work,
    _rows_ready,
    float32_forward,
    kernel_options,
)
from .configs import (
    Tf32BackwardConfig,
    Tf32Config,
    tf32_alternative_names,
    tf32_backward_config,
    tf32_backward_names,
    tf32_config,
    tf32_names,
    tf32_width,
)


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` of kernels/attention_tf32.cu, built on first use with the module
    of every declared configuration (an alternative given explicitly: with the module of the
    alternatives; any other configuration: alone)."""
    for names in (tf32_names(), tf32_backward_names(), tf32_alternative_names()):
        if name in names:
            return compiler.function("attention_tf32.cu", names, name)
    return compiler.function("attention_tf32.cu", (name,), name)


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
    d = int(q.shape[3])
    config = config or tf32_config(d, mask is not None)
    if config is None or config.head_dim != d or int(v.shape[3]) != d:
        raise ValueError(f"no TF32 attention kernel for D={d}, Dv={int(v.shape[3])}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    name = config.name(precision)
    return float32_forward(xp, _kernel(name), name, config, q=q, k=k, v=v, scale=scale,
                           causal=causal, window=window, mask=mask, softcap=softcap,
                           return_lse=return_lse)


LOG2E = 1.4426950408889634


def attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, precision: str,
    dlse: Any = None, config: Tf32BackwardConfig | None = None,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of float32 attention on TF32 tensor cores, recomputing P from ``lse``.

    Built on request (the manifest does not serve float32 gradients here yet:
    :data:`.configs.TF32_BACKWARD_CONFIGS`).  The rows' lse in log2 units (+inf where
    there is no allowed key) and ``delta = rowsum(dout * out) - dlse`` are array operations,
    the main kernel (sk_attn_bwd_tf32) writes dk and dv and adds dq's products into a float32
    buffer, which is scaled.  D and Dv not one built head dimension run zero-padded, as in
    :func:`attention`.
    """
    fixed = _backward_without_work(q, k, v)
    if fixed is not None:
        return fixed
    d, dv = int(q.shape[3]), int(v.shape[3])
    width = config.head_dim if config is not None else tf32_width(d, dv)
    if width is None:
        raise ValueError(f"no TF32 attention kernel for D={d}, Dv={dv}")
    with interop.on_device(q):
        return head_dims.gradients_padded(
            xp, None if width == d == dv else width, lambda q, k, v, out, dout: _vjp(
                xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale, causal=causal,
                window=window, mask=mask, softcap=softcap, precision=precision, dlse=dlse,
                config=config), q, k, v, out, dout)


def _vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, precision: str, dlse: Any,
    config: Tf32BackwardConfig | None,
) -> tuple[Any, Any, Any]:
    """:func:`attention_vjp` of a call with work at a built head dimension (D = Dv)."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    config = config or tf32_backward_config(d, mask is not None)
    if config is None or config.head_dim != d or int(v.shape[3]) != d:
        raise ValueError(f"no TF32 attention backward for D={d}, Dv={int(v.shape[3])}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    q, k, v, dout = (_rows_ready(xp, a) for a in (q, k, v, dout))
    lq_pad = -(-lq // config.block_m) * config.block_m
    # per row: lse in log2 units (+inf: P = 0) and delta, padded rows +inf and 0
    delta = xp.sum(out * dout, axis=-1)
    if dlse is not None:
        delta = delta - dlse
    lse2 = xp.where(lse == -math.inf, math.inf, lse * LOG2E)
    delta = xp.where(lse == -math.inf, 0.0, delta)
    if lq_pad != lq:
        lse2 = xp.concat([lse2, xp.full((b, hq, lq_pad - lq), math.inf, dtype=lse2.dtype,
                                        device=array_api_compat.device(q))], axis=-1)
        delta = xp.concat([delta, xp.zeros((b, hq, lq_pad - lq), dtype=delta.dtype,
                                           device=array_api_compat.device(q))], axis=-1)
    lse2, delta = (interop.contiguous(xp.astype(a, xp.float32)) for a in (lse2, delta))
    dq_acc = interop.zeros(q, (b, hq, lq_pad, d), "float32")
    dk = interop.empty(q, (b, hk, lk, d), "float32")
    dv = interop.empty(q, (b, hk, lk, d), "float32")
    _bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                      lq, lk)
    qs, ks, vs, gs = (interop.element_strides(a) for a in (q, k, v, dout))
    name = config.name(precision)
    note_kernel(name)
    ptr = interop.pointer
    interop.launch(_kernel(name), q, (-(-lk // config.block_n), hk, b), config.threads,
                   BACKWARD_PARAMS, (
                       ptr(q), ptr(k), ptr(v), ptr(dout), m_ptr, ptr(lse2), ptr(delta),
                       ptr(dq_acc), ptr(dk), ptr(dv), *qs[:3], *ks[:3], *vs[:3], *gs[:3],
                       *m_strides, hq, hk, lq, lk, lq_pad, *options), config.shared_bytes())
    return dq_acc[:, :, :lq, :] * scale, dk, dv
