"""Adapter from the attention contract (softmaxkit/ops.py) to ``kernels/attention_tf32.cu``:
float32 inputs on TF32 tensor cores at ``precision="tf32"`` or ``"tf32x3"`` (spec "Attention",
"Precision").

Float32 calls at the default ``"float32"`` and every float32 gradient run on the exact
kernels instead (:mod:`.attention_f32`).  :func:`softmaxkit_cupy.manifest.can_run` has
accepted the call (:func:`softmaxkit_cupy.manifest.tf32_reason`: D and Dv up to the largest
head dimension of ``TF32_CONFIGS``, launch limits), so every call with work has a kernel, at
its own head dimension or on zero-padded copies; calls with no query row or no key get the
spec's fixed results without a launch.  The tile comes from :func:`.configs.tf32_config`,
within the device's shared memory.
"""

from __future__ import annotations

import functools
from typing import Any

from . import compiler, head_dims, interop
from .attention import (
    _backward_without_work,
    _forward_without_work,
    float32_backward,
    float32_forward,
)
from .configs import (
    Tf32BackwardConfig,
    Tf32Config,
    backward_pre_name,
    tf32_alternative_names,
    tf32_backward_config,
    tf32_backward_names,
    tf32_backward_pre_names,
    tf32_config,
    tf32_names,
    tf32_width,
)


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` of kernels/attention_tf32.cu, built on first use with the module
    of every declared configuration (an alternative given explicitly: with the module of the
    alternatives; any other configuration: alone)."""
    for names in (tf32_names(), tf32_backward_names(), tf32_backward_pre_names(),
                  tf32_alternative_names()):
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
    configuration (by default :func:`.configs.tf32_config` of the head dimension and the
    device's shared memory).  A call
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
    config = config or tf32_config(d, mask is not None,
                                   interop.shared_limit(interop.device_index(q)))
    if config is None or config.head_dim != d or int(v.shape[3]) != d:
        raise ValueError(f"no TF32 attention kernel for D={d}, Dv={int(v.shape[3])}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    name = config.name(precision)
    return float32_forward(xp, _kernel(name), name, config, q=q, k=k, v=v, scale=scale,
                           causal=causal, window=window, mask=mask, softcap=softcap,
                           return_lse=return_lse)


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
    d = int(q.shape[3])
    config = config or tf32_backward_config(d, mask is not None)
    if config is None or config.head_dim != d or int(v.shape[3]) != d:
        raise ValueError(f"no TF32 attention backward for D={d}, Dv={int(v.shape[3])}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    name = config.name(precision)
    return float32_backward(xp, _kernel(name), name, config,
                            pre=_kernel(backward_pre_name("float32", d)), q=q, k=k, v=v,
                            out=out, lse=lse, dout=dout, scale=scale, causal=causal,
                            window=window, mask=mask, softcap=softcap, dlse=dlse)
