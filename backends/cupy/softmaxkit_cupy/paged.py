"""Adapter from paged attention (softmaxkit/ops.py, ``paged_attention``) to the paged split-KV
decode kernel of ``kernels/attention.cu``.

The frontend hands q [B, Hq, Lq, D], the page pools k_pages [P, Hk, S, D] and v_pages
[P, Hk, S, Dv] of one 16-bit dtype, and the block table [B, max_pages] and sequence lengths
[B] (int32 or int64, validated on the host); :func:`softmaxkit_cupy.manifest.can_run` has
accepted the call (library, dtype, head dimensions, launch limits).

The kernel is the dense split-KV decode kernel with the address of each key row looked up in
the block table: block (split, key head, sequence) reads the sequence's length on the device
and walks keys ``[split * chunk, (split + 1) * chunk)`` of it, and the splits' partial states
are merged by the merge kernel.  The grid spans the table's capacity (``max_pages * S``
keys), read from shapes alone, so the adapter never synchronizes with the device; a split
past a sequence's end writes an empty partial state (lse -inf), which the merge leaves out.
With a left window bound the kernel starts each sequence at the first query's window, so the
grid spans at most ``left + Lq`` keys and a sliding window over a long cache reads only the
window's pages.
Calls with no query row, or whose table holds no page (every sequence empty), have results
fixed by the spec and are made without a launch.

Head dimensions the kernel is not built for (D != Dv, or D outside ``ATTENTION_HEAD_DIMS``;
both at most 256) run at the next built one P on zero-padded copies (:mod:`.head_dims`) of q
and of each page pool narrower than P, whole: such a pool is copied on every call, all its
pages, used or not (memory traffic in proportion to the pool's size, not to the pages in
use); the kernel on the copies still runs far faster than the reference backend.

The decode kernel holds at most ``DECODE_ROWS`` query rows (``Hq / Hk`` heads times ``Lq``
queries) per key head.  A longer chunked prefill runs on the dense attention kernels instead:
the pages in use gathered into a dense cache, each sequence's length and bottom-right
alignment as a boolean mask (:mod:`softmaxkit.paged_cache`), at the cost of a copy of those
pages and a ``[B, Lq, max_pages * S]`` mask.  float32 calls the decode kernel holds run on
its float32 twin (``sk_attn_decode_f32_paged``, kernels/attention_f32.cu: the same walk of the
pages, in float32 arithmetic), where the device's shared memory holds its tiles
(:func:`.configs.f32_decode_config`); the others on the exact float32 kernels
(:mod:`.attention_f32`) over the gathered pages.
"""

from __future__ import annotations

import math
from typing import Any

from softmaxkit.paged_cache import dense_operands

from . import head_dims, interop
from .attention import _rows_ready, attention, split_decode
from .attention_f32 import decode_width
from .configs import (
    DecodeConfig,
    F32DecodeConfig,
    decode_config,
    decode_holds,
    f32_decode_config,
)

_PAGED_PARAMS = "QQQQQQQ" + "qqq" * 3 + "q" + "iIiiiiiff" + "iii"
"""The paged decode kernel's parameters: the addresses of q, k_pages, v_pages, block_table,
seqlens, the partial out and lse; the strides of q, k_pages, v_pages (three each) and the
table's row stride; page_size, the divisor's mul and shift, hq, hk, lq, chunk; scale,
softcap; causal, left, right."""


def page_divisor(page_size: int) -> tuple[int, int]:
    """``(mul, shift)`` with ``p // page_size == (p * mul) >> shift`` for ``0 <= p < 2**31``.

    The kernel divides key positions by the page size, a runtime value, with one
    multiply-high: ``shift = 31 + ceil(log2(page_size))`` and ``mul = ceil(2**shift /
    page_size)``, which fits in 32 bits (round-up division by invariant integers).

    Parameters
    ----------
    page_size : int
        The divisor, ``1 <= page_size < 2**31``.

    Returns
    -------
    mul : int
        The multiplier, ``0 < mul < 2**32``.
    shift : int
        The right shift of the 64-bit product.
    """
    if not 1 <= page_size < 2**31:
        raise ValueError(f"page_size must lie in [1, 2**31); got {page_size}")
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def window_span(window: tuple[int, int], lq: int, capacity: int) -> tuple[int, int, int]:
    """``(left, right, span)``: the window bounds the kernel takes and the keys its grid spans.

    A bound past ``capacity + lq`` excludes no key of a sequence of at most ``capacity``
    keys, so it is clamped there (and fits the kernel's int32).  With a left bound the kernel
    starts each sequence at the first query's window, ``max(0, seqlens[b] - lq - left)``,
    so the grid spans at most ``left + lq`` keys; else the table's capacity.

    Parameters
    ----------
    window : (int, int)
        ``(left, right)``, -1 unbounded.
    lq : int
        Queries per sequence.
    capacity : int
        ``max_pages * page_size``: the most keys a sequence has.

    Returns
    -------
    left, right : int
        The bounds passed to the kernel.
    span : int
        The most keys of a sequence the kernel walks.
    """
    left, right = (min(int(w), capacity + lq) for w in window)
    return left, right, capacity if left < 0 else min(capacity, left + lq)


def _int32(xp: Any, a: Any) -> Any:
    """``a`` as a contiguous int32 array: the kernel reads int32 metadata.  int64 values the
    frontend validated (lengths, the pages in use) are below the pool size and convert
    exactly; entries the kernel never reads may wrap."""
    return interop.contiguous(xp.astype(a, xp.int32, copy=False))


def paged_attention(
    xp: Any, *, q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any,
    scale: float, causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
    config: DecodeConfig | F32DecodeConfig | None = None,
) -> tuple[Any, Any]:
    """Attention of ``q`` against a paged KV cache on tensor cores; ``(out, lse or None)``.

    Parameters
    ----------
    xp : namespace
        The caller's array namespace.
    q : array
        ``[B, Hq, Lq, D]``, bfloat16, float16 or float32.
    k_pages, v_pages : array
        ``[P, Hk, S, D]`` and ``[P, Hk, S, Dv]`` in q's dtype, ``D, Dv <= 256``.  At head
        dimensions the kernel is not built for (:mod:`.head_dims`) a pool narrower than the
        head dimension the call runs at is copied, zero-padded, on every call: a cost
        proportional to the pool's size, not to the pages in use.
    block_table : array
        int32 or int64 ``[B, max_pages]``: the pages of each sequence.
    seqlens : array
        int32 or int64 ``[B]``: the keys of each sequence, its ``Lq`` queries' included.
    scale : float
        Score scale.
    causal : None or "bottom_right"
        Query ``i`` of sequence ``b`` sees keys ``j <= seqlens[b] - Lq + i``.
    window : (int, int)
        ``(left, right)`` around the same diagonal, -1 unbounded.
    softcap : float or None
        Cap of the scaled scores (None: no cap).
    return_lse : bool
        Also return the natural-log log-sum-exp.
    config : DecodeConfig or F32DecodeConfig, optional
        The decode kernel's tiles (for benchmarks; by default :func:`.configs.decode_config`
        of the head dimension; float32: :func:`.configs.f32_decode_config`'s, or the exact
        dense kernels over the gathered pages where the device cannot hold them).

    Returns
    -------
    out : array
        ``[B, Hq, Lq, Dv]`` in q's dtype; 0 for a row with no allowed key.
    lse : array or None
        ``[B, Hq, Lq]`` float32, ``-inf`` for a row with no allowed key; None unless
        ``return_lse``.
    """
    b, hq, lq, d = (int(s) for s in q.shape)
    dv = int(v_pages.shape[3])
    capacity = int(block_table.shape[1]) * int(k_pages.shape[2])
    dtype = interop.name(q)
    if b * hq * lq == 0:
        return (interop.empty(q, (b, hq, lq, dv), dtype),
                interop.empty(q, (b, hq, lq), "float32") if return_lse else None)
    if capacity == 0:  # no sequence has a key: every row is empty (out 0, lse -inf)
        return (interop.zeros(q, (b, hq, lq, dv), dtype),
                interop.full(q, (b, hq, lq), -math.inf, "float32") if return_lse else None)
    if dtype == "float32" and config is None:
        config = f32_decode_config(d, dv, interop.shared_limit(interop.device_index(q)))
    if ((dtype == "float32" and not isinstance(config, F32DecodeConfig))
            or not decode_holds(hq, int(k_pages.shape[1]), lq)):
        return _prefill(xp, q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table,
                        seqlens=seqlens, scale=scale, causal=causal, window=window,
                        softcap=softcap, return_lse=return_lse)
    width = (decode_width(config, d, dv) if isinstance(config, F32DecodeConfig)
             else head_dims.pad_width(d, dv))
    with interop.on_device(q):
        return head_dims.forward_padded(xp, width, lambda q, kp, vp: (
            _paged_attention(xp, q=q, k_pages=kp, v_pages=vp, block_table=block_table,
                             seqlens=seqlens, scale=scale, causal=causal, window=window,
                             softcap=softcap, return_lse=return_lse, config=config)),
            q, k_pages, v_pages)


def _prefill(
    xp: Any, *, q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any,
    scale: float, causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
) -> tuple[Any, Any]:
    """A call with more query rows per key head than the decode kernel holds (a long chunked
    prefill), or of float32: the dense attention kernels on the pages in use, gathered, with
    each sequence's length and bottom-right alignment as a mask
    (:mod:`softmaxkit.paged_cache`; head dimensions as :func:`.attention.attention` serves
    them, padded there if need be)."""
    with interop.on_device(q):
        k, v, mask = dense_operands(xp, q=q, k_pages=k_pages, v_pages=v_pages,
                                    block_table=block_table, seqlens=seqlens, causal=causal,
                                    window=window)
    return attention(xp, q=q, k=k, v=v, scale=scale, causal=None, window=(-1, -1), mask=mask,
                     softcap=softcap, return_lse=return_lse)


def _paged_attention(
    xp: Any, *, q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any,
    scale: float, causal: Any, window: tuple[int, int], softcap: Any, return_lse: bool,
    config: DecodeConfig | F32DecodeConfig | None = None,
) -> tuple[Any, Any]:
    """:func:`paged_attention` of a call with work, at a built head dimension (D = Dv), on
    ``config``'s kernel (default: :func:`.configs.decode_config`'s)."""
    b, hq, lq, d = (int(s) for s in q.shape)
    hk, page_size = int(k_pages.shape[1]), int(k_pages.shape[2])
    capacity = int(block_table.shape[1]) * page_size
    q, k_pages, v_pages = (_rows_ready(xp, a) for a in (q, k_pages, v_pages))
    table, lens = _int32(xp, block_table), _int32(xp, seqlens)
    mul, shift = page_divisor(page_size)
    left, right, span = window_span(window, lq, capacity)
    ptr = interop.pointer
    qs, ks, vs = (interop.element_strides(a) for a in (q, k_pages, v_pages))

    def launch_args(parts: int, part_lses: int, chunk: int) -> tuple[Any, ...]:
        return (ptr(q), ptr(k_pages), ptr(v_pages), ptr(table), ptr(lens), parts, part_lses,
                *qs[:3], *ks[:3], *vs[:3], interop.element_strides(table)[0], page_size, mul,
                shift, hq, hk, lq, chunk, scale, softcap if softcap is not None else 0.0,
                int(causal is not None), left, right)

    # the grid spans the keys a query can reach (span), not the table's capacity
    config = config or decode_config(d, interop.shared_limit(interop.device_index(q)))
    out, lse = split_decode(q, config, True, _PAGED_PARAMS, (b, hq, hk, lq, d), span,
                            launch_args)
    return xp.reshape(out, (b, hq, lq, d)), (xp.reshape(lse, (b, hq, lq)) if return_lse
                                              else None)
