"""A paged KV cache as the operands of dense attention, for backends whose paged kernels do not
cover a call (or that have none): the pages each sequence uses gathered into a dense cache, and
the sequences' lengths and bottom-right alignment as a boolean mask.

Dense attention of the queries against these operands, with that mask and no causal or window
argument, is what the spec defines for ``paged_attention`` ("Paged attention"): query ``i`` of
sequence ``b`` sits on key ``seqlens[b] - Lq + i``, and keys at or past ``seqlens[b]`` are
excluded.  The slots past a sequence's length are set to 0: they may hold anything (NaN too),
and an excluded key's value still meets a probability of 0 in the ``P V`` product.

The cost, against a kernel that reads the pages in place: a copy of the pages in use
(``B * max_pages * page_size`` slots of K and of V) and a ``[B, Lq, max_pages * page_size]``
boolean mask.  Only the array API is used, so any backend's arrays serve.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import device as device_of

from .reference.attention import in_bands


def _gathered(xp: Any, pool: Any, pages: Any, live: Any, b: int, capacity: int) -> Any:
    """The pages ``pages`` [B, max_pages] of ``pool`` [P, Hk, S, D] as a contiguous
    [B, Hk, capacity, D], 0 where ``live`` [B, 1, capacity, 1] is False."""
    _, hk, size, d = (int(s) for s in pool.shape)
    rows = xp.take(pool, xp.reshape(pages, (-1,)), axis=0)  # [B * max_pages, Hk, S, D]
    rows = xp.reshape(rows, (b, capacity // size, hk, size, d))
    dense = xp.reshape(xp.permute_dims(rows, (0, 2, 1, 3, 4)), (b, hk, capacity, d))
    return xp.where(live, dense, xp.zeros((), dtype=dense.dtype, device=device_of(dense)))


def dense_operands(
    xp: Any, *, q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any,
    causal: Any, window: tuple[int, int],
) -> tuple[Any, Any, Any]:
    """``(k, v, mask)`` of dense attention that computes a ``paged_attention`` call.

    Parameters
    ----------
    xp : namespace
        The arrays' namespace (array API).
    q : array
        ``[B, Hq, Lq, D]``: only its shape is read.
    k_pages, v_pages : array
        ``[P, Hk, S, D]`` and ``[P, Hk, S, Dv]``.
    block_table, seqlens : array
        int32 or int64 ``[B, max_pages]`` and ``[B]``, validated by the frontend: the pages a
        sequence uses lie in the pool.  Entries past a sequence's pages may hold anything;
        they are read as page 0, whose slots there are set to 0 and excluded.
    causal : None or "bottom_right"
        As for ``paged_attention``.
    window : (int, int)
        ``(left, right)`` around each query's diagonal key, -1 unbounded.

    Returns
    -------
    k, v : array
        ``[B, Hk, C, D]`` and ``[B, Hk, C, Dv]``, ``C = max_pages * S``, contiguous, 0 past
        each sequence's length.
    mask : array
        bool ``[B, Hq, Lq, C]``, a view broadcast over the query heads: True where query ``i``
        of sequence ``b`` may attend to key ``j`` (inside the sequence and the bands).
    """
    b, hq, lq, _ = (int(s) for s in q.shape)
    size = int(k_pages.shape[2])
    capacity = int(block_table.shape[1]) * size
    dev = device_of(q)
    lens = xp.astype(seqlens, xp.int64)
    firsts = xp.arange(0, capacity, size, dtype=xp.int64, device=dev)  # an entry's first key
    pages = xp.where(firsts[None, :] < lens[:, None], xp.astype(block_table, xp.int64),
                     xp.zeros((), dtype=xp.int64, device=dev))
    keys = xp.arange(capacity, dtype=xp.int64, device=dev)
    live = keys[None, :] < lens[:, None]  # [B, capacity]
    k, v = (_gathered(xp, pool, pages, live[:, None, :, None], b, capacity)
            for pool in (k_pages, v_pages))
    diagonal = lens[:, None] - lq + xp.arange(lq, dtype=xp.int64, device=dev)[None, :]
    allowed = in_bands(live[:, None, :], diagonal[..., None], keys[None, None, :], causal,
                       window)  # [B, Lq, capacity]
    return k, v, xp.broadcast_to(allowed[:, None], (b, hq, lq, capacity))
