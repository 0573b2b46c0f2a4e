"""Paged attention in float32 and float64 (``paged_attention``, contract: softmaxkit.ops) on the
exact attention kernels of :mod:`.attention`.

The pages each sequence uses are gathered into a dense cache ``[B, Hk, max_pages * S, D]``,
its slots past the sequence's length set to 0, and each sequence's length and bottom-right
alignment become a boolean mask over it, so the dense kernel computes what the spec defines
("Paged attention"): query ``i`` of sequence ``b`` sits on key ``seqlens[b] - Lq + i``, and
keys at or past ``seqlens[b]`` are excluded.  The gathered cache costs a copy of the pages;
the 16-bit split-KV decode kernel of the cupy backend reads them in place.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import device as device_of

from . import attention_kernels as kernels
from .attention import attention


def _gathered(xp: Any, pool: Any, pages: Any, live: Any, b: int, capacity: int) -> Any:
    """The pages ``pages`` [B, max_pages] of ``pool`` [P, Hk, S, D] as a contiguous
    [B, Hk, capacity, D], 0 where ``live`` [B, 1, capacity, 1] is False: the slots past a
    sequence's length may hold anything (NaN too), and the kernel multiplies excluded keys'
    values by a probability of 0."""
    _, hk, size, d = (int(s) for s in pool.shape)
    rows = xp.take(pool, xp.reshape(pages, (-1,)), axis=0)  # [B * max_pages, Hk, S, D]
    rows = xp.reshape(rows, (b, capacity // size, hk, size, d))
    dense = xp.reshape(xp.permute_dims(rows, (0, 2, 1, 3, 4)), (b, hk, capacity, d))
    return xp.where(live, dense, xp.zeros((), dtype=dense.dtype, device=device_of(dense)))


def paged_attention(*, xp: Any, q: Any, k_pages: Any, v_pages: Any, block_table: Any,
                    seqlens: Any, scale: float, causal: Any, window: tuple[int, int],
                    softcap: Any, return_lse: bool) -> tuple[Any, Any]:
    """Attention of ``q`` [B, Hq, Lq, D] against a paged KV cache; ``(out, lse or None)``.

    The frontend has validated the metadata: lengths within their pages, the pages in use
    inside the pool.  Table entries past a sequence's pages may hold anything and are read
    as page 0, whose slots there are set to 0 and excluded.
    """
    b, hq, lq, _ = (int(s) for s in q.shape)
    size = int(k_pages.shape[2])
    capacity = int(block_table.shape[1]) * size
    dev = device_of(q)
    lens = xp.astype(seqlens, xp.int64)
    firsts = xp.arange(0, capacity, size, dtype=xp.int64, device=dev)  # a table entry's first key
    pages = xp.where(firsts[None, :] < lens[:, None], xp.astype(block_table, xp.int64),
                     xp.zeros((), dtype=xp.int64, device=dev))
    keys = xp.arange(capacity, dtype=xp.int64, device=dev)
    live = keys[None, :] < lens[:, None]  # [B, capacity]
    k, v = (_gathered(xp, pool, pages, live[:, None, :, None], b, capacity)
            for pool in (k_pages, v_pages))
    diagonal = lens[:, None] - lq + xp.arange(lq, dtype=xp.int64, device=dev)[None, :]
    lo, hi = kernels.band_limits(causal, window)
    rel = keys[None, None, :] - diagonal[..., None]  # [B, Lq, capacity]
    allowed = live[:, None, :] & (rel >= lo) & (rel <= hi)
    mask = xp.broadcast_to(allowed[:, None], (b, hq, lq, capacity))
    return attention(xp=xp, q=q, k=k, v=v, scale=scale, causal=None, window=(-1, -1),
                     mask=mask, softcap=softcap, return_lse=return_lse)
