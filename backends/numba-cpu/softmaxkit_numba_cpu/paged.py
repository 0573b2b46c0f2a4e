"""Paged attention on the CPU: split-KV over chunks of pages, partial states merged exactly.

Each sequence's cache is cut into chunks of whole pages, :data:`SPLIT_KEYS` keys at most.  A
chunk's pages are gathered into one contiguous block in the accumulator dtype (that chunk
only, never the whole cache) and run through the dense forward of :mod:`.attention`
(:func:`~.attention.forward_into`) with the chunk's own diagonal offset; the chunks' partial
``(out, lse)`` states are merged by this backend's ``merge_attention`` kernel, the rescaling
merge of spec/semantics.md, "Merging partial attention states".  A chunk that the causal and
window bands exclude for every query is never gathered (a sliding window over a long cache
reads only the pages it reaches), and slots at or beyond a sequence's length are sliced off
before the kernel, so they are never read.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.numpy as npx
import numpy as np

from softmaxkit.dtypes import accumulator_dtype

from .adapters import Output, empty, numpy_view, readable
from .attention import compute_arrays, forward_into

SPLIT_KEYS = 1024
"""The most keys of one chunk: longer caches are split and their partial states merged."""


def _reaches(key0: int, key1: int, lq: int, diag0: int, causal: bool, left: int,
             right: int) -> bool:
    """Whether keys ``key0:key1`` are allowed for some query; query ``i``'s diagonal is
    ``diag0 + i`` and its band ``[diag - left, diag + right]`` (causal caps ``right`` at 0).

    Consecutive queries' bands shift by one key, so their union is one interval."""
    above = math.inf if right < 0 else right
    if causal:
        above = min(above, 0)
    upper = diag0 + lq - 1 + above
    lower = -math.inf if left < 0 else diag0 - left
    return lq > 0 and key0 <= upper and key1 - 1 >= lower


def _gather(pool: np.ndarray, pages: np.ndarray, keys: int, dtype: np.dtype) -> np.ndarray:
    """``[1, H, keys, d]``: the first ``keys`` positions of ``pages`` in order, C-contiguous."""
    g = pool[pages]  # [n, H, S, d]
    n, h, s, d = g.shape
    g = g.transpose(1, 0, 2, 3).reshape(h, n * s, d)[:, :keys]
    return readable(np.ascontiguousarray(g[None], dtype=dtype))


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
    split_keys: int = SPLIT_KEYS,
) -> tuple[Any, Any]:
    """Attention of ``q [B, Hq, Lq, D]`` over the paged cache, split into chunks of at most
    ``split_keys`` keys (whole pages, at least one) whose partial states are merged."""
    from .summaries import merge_attention

    (qn,) = compute_arrays(q)
    acc = qn.dtype
    bsz, hq, lq, _ = qn.shape
    kpool, vpool = numpy_view(k_pages), numpy_view(v_pages)
    table, lens = numpy_view(block_table), numpy_view(seqlens)
    page_size, dv = kpool.shape[2], vpool.shape[3]
    result = Output((bsz, hq, lq, dv), q.dtype, q, acc)
    lse, lse_s = empty((bsz, hq, lq), accumulator_dtype(xp, q.dtype), q)
    out_s = result.storage
    is_causal, (left, right) = causal is not None, window
    chunk = max(1, split_keys // max(page_size, 1)) * page_size
    for b in range(bsz):
        n = int(lens[b])
        diag0 = n - lq  # query i's diagonal key, in the sequence's positions
        parts = []
        for key0 in range(0, n, chunk):
            key1 = min(n, key0 + chunk)
            if not _reaches(key0, key1, lq, diag0, is_causal, int(left), int(right)):
                continue
            pages = table[b, key0 // page_size: -(-key1 // page_size)].astype(np.intp)
            kc = _gather(kpool, pages, key1 - key0, acc)
            vc = _gather(vpool, pages, key1 - key0, acc)
            o = np.empty((1, hq, lq, dv), dtype=acc)
            s = np.empty((1, hq, lq), dtype=acc)
            forward_into(qn[b:b + 1], kc, vc, o, s, scale, diag0 - key0, is_causal,
                         int(left), int(right), softcap)
            parts.append((o, s))
        if not parts:  # no key reaches any query: the spec's empty rows
            out_s[b] = 0
            lse_s[b] = -np.inf
        elif len(parts) == 1:
            out_s[b], lse_s[b] = parts[0][0][0], parts[0][1][0]
        else:
            outs = np.stack([o.reshape(hq * lq, dv) for o, _ in parts])
            lses = np.stack([s.reshape(hq * lq) for _, s in parts])
            o, s = merge_attention(npx, outs=outs, lses=lses)
            out_s[b], lse_s[b] = o.reshape(hq, lq, dv), s.reshape(hq, lq)
    return result.finish(), (lse if return_lse else None)
