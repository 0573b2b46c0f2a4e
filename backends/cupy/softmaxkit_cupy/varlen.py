"""Adapter from packed variable-length attention (softmaxkit/ops.py, ``varlen_attention`` and
``varlen_attention_vjp``) to the packed variants of ``kernels/attention.cu`` and
``kernels/attention_bwd.cu``, on a device of compute capability 9.0 of the Hopper kernels
``kernels/attention_sm90.cu`` and ``kernels/attention_bwd_sm90.cu``, and for float32 of the
exact kernels ``kernels/attention_f32.cu`` (float32 products and sums at every precision).

The frontend hands q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv] of one dtype (16-bit or
float32) and the validated cumulative lengths as int64 [B + 1] arrays on their device;
:func:`softmaxkit_cupy.manifest.can_run` has accepted the call.  Block z of every launch is one
sequence, reading its bounds from the cumulative lengths on the device; the grid's x axis
spans the longest sequence, whose length is read on the host (one device-to-host copy: the
contract allows it).  Calls with no query row or no key have results fixed by the spec and
are made without a launch.  Head dimensions the kernels are not built for (D != Dv, or D
outside ``ATTENTION_HEAD_DIMS``; both at most 256) run on zero-padded copies of the arrays,
as dense attention's do (:mod:`.head_dims`); in float32, pairs other than the built ones
(:func:`.configs.f32_shape`) on copies zero-padded to the built pair that holds them.

The backward's float32 work arrays (lse in log2 units, ``delta = rowsum(dout * out) - dlse``
and dq's sums) pad each sequence to whole query tiles, as the dense backward pads Lq: sequence
b's rows start at its padded offset ``cu_pad[b]`` (the query lengths rounded up to the tile
and summed, a multiple of the tile) within each query head's ``Tpad = cu_pad[B]`` rows, so
lse2 and delta are [Hq, Tpad] and the dq sums [Hq, Tpad, D].  A tile then never reaches into
the next sequence's rows, and its padding rows (lse2 = +inf) contribute exactly 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from softmaxkit import arguments
from softmaxkit.metadata import host_integers
from softmaxkit.options import note_kernel

from . import attention_f32, head_dims, interop
from .attention import (
    _capability_of,
    _kernel,
    _rows_ready,
    backward_buffers,
    forward_grid,
    hopper_width,
    launch_backward_pre,
    row_cotangent,
)
from .configs import (
    SM90_CAPABILITY,
    SM90_CONFIGS,
    SM90_VARLEN_BACKWARD_CONFIGS,
    AttentionConfig,
    BackwardConfig,
    F32BackwardConfig,
    F32Config,
    Sm90BackwardConfig,
    Sm90Config,
    backward_config,
    backward_dq_varlen_name,
    backward_pre_varlen_name,
    f32_backward_config,
    f32_config,
    varlen_config,
)


def _int64(xp: Any, cu: Any) -> Any:
    """The cumulative lengths as a contiguous int64 array (the frontend passes int64)."""
    return interop.contiguous(arguments.cast(xp, cu, xp.int64))


def _on_host(*cus: Any) -> list[np.ndarray]:
    """The values of the cumulative lengths ``cus`` on the host: those the frontend read to
    validate them, when it passed them in this call (:func:`softmaxkit.metadata.validated`),
    else one device-to-host copy each."""
    reader = "the cupy backend reads cu_seqlens_q and cu_seqlens_k"
    return [host_integers(c, name, reader)
            for c, name in zip(cus, ("cu_seqlens_q", "cu_seqlens_k"), strict=False)]


VARLEN_PARAMS = "Q" * 7 + "q" * 6 + "ii" + "ff" + "iiii"
"""The packed forward's parameters: the addresses of q, k, v, cu_q, cu_k, out and lse; the
token and head strides of q, k and v; hq, hk; scale, softcap; bottom_right, causal, left,
right."""

VARLEN_PRE_PARAMS = "Q" * 8 + "q" * 4 + "iii" + "q"
"""The packed backward's first kernel's parameters: the addresses of out, dout, lse, dlse
(0: none), lse2, delta, cu_q and cu_pad; the token and head strides of out and dout; hq,
batches, tpad; the rows."""

VARLEN_BACKWARD_PARAMS = "Q" * 12 + "q" * 8 + "iii" + "ff" + "iiii"
"""The packed backward's main kernel's parameters: the addresses of q, k, v, dout, cu_q, cu_k,
cu_pad, lse2, delta, dq's sums, dk and dv; the token and head strides of q, k, v and dout;
hq, hk, tpad; scale, softcap; bottom_right, causal, left, right."""

VARLEN_DQ_PARAMS = "QQQQfiiiq"
"""The packed dQ conversion's parameters: the sums, dq, cu_q, cu_pad; scale, hq, batches,
tpad; the chunks."""


def _options(scale: float, causal: Any, window: tuple[int, int],
             softcap: Any) -> tuple[Any, ...]:
    """(scale, softcap, bottom_right, causal, left, right) as the kernels take them."""
    left, right = (int(w) for w in window)
    return (scale, softcap if softcap is not None else 0.0, causal != "top_left",
            causal is not None, left, right)


def _token_strides(a: Any) -> tuple[int, int]:
    """(token stride, head stride) in elements of a packed [T, H, D] array."""
    s = interop.element_strides(a)
    return s[0], s[1]


def varlen_attention(
    xp: Any, *, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, scale: float,
    causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
    config: AttentionConfig | Sm90Config | F32Config | None = None,
) -> tuple[Any, Any]:
    """Packed variable-length attention forward; (out, lse or None).  16-bit on tensor cores;
    float32 on the exact kernels (:func:`_f32_varlen_attention`).

    One launch over (query tiles of the longest sequence, Hq, B); the blocks past a shorter
    sequence's last tile return at once.  On a device of compute capability 9.0 the kernel is
    the Hopper one (:data:`.configs.SM90_CONFIGS`' tiles) at the head dims it is built for or
    zero-padded to them (:func:`.attention.hopper_width`), the mma.sync one otherwise;
    ``config`` overrides the tile configuration (for benchmarks; a call below its head
    dimension runs zero-padded to it, :func:`.head_dims.config_width`).  Head dimensions the
    kernels are not built for run on copies of q, k, v zero-padded to the next built one, the output
    sliced back to Dv; a value dimension above 256 runs in blocks of columns, a call each
    (:mod:`.head_dims`).
    """
    tq, hq, d = (int(s) for s in q.shape)
    tk, dv = int(k.shape[0]), int(v.shape[2])
    dtype = interop.name(q)
    if tq == 0:
        return (interop.empty(q, (0, hq, dv), dtype),
                interop.empty(q, (0, hq), "float32") if return_lse else None)
    if tk == 0:  # no sequence has a key: every row is empty (out 0, lse -inf)
        return (interop.zeros(q, (tq, hq, dv), dtype),
                interop.full(q, (tq, hq), -math.inf, "float32") if return_lse else None)
    if dtype == "float32":
        shape = attention_f32.run_shape(config if isinstance(config, F32Config) else None,
                                        d, dv)
        with interop.on_device(q):
            return head_dims.forward_padded(xp, shape, (
                lambda q, k, v: _f32_varlen_attention(
                    xp, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    scale=scale, causal=causal, window=window, softcap=softcap,
                    return_lse=return_lse, config=config)), q, k, v)
    blocks = head_dims.value_blocks(d, dv)
    if blocks:  # Dv above the largest built head dimension: a call per block of columns
        with interop.on_device(q):
            return head_dims.forward_in_blocks(xp, blocks, lambda vb: varlen_attention(
                xp, q=q, k=k, v=vb, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                scale=scale, causal=causal, window=window, softcap=softcap,
                return_lse=return_lse, config=config), v)
    width = (head_dims.config_width(config, d, dv) if config is not None
             else hopper_width(q, d, dv, SM90_CONFIGS))
    with interop.on_device(q):
        return head_dims.forward_padded(xp, width, lambda q, k, v: (
            _varlen_attention(xp, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, scale=scale, causal=causal,
                              window=window, softcap=softcap, return_lse=return_lse,
                              config=config)), q, k, v)


def _varlen_attention(
    xp: Any, *, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, scale: float,
    causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
    config: AttentionConfig | Sm90Config | None,
) -> tuple[Any, Any]:
    """:func:`varlen_attention` of a call with work, at a built head dimension (D = Dv)."""
    tq, hq, d = (int(s) for s in q.shape)
    dtype = interop.name(q)
    cu_q, cu_k, batches, longest = _forward_rows(xp, cu_seqlens_q, cu_seqlens_k)
    q, k, v = (_rows_ready(xp, a) for a in (q, k, v))
    device = interop.device_index(q)
    hopper = _capability_of(device) == SM90_CAPABILITY
    config = config or (SM90_CONFIGS[d] if hopper and d in SM90_CONFIGS
                        else varlen_config(d, interop.shared_limit(device)))
    out = interop.empty(q, (tq, hq, d), dtype)
    lse = interop.empty(q, (tq, hq), "float32")
    name = config.varlen_name(dtype)
    note_kernel(name)
    interop.launch(_kernel(name), q, (-(-longest // config.block_m), hq, batches),
                   config.threads, VARLEN_PARAMS,
                   (*_forward_args(q, k, v, cu_q, cu_k, out, lse),
                    *_options(scale, causal, window, softcap)), config.shared_bytes())
    return out, (lse if return_lse else None)


def _forward_rows(xp: Any, cu_seqlens_q: Any, cu_seqlens_k: Any
                  ) -> tuple[Any, Any, int, int]:
    """What a packed forward's launch takes of the cumulative lengths: ``(cu_q, cu_k)`` as
    int64 arrays on the device, the sequences and the longest query length."""
    (host_q,) = _on_host(cu_seqlens_q)
    return (_int64(xp, cu_seqlens_q), _int64(xp, cu_seqlens_k), host_q.shape[0] - 1,
            int(np.max(np.diff(host_q))))


def _forward_args(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, out: Any,
                  lse: Any) -> tuple[Any, ...]:
    """The packed forwards' arguments (:data:`VARLEN_PARAMS`) up to the options: the
    addresses, the token and head strides, hq and hk."""
    ptr = interop.pointer
    return (ptr(q), ptr(k), ptr(v), ptr(cu_q), ptr(cu_k), ptr(out), ptr(lse),
            *_token_strides(q), *_token_strides(k), *_token_strides(v), int(q.shape[1]),
            int(k.shape[1]))


def _f32_varlen_attention(
    xp: Any, *, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, scale: float,
    causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
    config: F32Config | None,
) -> tuple[Any, Any]:
    """:func:`varlen_attention` of float32 with work at a built pair of head dimensions:
    ``sk_attn_fwd_f32_varlen`` on the dense forward's tiles for (D, Dv) and its grid
    (:func:`.attention.forward_grid`: under causal rows every sequence's last row tile
    first) over the longest sequence's row tiles."""
    tq, hq, d = (int(s) for s in q.shape)
    dv = int(v.shape[2])
    cu_q, cu_k, batches, longest = _forward_rows(xp, cu_seqlens_q, cu_seqlens_k)
    q, k, v = (_rows_ready(xp, a) for a in (q, k, v))
    config = config or f32_config(d, dv, False, interop.shared_limit(interop.device_index(q)))
    if config is None or (config.head_dim, config.value_dim) != (d, dv):
        raise ValueError(f"no float32 attention kernel for D={d}, Dv={dv}")
    out = interop.empty(q, (tq, hq, dv), "float32")
    lse = interop.empty(q, (tq, hq), "float32")
    name = config.varlen_name()
    note_kernel(name)
    grid, options = forward_grid(-(-longest // config.block_m), hq, batches,
                                 _options(scale, causal, window, softcap))
    interop.launch(attention_f32._kernel(name), q, grid, config.threads, VARLEN_PARAMS,
                   (*_forward_args(q, k, v, cu_q, cu_k, out, lse), *options),
                   config.shared_bytes())
    return out, (lse if return_lse else None)


def padded_offsets(cu_q: np.ndarray, block_m: int) -> np.ndarray:
    """``cu_pad`` [B + 1]: each sequence's query length rounded up to ``block_m``, summed (the
    rows of the backward's work arrays; see the module docstring)."""
    lengths = np.diff(cu_q)
    return np.concatenate([[0], np.cumsum(-(-lengths // block_m) * block_m)]).astype(np.int64)


def _backward_rows(xp: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, block_m: int
                   ) -> tuple[Any, Any, Any, int, int, int]:
    """What a packed backward's launches take of the cumulative lengths: ``(cu_q, cu_k,
    cu_pad)`` as int64 arrays on the device (:func:`padded_offsets` of ``block_m``-row query
    tiles), the sequences, ``tpad`` (the padded rows a head) and the longest key length."""
    host_q, host_k = _on_host(cu_seqlens_q, cu_seqlens_k)
    cu_q, cu_k = _int64(xp, cu_seqlens_q), _int64(xp, cu_seqlens_k)
    cu_pad = padded_offsets(host_q, block_m)
    return (cu_q, cu_k, interop.from_host(cu_q, cu_pad), host_q.shape[0] - 1, int(cu_pad[-1]),
            int(np.max(np.diff(host_k))))


def varlen_attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, cu_seqlens_q: Any,
    cu_seqlens_k: Any, scale: float, causal: Any, window: tuple[int, int], softcap: Any,
    dlse: Any = None,
    config: BackwardConfig | Sm90BackwardConfig | F32BackwardConfig | None = None,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of packed variable-length attention, recomputing P from ``lse``: 16-bit
    on tensor cores, float32 on the exact kernels (:func:`_f32_varlen_attention_vjp`).

    Three launches, as for dense attention: the rows' lse2 and delta into the padded layout
    (module docstring; delta less the lse's cotangent ``dlse`` where given); the main kernel
    over (key tiles of the longest sequence, Hk, B), which writes dk and dv (zero for the keys
    of a sequence without queries) and adds dq's partial products into the float32 sums; and
    dq's conversion back to the packed layout.  The main kernel is the Hopper one on a device
    of compute capability 9.0 at the head dims :data:`.configs.SM90_VARLEN_BACKWARD_CONFIGS`
    holds (or zero-padded to them, :func:`.attention.hopper_width`), the mma.sync one
    otherwise; ``config`` overrides its tile configuration (for benchmarks; a call below its
    head dimension runs zero-padded to it, :func:`.head_dims.config_width`).  Head dimensions
    the kernels are not built for run on copies of q, k, v, out and dout zero-padded to the
    next built one; dq and dk are sliced back to D, dv to Dv; a value dimension above 256
    runs in blocks of columns, dq and dk summed over them (:mod:`.head_dims`).
    """
    tq, hq, d = (int(s) for s in q.shape)
    tk, hk, dv = (int(s) for s in v.shape)
    dtype = interop.name(q)
    if tq == 0 or tk == 0:  # no query row reads a key: every gradient is 0
        return (interop.zeros(q, (tq, hq, d), dtype), interop.zeros(q, (tk, hk, d), dtype),
                interop.zeros(q, (tk, hk, dv), dtype))
    if dtype == "float32":
        shape = attention_f32.run_shape(
            config if isinstance(config, F32BackwardConfig) else None, d, dv, backward=True)
        with interop.on_device(q):
            return head_dims.gradients_padded(
                xp, shape,
                lambda q, k, v, out, dout: _f32_varlen_attention_vjp(
                    xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, scale=scale, causal=causal, window=window,
                    softcap=softcap, dlse=dlse, config=config), q, k, v, out, dout)
    blocks = head_dims.value_blocks(d, dv)
    if blocks:  # Dv above the largest built head dimension: a call per block of columns
        with interop.on_device(q):
            return head_dims.gradients_in_blocks(
                xp, blocks, lambda vb, ob, db, first: varlen_attention_vjp(
                    xp, q=q, k=k, v=vb, out=ob, lse=lse, dout=db, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, scale=scale, causal=causal, window=window,
                    softcap=softcap, dlse=dlse if first else None, config=config),
                v, out, dout)
    width = head_dims.config_width(config, d, dv) if config is not None else hopper_width(
        q, d, dv, SM90_VARLEN_BACKWARD_CONFIGS, head_dims.SM90_BACKWARD_PADDED_FROM)
    with interop.on_device(q):
        return head_dims.gradients_padded(
            xp, width, lambda q, k, v, out, dout: _varlen_attention_vjp(
                xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, scale=scale, causal=causal, window=window,
                softcap=softcap, dlse=dlse, config=config), q, k, v, out, dout)


def _varlen_attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, cu_seqlens_q: Any,
    cu_seqlens_k: Any, scale: float, causal: Any, window: tuple[int, int], softcap: Any,
    dlse: Any, config: BackwardConfig | Sm90BackwardConfig | None,
) -> tuple[Any, Any, Any]:
    """:func:`varlen_attention_vjp` of a call with work, at a built head dimension (D = Dv)."""
    tq, hq, d = (int(s) for s in q.shape)
    dtype = interop.name(q)
    device = interop.device_index(q)
    hopper = _capability_of(device) == SM90_CAPABILITY
    config = config or (SM90_VARLEN_BACKWARD_CONFIGS[d]
                        if hopper and d in SM90_VARLEN_BACKWARD_CONFIGS
                        else backward_config(d, interop.shared_limit(device)))
    dq_acc, dk, dv, cu_q, cu_pad, batches, tpad = _backward_launches(
        xp, _kernel, config, config.varlen_name(dtype), q=q, k=k, v=v, out=out, lse=lse,
        dout=dout, dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        options=_options(scale, causal, window, softcap), packed_sums=False)
    ptr = interop.pointer
    dq = interop.empty(q, (tq, hq, d), dtype)
    chunks = tq * hq * d // 8
    interop.launch(_kernel(backward_dq_varlen_name(dtype, d)), q, -(-chunks // 256),
                   256, VARLEN_DQ_PARAMS, (ptr(dq_acc), ptr(dq), ptr(cu_q), ptr(cu_pad),
                                           scale, hq, batches, tpad, chunks))
    return dq, dk, dv


def _f32_varlen_attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, cu_seqlens_q: Any,
    cu_seqlens_k: Any, scale: float, causal: Any, window: tuple[int, int], softcap: Any,
    dlse: Any, config: F32BackwardConfig | None,
) -> tuple[Any, Any, Any]:
    """:func:`varlen_attention_vjp` of float32 with work at a built pair of head dimensions:
    the rows' lse2 and delta into the padded layout (module docstring), then
    ``sk_attn_bwd_f32_varlen`` on the dense backward's tiles, which adds dq's products into
    float32 sums laid out as dq itself ([Tq, Hq, D]: it skips a tile's rows past its
    sequence), scaled here."""
    tq, hq, d = (int(s) for s in q.shape)
    dv_dim = int(v.shape[2])
    config = config or f32_backward_config(d, dv_dim, False)
    if config is None or (config.head_dim, config.value_dim) != (d, dv_dim):
        raise ValueError(f"no float32 attention backward for D={d}, Dv={dv_dim}")
    dq_acc, dk, dv, *_ = _backward_launches(
        xp, attention_f32._kernel, config, config.varlen_name(), q=q, k=k, v=v, out=out,
        lse=lse, dout=dout, dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        options=_options(scale, causal, window, softcap), packed_sums=True)
    return xp.reshape(dq_acc, (tq, hq, d)) * scale, dk, dv


def _backward_launches(
    xp: Any, kernel: Any, config: Any, name: str, *, q: Any, k: Any, v: Any, out: Any,
    lse: Any, dout: Any, dlse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
    options: tuple[Any, ...], packed_sums: bool,
) -> tuple[Any, ...]:
    """The packed backward's first two launches, shared by the 16-bit and float32 kernels
    (``kernel(name)`` gives a kernel of the right source; the parameters are
    :data:`VARLEN_PRE_PARAMS` and :data:`VARLEN_BACKWARD_PARAMS`): each row's lse2 and delta
    into the padded layout (module docstring), then the main kernel over (key tiles of the
    longest sequence, Hk, B), which writes dk and dv (zero for the keys of a sequence
    without queries) and adds dq's products into float32 sums, ``[Hq, tpad, D]`` or, with
    ``packed_sums``, ``[Tq, Hq, D]``.  Returns ``(dq sums, dk, dv, cu_q, cu_pad, batches,
    tpad)`` for dq's conversion."""
    tq, hq, d = (int(s) for s in q.shape)
    tk, hk, dv_dim = (int(s) for s in v.shape)
    dtype = interop.name(q)
    cu_q, cu_k, cu_pad, batches, tpad, longest_k = _backward_rows(
        xp, cu_seqlens_q, cu_seqlens_k, config.block_m)
    q, k, v, out, dout = (_rows_ready(xp, a) for a in (q, k, v, out, dout))
    lse = interop.contiguous(lse)
    rows = hq * tpad
    lse2, delta, dq_acc = backward_buffers(q, rows, d, sums=tq * hq if packed_sums else None)
    # every key row belongs to a sequence whose blocks write it (zeros without queries)
    dk = interop.empty(q, (tk, hk, d), dtype)
    dv = interop.empty(q, (tk, hk, dv_dim), dtype)
    ptr = interop.pointer
    dlse = row_cotangent(dlse)
    launch_backward_pre(kernel(backward_pre_varlen_name(dtype, dv_dim)), q, rows, dv_dim,
                        VARLEN_PRE_PARAMS, (
                            ptr(out), ptr(dout), ptr(lse), 0 if dlse is None else ptr(dlse),
                            ptr(lse2), ptr(delta), ptr(cu_q), ptr(cu_pad),
                            *_token_strides(out), *_token_strides(dout), hq, batches, tpad,
                            rows))
    note_kernel(name)
    interop.launch(kernel(name), q, (-(-longest_k // config.block_n), hk, batches),
                   config.threads, VARLEN_BACKWARD_PARAMS, (
                       ptr(q), ptr(k), ptr(v), ptr(dout), ptr(cu_q), ptr(cu_k), ptr(cu_pad),
                       ptr(lse2), ptr(delta), ptr(dq_acc), ptr(dk), ptr(dv),
                       *_token_strides(q), *_token_strides(k), *_token_strides(v),
                       *_token_strides(dout), hq, hk, tpad, *options), config.shared_bytes())
    return dq_acc, dk, dv, cu_q, cu_pad, batches, tpad
