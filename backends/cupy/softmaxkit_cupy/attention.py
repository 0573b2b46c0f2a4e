"""Adapter from the attention contract (softmaxkit/ops.py) to ``kernels/attention.cu``.

The frontend hands q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] of one 16-bit dtype
and the mask, if any, as a (possibly stride-0) boolean view of [B, Hq, Lq, Lk].
:func:`softmaxkit_cupy.manifest.can_run` has accepted the call (library, dtype, head
dimensions, sizes), so every call here has a kernel, except calls with no query row or no key:
their results are fixed by the spec ("Attention") and made here without a launch.  A call at
head dimensions the kernels are not built for (D != Dv, or D outside ``ATTENTION_HEAD_DIMS``;
both at most 256) runs on zero-padded copies of its arrays and its results are sliced back
(:mod:`.head_dims`); a call at a built head dimension with D = Dv runs on its arrays as given.

On a device of compute capability 9.0 the forward of a call at a head dimension
kernels/attention_sm90.cu is built for (warpgroup matrix products, sm_90a) runs there, and the
backward's main kernel likewise on kernels/attention_bwd_sm90.cu; calls at the head dims the
mma.sync kernels serve slower run there zero-padded (:func:`hopper_width`).  Every other call,
and every call on another device, runs on kernels/attention.cu and kernels/attention_bwd.cu.
The kernel that ran is named in ``backend_opts(trace=True)``'s record (``TraceRecord.kernel``;
for the backward, its main kernel).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from softmaxkit.options import note_kernel

from . import compiler, head_dims, interop, kept
from .configs import (
    SM90_BACKWARD_CONFIGS,
    SM90_BACKWARD_MASKED_CONFIGS,
    SM90_CAPABILITY,
    SM90_CONFIGS,
    SM90_MASKED_CONFIGS,
    AttentionConfig,
    BackwardConfig,
    DecodeConfig,
    Sm90BackwardConfig,
    Sm90Config,
    alternative_names,
    attention_config,
    attention_names,
    backward_alternative_names,
    backward_config,
    backward_dq_name,
    backward_names,
    backward_pre_group,
    backward_pre_name,
    decode_alternative_names,
    decode_config,
    decode_holds,
    f32_decode_names,
    fitting_backward_names,
    fitting_names,
    merge_name,
    paged_names,
    sm90_backward_config,
    sm90_backward_names,
    sm90_config,
    sm90_names,
    sm90_varlen_backward_names,
    sm90_varlen_names,
    tf32_serves,
    varlen_backward_names,
    varlen_names,
)
from .mask_bits import mask_bits


def _rows_ready(xp: Any, a: Any) -> Any:
    """``a`` with unit stride along its last axis and 16-byte aligned rows (a copy if not)."""
    if (interop.is_torch(a) and a.is_contiguous() and a.data_ptr() % 16 == 0
            and (a.shape[-1] * a.element_size()) % 16 == 0):
        return a  # the common case, decided without reading the strides
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


def _modules(name: str) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """The source of kernel ``name`` and the modules that may declare it, in the order they
    are searched: the declared kernels of its kind, then their alternatives, if any."""
    if name.startswith("sk_attn_fwd_sm90_varlen<"):  # the packed Hopper kernels: their own
        return "attention_sm90.cu", (sm90_varlen_names(),)
    if name.startswith("sk_attn_bwd_sm90_varlen<"):
        return "attention_bwd_sm90.cu", (sm90_varlen_backward_names(),)
    if "_varlen<" in name:  # the packed variable-length kernels: modules of their own
        if name.startswith("sk_attn_fwd"):
            return "attention.cu", (varlen_names(), fitting_names())
        return "attention_bwd.cu", (varlen_backward_names(), fitting_backward_names())
    if name.startswith("sk_attn_decode_f32"):  # float32 decoding: the exact kernels' source
        return "attention_f32.cu", (f32_decode_names(),)
    if name.startswith("sk_attn_decode"):  # paged decoding: a module of its own
        paged = name.startswith("sk_attn_decode_paged")
        return "attention.cu", (paged_names() if paged else attention_names(),
                                decode_alternative_names(), fitting_names())
    if name.startswith("sk_attn_fwd_sm90<"):  # the Hopper forward: sm_90a, its own source
        return "attention_sm90.cu", (sm90_names(),)
    if name.startswith("sk_attn_bwd_sm90<"):  # the Hopper backward: sm_90a, its own source
        return "attention_bwd_sm90.cu", (sm90_backward_names(),)
    if name.startswith("sk_attn_bwd"):
        return "attention_bwd.cu", (backward_names(), backward_alternative_names(),
                                    fitting_backward_names())
    return "attention.cu", (attention_names(), alternative_names(), fitting_names())


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` (a ``cupy.RawKernel``) of the module that declares it, built on
    first use (found once: the name lists are long, and a call would otherwise rebuild
    them); a configuration no module declares, asked for explicitly, is built alone.  Its
    launches (:func:`.interop.launch`) raise its shared-memory limit as they need, on the
    device they run on."""
    filename, modules = _modules(name)
    names = next((m for m in modules if name in m), (name,))
    return compiler.function(filename, names, name)


@functools.cache
def _multiprocessors_of(device: int) -> int:
    import cupy

    # Device.attributes queries every attribute of the device: once per device
    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def _capability_of(device: int) -> int:
    """The compute capability of device ``device`` as a number (90 for 9.0)."""
    return interop.capability(device)


def forward_config(capability: int, head_dim: int, masked: bool,
                   shared_limit: int | None = None) -> AttentionConfig | Sm90Config:
    """The forward configuration for a call at ``head_dim`` (a built head dimension) on a device
    of compute capability ``capability`` (a number, 90 for 9.0), with a boolean mask
    or without one: the Hopper kernel where it is built for the head dimension and the device
    is 9.0, the mma.sync kernel otherwise, whose tiles fit ``shared_limit`` bytes of shared
    memory a block (:func:`.configs.attention_config`)."""
    if capability == SM90_CAPABILITY:
        found = sm90_config(head_dim, masked)
        if found is not None:
            return found
    return attention_config(head_dim, masked=masked, shared_limit=shared_limit)


def backward_config_for(capability: int, head_dim: int, masked: bool,
                        shared_limit: int | None = None) -> BackwardConfig | Sm90BackwardConfig:
    """The backward configuration for a call at ``head_dim`` (a built head dimension) on a
    device of compute capability ``capability``, with a boolean mask or without one: the Hopper
    kernel where it is built for the head dimension and the device is 9.0, the mma.sync kernel
    otherwise (both take the same arguments and buffers), whose tiles fit ``shared_limit``
    bytes of shared memory a block (:func:`.configs.backward_config`)."""
    if capability == SM90_CAPABILITY:
        found = sm90_backward_config(head_dim, masked)
        if found is not None:
            return found
    return backward_config(head_dim, shared_limit)


@functools.lru_cache(maxsize=1024)
def splits_for(batch_heads: int, lk: int, multiprocessors: int,
               config: DecodeConfig) -> tuple[int, int]:
    """(splits, keys per split) for decoding with ``config``.

    Splits trade the merge's cost against the tail of the last wave of blocks: take the count
    that minimizes (waves, rounded up) x (key tiles + 2 per block), with the blocks a
    multiprocessor holds at once (:meth:`DecodeConfig.resident`), at least 256 keys per split.
    """
    block_n = config.block_n
    slots = config.resident() * multiprocessors
    best = (math.inf, 1)
    for splits in range(1, max(1, min(64, lk // 256)) + 1):
        waves = -(-batch_heads * splits // slots)
        tiles = -(-lk // (splits * block_n))
        # two tiles' worth of fixed cost per block: Q, the warps' merge, the partial store
        best = min(best, (waves * (tiles + 2), splits))
    splits = best[1]
    chunk = -(-lk // splits)
    chunk = -(-chunk // block_n) * block_n
    return -(-lk // chunk), chunk


def uses_decode(hq: int, hk: int, lq: int, lk: int) -> bool:
    """Whether split-KV decoding serves these sizes (few query rows per key head)."""
    return decode_holds(hq, hk, lq) and lk >= 256


def _forward_without_work(q: Any, k: Any, v: Any) -> tuple[Any, Any] | None:
    """(out, lse) of a call with no query row or no key, else None.

    No query row: empty ``out`` and ``lse``.  No key: no row allows a key, so ``out`` is 0 and
    ``lse`` is ``-inf`` (spec "Attention", rows with no allowed key).
    """
    b, hq, lq, _ = (int(s) for s in q.shape)
    lk, dv = int(k.shape[2]), int(v.shape[3])
    if b * hq * lq == 0:
        return (interop.empty(q, (b, hq, lq, dv), interop.name(q)),
                interop.empty(q, (b, hq, lq), "float32"))
    if lk == 0:
        return (interop.zeros(q, (b, hq, lq, dv), interop.name(q)),
                interop.full(q, (b, hq, lq), -math.inf, "float32"))
    return None


def _backward_without_work(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any] | None:
    """(dq, dk, dv) of a call with no query row or no key, else None: all zero.

    With no key every row has zero gradient; with no query row no key gets a contribution.
    """
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk, dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    if b * hq * lq and lk:
        return None
    dtype = interop.name(q)
    return (interop.zeros(q, (b, hq, lq, d), dtype), interop.zeros(q, (b, hk, lk, d), dtype),
            interop.zeros(q, (b, hk, lk, dv), dtype))


def attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool,
    config: AttentionConfig | Sm90Config | DecodeConfig | None = None,
    precision: str = "float32",
) -> tuple[Any, Any]:
    """Exact attention forward on tensor cores; (out, lse or None).

    A float32 call runs on the TF32 kernels of :mod:`.attention_tf32` at ``precision``
    "tf32" or "tf32x3" where they hold its head dims (up to 128), and on the exact float32
    kernels of :mod:`.attention_f32` at the default "float32" and wider: exact products meet
    every precision's bound, and there they are faster than any other backend's.

    ``config`` overrides the forward tile configuration (an :class:`AttentionConfig` or, on a
    device of compute capability 9.0, a :class:`Sm90Config`, at the head dimension the call
    runs at or above it, the call then zero-padded to it, :func:`.head_dims.config_width`; by
    default :func:`forward_config` picks one); split-KV decoding is used instead for few query
    rows per key head, with :func:`.configs.decode_config`'s tiles or a
    :class:`DecodeConfig` given as ``config``.  A call whose head dimensions the kernels are
    not built for (D != Dv, or D not in ``ATTENTION_HEAD_DIMS``) runs on copies of q, k, v
    zero-padded to the next built one, and its output is the padded output's first Dv
    columns; a value dimension above 256 runs in blocks of columns, a call each
    (:mod:`.head_dims`).  The launch of a call of PyTorch tensors without a mask or
    ``config`` is kept for the next call of its kind (:mod:`.kept`).
    """
    key = None
    if mask is None and config is None and precision == "float32":
        key = kept.torch_key(q, k, v)
        if key is not None:
            key = ("attention", scale, causal, tuple(window), softcap, *key)
            forward = kept.kept(key)
            if forward is not None and kept.aligned(q, k, v):
                out, lse = forward(q, k, v, 0)
                return out, (lse if return_lse else None)
    if (tf32_serves(precision, int(q.shape[-1]), int(v.shape[-1]))
            or (config is not None and precision != "float32")):  # float32 inputs only
        from .attention_tf32 import attention as tf32_attention

        return tf32_attention(xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window,
                              mask=mask, softcap=softcap, return_lse=return_lse,
                              precision=precision, config=config)
    if interop.name(q) == "float32":
        from .attention_f32 import attention as f32_attention

        return f32_attention(xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window,
                             mask=mask, softcap=softcap, return_lse=return_lse, config=config,
                             keep=key)
    fixed = _forward_without_work(q, k, v)
    if fixed is not None:
        return fixed[0], (fixed[1] if return_lse else None)
    dv = int(v.shape[3])
    blocks = head_dims.value_blocks(int(q.shape[3]), dv)
    if blocks:  # Dv above the largest built head dimension: a call per block of columns
        with interop.on_device(q):
            return head_dims.forward_in_blocks(xp, blocks, lambda vb: attention(
                xp, q=q, k=k, v=vb, scale=scale, causal=causal, window=window, mask=mask,
                softcap=softcap, return_lse=return_lse, config=config), v)
    width = _forward_width(q, k, dv, mask is not None) if config is None else (
        head_dims.config_width(config, int(q.shape[3]), dv))
    with interop.on_device(q):
        return head_dims.forward_padded(xp, width, lambda q, k, v: _attention(
            xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window, mask=mask,
            softcap=softcap, return_lse=return_lse, config=config,
            keep=key if width is None else None), q, k, v)


def _forward_width(q: Any, k: Any, dv: int, masked: bool) -> int | None:
    """The head dimension the forward runs a call at, or None for the call's own: on a device
    of compute capability 9.0, :func:`hopper_width` of the Hopper forward's head dims;
    split-KV decoding keeps :func:`.head_dims.pad_width`'s choice."""
    hq, lq, hk, lk = int(q.shape[1]), int(q.shape[2]), int(k.shape[1]), int(k.shape[2])
    if uses_decode(hq, hk, lq, lk):
        return head_dims.pad_width(int(q.shape[3]), dv)
    return hopper_width(q, int(q.shape[3]), dv,
                        SM90_MASKED_CONFIGS if masked else SM90_CONFIGS)


def hopper_width(q: Any, d: int, dv: int, built: Collection[int],
                 padded_from: Collection[int] = head_dims.SM90_PADDED_FROM) -> int | None:
    """The head dimension a call of key dim ``d`` and value dim ``dv`` on ``q``'s device runs
    at, or None for its own: on a device of compute capability 9.0,
    :func:`.head_dims.sm90_width` for a Hopper kernel built for ``built`` where that gives one
    (the head dims it is built for, and ``padded_from``, those the mma.sync kernels serve
    slower than its zero-padded next one); elsewhere :func:`.head_dims.pad_width`'s."""
    return _width_on(_capability_of(interop.device_index(q)), d, dv, tuple(built),
                     frozenset(padded_from))


@functools.cache
def _width_on(capability: int, d: int, dv: int, built: tuple[int, ...],
              padded_from: frozenset[int]) -> int | None:
    """:func:`hopper_width` on a device of ``capability`` (decided once per kind of call)."""
    width = head_dims.pad_width(d, dv)
    if capability != SM90_CAPABILITY:
        return width
    hopper = head_dims.sm90_width(d, dv, built, padded_from)
    if hopper is None:
        return width
    return None if hopper == d == dv else hopper


def kernel_options(mask: Any, causal: Any, window: tuple[int, int], softcap: Any,
                   scale: float, lq: int, lk: int) -> tuple[Any, int, tuple[int, ...],
                                                          tuple[Any, ...]]:
    """What the dense attention kernels take of a call's exclusions and options: the
    bit-packed mask (to keep alive until the launch; None without a mask), its address (0
    without one), its element strides, and (scale, softcap, causal offset, causal, left,
    right), plain Python values (the launch packs them; numpy scalars cost more to make)."""
    bits, m_ptr, m_strides = None, 0, (0, 0, 0)
    if mask is not None:
        bits, m_strides = mask_bits(mask)
        m_ptr = interop.pointer(bits)
    left, right = (int(w) for w in window)
    offset = 0 if causal == "top_left" else lk - lq
    return bits, m_ptr, m_strides, (scale, softcap if softcap is not None else 0.0, offset,
                                    causal is not None, left, right)


LONGEST_FIRST = 2
"""The causal argument of a float32 forward launched on :func:`forward_grid`'s
row-tile-major grid (kernels/exclusion.cuh, ``SK_LONGEST_FIRST``)."""


def forward_grid(tiles: int, hq: int, b: int, options: tuple[Any, ...]
                 ) -> tuple[tuple[int, int, int], tuple[Any, ...]]:
    """The grid of a float32 forward (kernels/attention_f32.cu, attention_tf32.cu) of
    ``tiles`` row tiles a head and its options (:func:`kernel_options`' last): under causal
    rows (heads, batches, row tiles), with the causal argument ``LONGEST_FIRST``, so that
    every head's last row tile (the most keys) starts first; otherwise, or past the grid's
    65535 row tiles, (row tiles, heads, batches)."""
    scale, softcap, offset, causal, left, right = options
    if causal and tiles <= 65535:
        return (hq, b, tiles), (scale, softcap, offset, LONGEST_FIRST, left, right)
    return (tiles, hq, b), options


def float32_forward(
    xp: Any, kernel: Any, name: str, config: Any, *, q: Any, k: Any, v: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, return_lse: bool,
    keep: tuple | None = None,
) -> tuple[Any, Any]:
    """Launch the float32 forward ``kernel`` (``name`` for the trace), whose parameters are
    :data:`FORWARD_PARAMS`, one block of ``config.threads`` threads and
    ``config.shared_bytes()`` bytes per ``config.block_m`` query rows of each (head, batch);
    (out ``[B, Hq, Lq, Dv]`` float32, lse or None).  The launch is kept under ``keep`` (a
    key of :mod:`.kept`, or None) where it reads q, k, v in place."""
    b, hq, lq, _ = (int(s) for s in q.shape)
    hk, lk, dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    ready = tuple(_rows_ready(xp, a) for a in (q, k, v))
    keep = kept.in_place(keep, (q, k, v), ready)
    q, k, v = ready
    _bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                      lq, lk)
    qs, ks, vs = (interop.element_strides(a) for a in (q, k, v))
    grid, options = forward_grid(-(-lq // config.block_m), hq, b, options)
    forward = _Forward(kept.Launch(kernel, grid, config.threads, FORWARD_PARAMS,
                                   (*qs[:3], *ks[:3], *vs[:3], *m_strides, hq, hk, lq, lk,
                                    *options), config.shared_bytes()),
                       name, (b, hq, lq, dv), (b, hq, lq), "float32")
    kept.keep(keep, forward)
    out, lse = forward(q, k, v, m_ptr)
    return out, (lse if return_lse else None)


def float32_backward(
    xp: Any, kernel: Any, name: str, config: Any, *, pre: Any, q: Any, k: Any, v: Any,
    out: Any, lse: Any, dout: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, dlse: Any, keep: tuple | None = None,
) -> tuple[Any, Any, Any]:
    """Launch the float32 backward ``kernel`` (``name`` for the trace), whose parameters are
    :data:`BACKWARD_PARAMS`, one block of ``config.threads`` threads and
    ``config.shared_bytes()`` bytes per ``config.block_n`` keys of each (key head, batch);
    (dq, dk, dv) in float32.

    ``pre``, the row preprocessing of the same module (``sk_attn_bwd_pre<float, Dv>``), first
    writes each row's lse in log2 units and ``delta = rowsum(dout * out) - dlse`` (+inf and 0
    on the rows with no allowed key and on those padding the queries to whole tiles of
    ``config.block_m``); the kernel writes dk and dv and adds dq's products into a zeroed
    float32 buffer, which is scaled here.  The launches are kept under ``keep`` (a key of
    :mod:`.kept`, or None) where they read the arrays in place.
    """
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk, dv_dim = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    given = (q, k, v, out, dout, lse, dlse)
    q, k, v, out, dout = (_rows_ready(xp, a) for a in (q, k, v, out, dout))
    lse, dlse = interop.contiguous(lse), row_cotangent(dlse)
    keep = kept.in_place(keep, given, (q, k, v, out, dout, lse, dlse))
    lq_pad = -(-lq // config.block_m) * config.block_m
    rows = b * hq * lq_pad
    _bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                      lq, lk)
    qs, ks, vs, os_, gs = (interop.element_strides(a) for a in (q, k, v, out, dout))
    backward = _Backward(
        kept.Launch(pre, backward_pre_blocks(rows, dv_dim), 256, BACKWARD_PRE_PARAMS,
                    (*os_[:3], *gs[:3], hq, lq, lq_pad, rows)),
        kept.Launch(kernel, (-(-lk // config.block_n), hk, b), config.threads,
                    BACKWARD_PARAMS, (*qs[:3], *ks[:3], *vs[:3], *gs[:3], *m_strides, hq, hk,
                                      lq, lk, lq_pad, *options), config.shared_bytes()),
        _ScaledRows(xp, scale), name, rows, (b, hq, lq, d), (b, hk, lk, d),
        (b, hk, lk, dv_dim), "float32")
    kept.keep(keep, backward)
    return backward(q, k, v, out, dout, lse, dlse, m_ptr)


@dataclass(frozen=True)
class _Forward:
    """The forward's launch for a kind of call (:mod:`.kept`) and its results' shapes."""

    launch: kept.Launch
    name: str
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    dtype: str

    def __call__(self, q: Any, k: Any, v: Any, m_ptr: int) -> tuple[Any, Any]:
        """``(out, lse)`` of q, k, v (and the mask's bits at ``m_ptr``, 0 for none)."""
        out = interop.empty(q, self.out_shape, self.dtype)
        lse = interop.empty(q, self.lse_shape, "float32")
        note_kernel(self.name)
        ptr = interop.pointer
        self.launch(q, ptr(q), ptr(k), ptr(v), m_ptr, ptr(out), ptr(lse))
        return out, lse


def _attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool,
    config: AttentionConfig | Sm90Config | DecodeConfig | None, keep: tuple | None = None,
) -> tuple[Any, Any]:
    """:func:`attention` of a call with work, at a built head dimension (D = Dv); its launch
    kept under ``keep`` (a key of :mod:`.kept`, or None) where it reads q, k, v in place."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    ready = tuple(_rows_ready(xp, a) for a in (q, k, v))
    keep = kept.in_place(keep, (q, k, v), ready)
    q, k, v = ready
    dtype = interop.name(q)
    if uses_decode(hq, hk, lq, lk):
        decode = (config if isinstance(config, DecodeConfig)
                  else decode_config(d, interop.shared_limit(interop.device_index(q))))
        out, lse = dense_decode(xp, decode, q=q, k=k, v=v, scale=scale, causal=causal,
                                window=window, mask=mask, softcap=softcap)
    else:
        _bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                          lq, lk)
        qs, ks, vs = (interop.element_strides(a) for a in (q, k, v))
        strides = (*qs[:3], *ks[:3], *vs[:3], *m_strides)
        device = interop.device_index(q)
        config = config or forward_config(_capability_of(device), d, mask is not None,
                                          interop.shared_limit(device))
        if mask is not None and not config.mask:
            raise ValueError(f"{config} is built without boolean-mask support")
        name = config.name(dtype)
        forward = _Forward(kept.Launch(_kernel(name), (-(-lq // config.block_m), hq, b),
                                       config.threads, FORWARD_PARAMS,
                                       (*strides, hq, hk, lq, lk, *options),
                                       config.shared_bytes()),
                           name, (b, hq, lq, d), (b, hq, lq), dtype)
        kept.keep(keep, forward)
        out, lse = forward(q, k, v, m_ptr)
    return out, (lse if return_lse else None)


FORWARD_PARAMS = "Q" * 6 + "q" * 12 + "iiii" + "ff" + "iiii"
"""The forward kernels' parameters (mma.sync and Hopper alike): the addresses of q, k, v, the
mask's bits, out and lse; the strides of q, k, v and of the mask's bits (three each); hq, hk,
lq, lk; scale, softcap; offset, causal, left, right."""

_MERGE_PARAMS = "QQQQiqi"
"""The merge kernel's parameters: outs, lses, out, lse, parts, rows, dv."""

DECODE_PARAMS = "Q" * 6 + "q" * 12 + "iiiii" + "ff" + "iiii"
"""The dense decode kernel's parameters: the addresses of q, k, v, the mask's bits, the
partial out and lse; the strides of q, k, v and of the mask's bits (three each); hq, hk, lq,
lk, chunk;
scale, softcap; offset, causal, left, right."""


def dense_decode(
    xp: Any, config: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any,
    window: tuple[int, int], mask: Any, softcap: Any,
) -> tuple[Any, Any]:
    """(out ``[B, Hq, Lq, D]``, lse ``[B, Hq, Lq]``) of split-KV decoding (:func:`split_decode`)
    on the dense decode kernel of ``config`` (16-bit :class:`DecodeConfig`, or float32
    :class:`.configs.F32DecodeConfig`), q, k and v ready (:func:`_rows_ready`) at its head
    dimension."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                     lq, lk)
    qs, ks, vs = (interop.element_strides(a) for a in (q, k, v))
    head = (interop.pointer(q), interop.pointer(k), interop.pointer(v), m_ptr)
    tail = (*qs[:3], *ks[:3], *vs[:3], *m_strides, hq, hk, lq, lk)

    def decode_args(parts: Any, part_lses: Any, chunk: Any) -> tuple[Any, ...]:
        return (*head, parts, part_lses, *tail, chunk, *options)

    out, lse = split_decode(q, config, False, DECODE_PARAMS, (b, hq, hk, lq, d), lk,
                            decode_args)
    del bits  # kept alive until the launch
    return xp.reshape(out, (b, hq, lq, d)), xp.reshape(lse, (b, hq, lq))


def split_decode(
    q: Any, config: DecodeConfig, paged: bool, codes: str,
    sizes: tuple[int, int, int, int, int], keys: int,
    launch_args: Callable[[int, int, int], tuple[Any, ...]],
) -> tuple[Any, Any]:
    """Split-KV decoding: the dense (or ``paged``) decode kernel of ``config`` on a
    (splits, Hk, B) grid, each block a chunk of the ``keys`` keys of one key head, then
    :func:`_merge` of its float32 partials.

    ``sizes`` is ``(B, Hq, Hk, Lq, D)``; ``launch_args(part_out, part_lse, chunk)`` gives the
    kernel's arguments (packed as the parameter list ``codes``) around the partials'
    addresses and the keys per split.  The kernels launch through the driver on q's device
    and the caller's current stream.  Returns out ``[B * Hq * Lq, D]`` in q's dtype and lse
    ``[B * Hq * Lq]`` (float32).
    """
    b, hq, hk, lq, d = sizes
    splits, chunk = splits_for(b * hk, keys, _multiprocessors_of(interop.device_index(q)),
                               config)
    rows = b * hq * lq
    part_out = interop.empty(q, (splits, rows, d), "float32")
    part_lse = interop.empty(q, (splits, rows), "float32")
    shared = config.shared_bytes()
    name = config.name(interop.name(q), paged)
    note_kernel(name)
    args = launch_args(interop.pointer(part_out), interop.pointer(part_lse), chunk)
    interop.launch(_kernel(name), q, (splits, hk, b), config.threads, codes, args,
                   shared)
    return _merge(part_out, part_lse, interop.name(q))


def _merge(outs: Any, lses: Any, out_dtype: str) -> tuple[Any, Any]:
    """Launch the merge of ``outs`` [S, R, Dv] (contiguous) and ``lses`` [S, R] (float32) on
    their device and the caller's current stream."""
    parts, rows, dv = (int(s) for s in outs.shape)
    out = interop.empty(outs, (rows, dv), out_dtype)
    lse = interop.empty(outs, (rows,), "float32")
    kernel = _kernel(merge_name(interop.name(outs), out_dtype))
    ptr = interop.pointer
    interop.launch(kernel, outs, -(-rows // 8), 256, _MERGE_PARAMS,
                   (ptr(outs), ptr(lses), ptr(out), ptr(lse), parts, rows, dv))
    return out, lse


def merge_attention(xp: Any, *, outs: Any, lses: Any) -> tuple[Any, Any]:
    """Merge partial attention states on the device (contract: softmaxkit.ops)."""
    outs = interop.contiguous(outs)
    lses = interop.contiguous(lses)
    with interop.on_device(outs):
        return _merge(outs, lses, interop.name(outs))



def backward_buffers(q: Any, rows: int, d: int, sums: int | None = None
                     ) -> tuple[Any, Any, Any]:
    """The float32 buffers the backward's launches share, for ``rows`` (padded) query rows:
    each row's lse in log2 units and ``delta = rowsum(dout * out)``, and dQ's sums of
    ``sums`` rows (default ``rows``) of ``d`` (zeroed, since the main kernel adds into
    them)."""
    return (interop.empty(q, (rows,), "float32"), interop.empty(q, (rows,), "float32"),
            interop.zeros(q, ((rows if sums is None else sums) * d,), "float32"))


BACKWARD_PRE_PARAMS = "Q" * 6 + "q" * 6 + "iii" + "q"
"""The backward's first kernel's parameters: the addresses of out, dout, lse, dlse (0: none),
lse2 and delta; the strides of out and dout (three each); hq, lq, the padded lq; the rows."""

BACKWARD_PARAMS = "Q" * 10 + "q" * 15 + "i" * 5 + "ff" + "iiii"
"""The backward's main kernels' parameters (mma.sync and Hopper alike): the addresses of q, k,
v, dout, the mask's bits, lse2, delta, dq's sums, dk and dv; the strides of q, k, v, dout and
the mask's bits (three each); hq, hk, lq, lk, the padded lq; scale, softcap; offset, causal,
left, right."""

BACKWARD_DQ_PARAMS = "QQfiiq"
"""dQ's conversion's parameters: the sums, dq; scale, lq, the padded lq; the chunks."""


def row_cotangent(dlse: Any) -> Any:
    """The lse's cotangent as the row preprocessing reads it, in C order (None: the loss does
    not use the lse); float32 already, as the contract gives it (the lse's dtype)."""
    return None if dlse is None else interop.contiguous(dlse)


def backward_pre_blocks(rows: int, d: int) -> int:
    """Blocks of the backward's first kernel (lse2 and delta) over ``rows`` rows: ``d / 8``
    threads a row rounded up to a power of two (:func:`backward_pre_group`), 256 a block."""
    return -(-rows // (256 // backward_pre_group(d)))


def launch_backward_pre(kernel: Any, like: Any, rows: int, d: int, codes: str,
                        args: tuple[Any, ...]) -> None:
    """Launch the backward's first kernel over ``rows`` rows on ``like``'s device and current
    stream, ``args`` packed as ``codes`` (:func:`backward_pre_blocks`)."""
    interop.launch(kernel, like, backward_pre_blocks(rows, d), 256, codes, args)


def attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, dlse: Any = None,
    config: BackwardConfig | Sm90BackwardConfig | None = None, precision: str = "float32",
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of exact attention on tensor cores, recomputing P from ``lse``.

    A float32 call runs on the exact float32 kernels of :mod:`.attention_f32` at every
    ``precision`` (exact products meet each one's bound).

    Three launches: the rows' lse (log2 units) and ``delta = rowsum(dout * out) - dlse`` (the
    lse's cotangent, where given); the main
    kernel, parallel over key tiles, which writes dk and dv and adds dq's partial products
    into a float32 buffer; and dq's conversion to the input dtype.  The main kernel is the
    Hopper one (:func:`backward_config_for`) on a device of compute capability 9.0 at a head
    dimension it is built for (or zero-padded to one, :func:`hopper_width`), the mma.sync one
    otherwise.  ``config`` overrides the tile
    configuration (one of ``BACKWARD_ALTERNATIVES``, for benchmarks; a call below its head
    dimension runs zero-padded to it, :func:`.head_dims.config_width`).  Head dimensions
    the kernels are not built for run as in :func:`attention`, on copies of q, k, v, out and
    dout zero-padded to the next built one; dq and dk are the first D columns of the padded
    results, dv the first Dv.  A value dimension above 256 runs in blocks of columns, dq and dk
    summed over them (:mod:`.head_dims`).  The launches of a call of PyTorch tensors without
    a mask or ``config`` are kept for the next call of its kind (:mod:`.kept`).
    """
    key = None
    if mask is None and config is None:
        key = kept.torch_key(q, k, v, out, dout, lse)
        if key is not None:
            key = ("attention_vjp", scale, causal, tuple(window), softcap,
                   None if dlse is None else dlse.stride(), *key)
            backward = kept.kept(key)
            if backward is not None and kept.aligned(q, k, v, out, dout):
                return backward(q, k, v, out, dout, lse, dlse, 0)
    if interop.name(q) == "float32":
        from .attention_f32 import attention_vjp as f32_attention_vjp

        return f32_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale,
                                 causal=causal, window=window, mask=mask, softcap=softcap,
                                 dlse=dlse, config=config, keep=key)
    fixed = _backward_without_work(q, k, v)
    if fixed is not None:
        return fixed
    d, dv = int(q.shape[3]), int(v.shape[3])
    blocks = head_dims.value_blocks(d, dv)
    if blocks:  # Dv above the largest built head dimension: a call per block of columns
        with interop.on_device(q):
            return head_dims.gradients_in_blocks(
                xp, blocks, lambda vb, ob, db, first: attention_vjp(
                    xp, q=q, k=k, v=vb, out=ob, lse=lse, dout=db, scale=scale, causal=causal,
                    window=window, mask=mask, softcap=softcap,
                    dlse=dlse if first else None, config=config), v, out, dout)
    width = head_dims.config_width(config, d, dv) if config is not None else hopper_width(
        q, d, dv, SM90_BACKWARD_MASKED_CONFIGS if mask is not None else SM90_BACKWARD_CONFIGS,
        head_dims.SM90_BACKWARD_PADDED_FROM)
    with interop.on_device(q):
        return head_dims.gradients_padded(
            xp, width, lambda q, k, v, out, dout: _attention_vjp(
                xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale, causal=causal,
                window=window, mask=mask, softcap=softcap, dlse=dlse, config=config,
                keep=key if width is None else None),
            q, k, v, out, dout)


@dataclass(frozen=True)
class _ScaledRows:
    """dQ of a float32 backward from its sums: the sums' rows but those padding the query
    tiles, times the scale, by the array library's own operations."""

    xp: Any
    scale: float


@dataclass(frozen=True)
class _Backward:
    """The backward's launches for a kind of call (:mod:`.kept`): the rows' preprocessing, the
    main kernel, and dQ's conversion from its float32 sums (a launch, or for float32
    gradients :class:`_ScaledRows`); its buffers' rows and its gradients' shapes."""

    pre: kept.Launch
    main: kept.Launch
    convert: kept.Launch | _ScaledRows
    name: str
    rows: int
    dq_shape: tuple[int, ...]
    dk_shape: tuple[int, ...]
    dv_shape: tuple[int, ...]
    dtype: str

    def __call__(self, q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, dlse: Any,
                 m_ptr: int) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` (the mask's bits at ``m_ptr``, 0 for none)."""
        b, hq, lq, d = self.dq_shape
        lse2, delta, dq_acc = backward_buffers(q, self.rows, d)
        dk = interop.empty(q, self.dk_shape, self.dtype)
        dv = interop.empty(q, self.dv_shape, self.dtype)
        ptr = interop.pointer
        self.pre(q, ptr(out), ptr(dout), ptr(lse), 0 if dlse is None else ptr(dlse),
                 ptr(lse2), ptr(delta))
        note_kernel(self.name)
        self.main(q, ptr(q), ptr(k), ptr(v), ptr(dout), m_ptr, ptr(lse2), ptr(delta),
                  ptr(dq_acc), ptr(dk), ptr(dv))
        if isinstance(self.convert, _ScaledRows):
            sums = self.convert.xp.reshape(dq_acc, (b, hq, self.rows // (b * hq), d))
            return sums[:, :, :lq, :] * self.convert.scale, dk, dv
        dq = interop.empty(q, self.dq_shape, self.dtype)
        self.convert(q, ptr(dq_acc), ptr(dq))
        return dq, dk, dv


def _attention_vjp(
    xp: Any, *, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, scale: float,
    causal: Any, window: tuple[int, int], mask: Any, softcap: Any, dlse: Any,
    config: BackwardConfig | Sm90BackwardConfig | None, keep: tuple | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`attention_vjp` of a call with work, at a built head dimension (D = Dv); its
    launches kept under ``keep`` (a key of :mod:`.kept`, or None) where they read the arrays
    in place."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, lk = int(k.shape[1]), int(k.shape[2])
    given = (q, k, v, out, dout, lse, dlse)
    q, k, v, out, dout = (_rows_ready(xp, a) for a in (q, k, v, out, dout))
    lse, dlse = interop.contiguous(lse), row_cotangent(dlse)
    keep = kept.in_place(keep, given, (q, k, v, out, dout, lse, dlse))
    dtype = interop.name(q)
    device = interop.device_index(q)
    config = config or backward_config_for(_capability_of(device), d, mask is not None,
                                           interop.shared_limit(device))
    lq_pad = -(-lq // config.block_m) * config.block_m
    rows = b * hq * lq_pad
    _bits, m_ptr, m_strides, options = kernel_options(mask, causal, window, softcap, scale,
                                                      lq, lk)
    qs, ks, vs, os_, gs = (interop.element_strides(a) for a in (q, k, v, out, dout))
    name = config.name(dtype)
    chunks = b * hq * lq * d // 8
    backward = _Backward(
        kept.Launch(_kernel(backward_pre_name(dtype, d)), backward_pre_blocks(rows, d), 256,
                    BACKWARD_PRE_PARAMS, (*os_[:3], *gs[:3], hq, lq, lq_pad, rows)),
        kept.Launch(_kernel(name), (-(-lk // config.block_n), hk, b), config.threads,
                    BACKWARD_PARAMS, (*qs[:3], *ks[:3], *vs[:3], *gs[:3], *m_strides, hq, hk,
                                      lq, lk, lq_pad, *options), config.shared_bytes()),
        kept.Launch(_kernel(backward_dq_name(dtype, d)), -(-chunks // 256), 256,
                    BACKWARD_DQ_PARAMS, (scale, lq, lq_pad, chunks)),
        name, rows, (b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d), dtype)
    kept.keep(keep, backward)
    return backward(q, k, v, out, dout, lse, dlse, m_ptr)
