"""Adapter from the attention contract (softmaxkit/ops.py) to ``kernels/attention_f32.cu``:
float32 inputs in float32 arithmetic on CUDA cores, the default ``precision="float32"`` (spec
"Attention", "Precision"); served once :data:`.configs.F32_SERVED` says so, and callable
here with any tile (``config=``) before.

When served, :func:`softmaxkit_cupy.manifest.can_run` has accepted the call
(:func:`softmaxkit_cupy.manifest.f32_reason`: head dimensions, launch limits, the device's
shared memory), so every call with work has a kernel, at its own head dimensions or on
zero-padded copies (:func:`.configs.f32_shape`); calls with no query row or no key get the
spec's fixed results without a launch.
"""

from __future__ import annotations

import functools
from typing import Any

from . import compiler, head_dims, interop
from .attention import (
    _backward_without_work,
    _forward_without_work,
    _rows_ready,
    dense_decode,
    float32_backward,
    float32_forward,
    uses_decode,
)
from .configs import (
    F32BackwardConfig,
    F32Config,
    F32DecodeConfig,
    backward_pre_name,
    f32_alternative_names,
    f32_backward_config,
    f32_backward_names,
    f32_backward_pre_names,
    f32_backward_shape,
    f32_config,
    f32_decode_config,
    f32_decode_names,
    f32_names,
    f32_shape,
    f32_varlen_backward_names,
    f32_varlen_names,
)


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` of kernels/attention_f32.cu, built on first use with the module
    that declares it (the forward's tiles, its fitting tiles, the alternatives, the backward
    up to head dim 128 and above, the row preprocessing, the packed variable-length forward
    and backward; any other configuration: alone)."""
    for names in (f32_names(fitting=False), f32_names(fitting=True), f32_alternative_names(),
                  f32_backward_names(wide=False), f32_backward_names(wide=True),
                  f32_backward_pre_names(), f32_varlen_names(), f32_varlen_backward_names(),
                  f32_decode_names()):
        if name in names:
            return compiler.function("attention_f32.cu", names, name)
    return compiler.function("attention_f32.cu", (name,), name)


def attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool,
    config: F32Config | F32DecodeConfig | None = None, keep: tuple | None = None,
) -> tuple[Any, Any]:
    """Attention forward of float32 q, k, v in float32 arithmetic; (out, lse or None).

    ``config`` overrides the tile configuration (by default :func:`.configs.f32_config` of
    the head dimensions).  A call whose (D, Dv) is not a built pair runs on copies of q, k
    and v zero-padded to the pair of :func:`.configs.f32_shape` (zero columns add nothing to
    a score, and the output's extra columns are dropped).  Few query rows per key head
    against many keys (:func:`.attention.uses_decode`) run on the split-KV decode kernels
    (:func:`.configs.f32_decode_config`, where the device's shared memory holds them; or
    ``config``, an :class:`.configs.F32DecodeConfig`), zero-padded to
    :func:`.configs.f32_decode_width`.  A call at a built pair keeps its launch under
    ``keep`` (a key of :mod:`.kept`, or None).
    """
    fixed = _forward_without_work(q, k, v)
    if fixed is not None:
        return fixed[0], (fixed[1] if return_lse else None)
    d, dv = int(q.shape[3]), int(v.shape[3])
    _, hq, lq, _ = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    if config is None and uses_decode(hq, hk, lq, lk):
        config = f32_decode_config(d, dv, interop.shared_limit(interop.device_index(q)))
    if isinstance(config, F32DecodeConfig):
        decode = config
        with interop.on_device(q):
            out, lse = head_dims.forward_padded(
                xp, decode_width(decode, d, dv), lambda q, k, v: dense_decode(
                    xp, decode, q=_rows_ready(xp, q), k=_rows_ready(xp, k),
                    v=_rows_ready(xp, v), scale=scale, causal=causal, window=window,
                    mask=mask, softcap=softcap),
                q, k, v)
        return out, (lse if return_lse else None)
    shape = run_shape(config, d, dv)
    with interop.on_device(q):
        return head_dims.forward_padded(
            xp, shape, lambda q, k, v: _attention(
                xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window, mask=mask,
                softcap=softcap, return_lse=return_lse, config=config,
                keep=keep if shape is None else None),
            q, k, v)


def run_shape(config: F32Config | F32BackwardConfig | None, d: int, dv: int,
              backward: bool = False) -> tuple[int, int] | None:
    """The (key, value) widths a float32 call of key dim ``d`` and value dim ``dv`` is
    zero-padded to on the exact kernels (the forward's or, ``backward``, the gradient's):
    None where it runs at its own pair; else the pair of :func:`.configs.f32_shape`,
    :func:`.configs.f32_backward_shape`, or of the tiles ``config`` asked for.

    Raises
    ------
    ValueError
        Where no kernel holds the pair (above 256, or tiles narrower than the call).
    """
    shape = ((config.head_dim, config.value_dim) if config is not None
             else (f32_backward_shape if backward else f32_shape)(d, dv))
    if shape is None or shape[0] < d or shape[1] < dv:
        kind = "backward" if backward else "kernel"
        raise ValueError(f"no float32 attention {kind} for D={d}, Dv={dv}")
    return None if shape == (d, dv) else shape


def decode_width(config: F32DecodeConfig, d: int, dv: int) -> int | None:
    """The width a float32 decode of ``d`` and ``dv`` on ``config``'s tiles is zero-padded to
    (None: its own).

    Raises
    ------
    ValueError
        Where the tiles are narrower than ``d`` or ``dv``.
    """
    width = config.head_dim
    if width < max(d, dv):
        raise ValueError(f"no float32 decode kernel for D={d}, Dv={dv} on {config}")
    return None if (d, dv) == (width, width) else width


def _attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool, config: F32Config | None,
    keep: tuple | None = None,
) -> tuple[Any, Any]:
    """:func:`attention` of a call with work at a built pair of head dimensions (its launch
    kept under ``keep``)."""
    d, dv = int(q.shape[3]), int(v.shape[3])
    config = config or f32_config(d, dv, mask is not None,
                                  interop.shared_limit(interop.device_index(q)))
    if config is None or (config.head_dim, config.value_dim) != (d, dv):
        raise ValueError(f"no float32 attention kernel for D={d}, Dv={dv}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    name = config.name()
    return float32_forward(xp, _kernel(name), name, config, q=q, k=k, v=v, scale=scale,
                           causal=causal, window=window, mask=mask, softcap=softcap,
                           return_lse=return_lse, keep=keep)


def attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, dlse: Any = None,
    config: F32BackwardConfig | None = None, keep: tuple | None = None,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of float32 attention in float32 arithmetic, recomputing P from ``lse``
    (:func:`.attention.float32_backward`: sk_attn_bwd_f32).  A call whose (D, Dv) is not a
    built pair runs on zero-padded copies (:func:`.configs.f32_backward_shape`), as in
    :func:`attention`; one at a built pair keeps its launches under ``keep`` (a key of
    :mod:`.kept`, or None)."""
    fixed = _backward_without_work(q, k, v)
    if fixed is not None:
        return fixed
    d, dv = int(q.shape[3]), int(v.shape[3])
    shape = run_shape(config, d, dv, backward=True)
    with interop.on_device(q):
        return head_dims.gradients_padded(
            xp, shape, lambda q, k, v, out, dout: _vjp(
                xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale, causal=causal,
                window=window, mask=mask, softcap=softcap, dlse=dlse, config=config,
                keep=keep if shape is None else None),
            q, k, v, out, dout)


def _vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, dlse: Any,
    config: F32BackwardConfig | None, keep: tuple | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`attention_vjp` of a call with work at a built pair of head dimensions (its
    launches kept under ``keep``)."""
    d, dv = int(q.shape[3]), int(v.shape[3])
    config = config or f32_backward_config(d, dv, mask is not None)
    if config is None or (config.head_dim, config.value_dim) != (d, dv):
        raise ValueError(f"no float32 attention backward for D={d}, Dv={dv}")
    if mask is not None and not config.mask:
        raise ValueError(f"{config} is built without boolean-mask support")
    name = config.name()
    return float32_backward(xp, _kernel(name), name, config,
                            pre=_kernel(backward_pre_name("float32", dv)), q=q, k=k, v=v,
                            out=out, lse=lse, dout=dout, scale=scale, causal=causal,
                            window=window, mask=mask, softcap=softcap, dlse=dlse, keep=keep)
