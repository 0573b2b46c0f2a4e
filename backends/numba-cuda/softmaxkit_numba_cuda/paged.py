"""Paged attention in float32 and float64 (``paged_attention``, contract: softmaxkit.ops) on the
exact attention kernels of :mod:`.attention`.

The pages each sequence uses are gathered into a dense cache ``[B, Hk, max_pages * S, D]``,
its slots past the sequence's length set to 0, and each sequence's length and bottom-right
alignment become a boolean mask over it (:mod:`softmaxkit.paged_cache`), so the dense kernel
computes what the spec defines ("Paged attention"): query ``i`` of sequence ``b`` sits on key
``seqlens[b] - Lq + i``, and keys at or past ``seqlens[b]`` are excluded.  The gathered cache
costs a copy of the pages; the 16-bit split-KV decode kernel of the cupy backend reads them in
place.
"""

from __future__ import annotations

from typing import Any

from softmaxkit.paged_cache import dense_operands

from .attention import attention


def paged_attention(*, xp: Any, q: Any, k_pages: Any, v_pages: Any, block_table: Any,
                    seqlens: Any, scale: float, causal: Any, window: tuple[int, int],
                    softcap: Any, return_lse: bool) -> tuple[Any, Any]:
    """Attention of ``q`` [B, Hq, Lq, D] against a paged KV cache; ``(out, lse or None)``.

    The frontend has validated the metadata: lengths within their pages, the pages in use
    inside the pool (:func:`softmaxkit.paged_cache.dense_operands` gathers them).
    """
    k, v, mask = dense_operands(xp, q=q, k_pages=k_pages, v_pages=v_pages,
                                block_table=block_table, seqlens=seqlens, causal=causal,
                                window=window)
    return attention(xp=xp, q=q, k=k, v=v, scale=scale, causal=None, window=(-1, -1),
                     mask=mask, softcap=softcap, return_lse=return_lse)
