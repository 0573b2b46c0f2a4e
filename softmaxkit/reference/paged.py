"""Reference paged attention: gather each sequence's pages, then the tiled dense attention.

Every sequence's pages are gathered (``take`` along the pool axis) into a dense
``[B, Hk, max_pages * page_size, D]`` cache; key positions at or beyond a sequence's length
are zeroed, so whatever the unused slots hold (NaN, stale data) never reaches the result; the
per-sequence lengths and the bottom-right causal and window bands become one boolean mask, and
:func:`softmaxkit.reference.attention.attention` does the rest.  Everything stays on the
caller's device in array-API calls; no metadata is read on the host.
"""

from __future__ import annotations

from typing import Any

from .attention import BLOCK, _device, in_bands
from .attention import attention as dense_attention


def _gather(xp: Any, pages: Any, table: Any, used: Any) -> Any:
    """``[B, H, max_pages * S, d]``: the pages of each sequence in order; unused entries of
    the table read page 0 (their keys are excluded and zeroed by the caller)."""
    b, max_pages = table.shape
    _, h, s, d = pages.shape
    if pages.shape[0] == 0 or b * max_pages == 0:  # no page at all: no key
        return xp.zeros((b, h, max_pages * s, d), dtype=pages.dtype, device=_device(pages))
    index = xp.reshape(xp.where(used, table, xp.zeros_like(table)), (b * max_pages,))
    g = xp.take(pages, index, axis=0)  # [B * max_pages, H, S, d]
    g = xp.permute_dims(xp.reshape(g, (b, max_pages, h, s, d)), (0, 2, 1, 3, 4))
    return xp.reshape(g, (b, h, max_pages * s, d))


def allowed_keys(
    xp: Any, seqlens: Any, lq: int, lk: int, causal: Any, window: tuple[int, int], device: Any
) -> Any:
    """``[B, Lq, Lk]`` boolean: key ``j`` allowed for query ``i`` of sequence ``b``.

    Key ``j`` exists when ``j < seqlens[b]``; query ``i``'s diagonal is
    ``d = seqlens[b] - Lq + i``, and its bands are those of
    :func:`~softmaxkit.reference.attention.in_bands`.
    """
    # integers of the library's default dtype and the lengths' own (int32 or int64) compare
    # without casts, which keeps JAX without x64 free of int64 requests
    n = xp.reshape(seqlens, (-1, 1, 1))
    i = xp.reshape(xp.arange(lq, device=device), (1, lq, 1))
    j = xp.reshape(xp.arange(lk, device=device), (1, 1, lk))
    return in_bands(j < n, n - lq + i, j, causal, window)


def paged_attention(
    xp: Any,
    *,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seqlens: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    softcap: Any,
    return_lse: bool,
    block: int = BLOCK,
) -> tuple[Any, Any]:
    """Attention of ``q [B, Hq, Lq, D]`` over the paged cache; out 0 and lse -inf for rows
    with no allowed key (``block`` is the dense kernel's key tile)."""
    dev = _device(q)
    b, hq, lq, _ = q.shape
    max_pages = block_table.shape[1]
    page_size = k_pages.shape[2]
    lk = max_pages * page_size
    # the pages each sequence uses: the first ceil(seqlens[b] / page_size) of its row
    first_key = xp.reshape(xp.arange(max_pages, device=dev), (1, -1)) * page_size
    used = first_key < xp.reshape(seqlens, (-1, 1))
    k = _gather(xp, k_pages, block_table, used)
    v = _gather(xp, v_pages, block_table, used)
    exists = allowed_keys(xp, seqlens, 1, lk, None, (-1, -1), dev)[:, None, ...]
    # slots past a sequence's end are excluded by the mask, and zeroed so their contents
    # cannot reach the output through the P V product either
    k = xp.where(xp.permute_dims(exists, (0, 1, 3, 2)), k, xp.zeros_like(k))
    v = xp.where(xp.permute_dims(exists, (0, 1, 3, 2)), v, xp.zeros_like(v))
    ok = allowed_keys(xp, seqlens, lq, lk, causal, window, dev)
    mask = xp.broadcast_to(ok[:, None, ...], (b, hq, lq, lk))
    return dense_attention(
        xp, q=q, k=k, v=v, scale=scale, causal=None, window=(-1, -1), mask=mask,
        softcap=softcap, return_lse=return_lse, block=block,
    )
