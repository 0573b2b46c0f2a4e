"""Paged attention on the CPU: split-KV over chunks of pages, partial states merged exactly.

Each sequence's cache is cut into chunks of whole pages, :data:`SPLIT_KEYS` keys (more
when the partial outputs of many queries would pass :data:`PARTIAL_ELEMENTS`).
Chunks' pages are gathered into contiguous blocks in the accumulator dtype (a bounded number
of chunks at a time, :data:`GROUP_KEYS`, never the whole cache at once) and run through the
dense forward of :mod:`.attention` (:func:`~.attention.forward_into`): the chunks every query
sees whole as one batch without a band, the others one by one with their own diagonal
offset.  The chunks' partial ``(out, lse)`` states are merged by this backend's
``merge_attention`` kernel, the rescaling merge of spec/semantics.md, "Merging partial
attention states".  A chunk that the causal and window bands exclude for every query is never
gathered (a sliding window over a long cache reads only the pages it reaches), and slots at
or beyond a sequence's length are sliced off before the kernel, so they are never read.
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

GROUP_KEYS = 1 << 15
"""The most keys gathered for one batched kernel call over whole chunks (bounds the copy)."""

PARTIAL_ELEMENTS = 1 << 24
"""About the most elements of the partial outputs held for the merge: long chunked prefills
(many queries) get longer chunks rather than one partial output per 1024 keys."""


def _coverage(key0: int, key1: int, lq: int, diag0: int, causal: bool, left: int,
              right: int) -> str:
    """``"none"``, ``"all"`` or ``"some"``: which (query, key) pairs of keys ``key0:key1`` the
    bands allow.  Query ``i``'s diagonal is ``diag0 + i`` and its band ``[diag - left,
    diag + right]`` (causal caps ``right`` at 0, -1 is unbounded); consecutive bands shift by
    one key, so query 0 bounds the union above and query ``Lq - 1`` bounds every band below.
    """
    above = math.inf if right < 0 else right
    if causal:
        above = min(above, 0)
    below = math.inf if left < 0 else left
    if lq == 0 or key0 > diag0 + lq - 1 + above or key1 - 1 < diag0 - below:
        return "none"
    if key1 - 1 <= diag0 + above and key0 >= diag0 + lq - 1 - below:
        return "all"
    return "some"


def _gather_into(dst: np.ndarray, pool: np.ndarray, pages: np.ndarray) -> None:
    """Write the first ``keys`` positions of ``pages`` (in order) into ``dst [H, keys, d]``,
    converted to its dtype: one read of the pool and one write, nothing past ``keys``."""
    h, keys, d = dst.shape
    size = pool.shape[2]
    full = keys // size
    if full:  # splitting the key axis of a C-contiguous block is a view
        dst[:, :full * size].reshape(h, full, size, d)[...] = (
            pool[pages[:full]].transpose(1, 0, 2, 3))
    if keys > full * size:
        dst[:, full * size:] = pool[pages[full], :, :keys - full * size]


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
    group_keys: int = GROUP_KEYS,
) -> tuple[Any, Any]:
    """Attention of ``q [B, Hq, Lq, D]`` over the paged cache, split into chunks of at most
    ``split_keys`` keys (whole pages, at least one; more when the partial outputs would
    exceed :data:`PARTIAL_ELEMENTS`) whose partial states are merged.

    Chunks that every query sees whole (all but the last of a decoding sequence) run as one
    batch of the dense kernel, ``group_keys`` keys at a time, so the kernel's threads
    share them; the others (a sequence's last, partial chunk; chunks a band cuts) run one by
    one with their own diagonal offset.
    """
    from .summaries import merge_attention

    (qn,) = compute_arrays(q)
    acc = qn.dtype
    bsz, hq, lq, _ = qn.shape
    kpool, vpool = numpy_view(k_pages), numpy_view(v_pages)
    table, lens = numpy_view(block_table), numpy_view(seqlens)
    page_size, hk, dv = kpool.shape[2], kpool.shape[1], vpool.shape[3]
    is_causal, left, right = causal is not None, int(window[0]), int(window[1])
    per_part = bsz * hq * lq * max(dv, 1)
    parts_allowed = max(1, PARTIAL_ELEMENTS // max(per_part, 1))
    keys = max(split_keys, -(-int(lens.max(initial=0)) // parts_allowed))
    chunk = max(1, keys // max(page_size, 1)) * page_size
    whole, cut = [], []  # (sequence, part, first key, end key)
    parts = np.zeros(bsz, dtype=np.int64)
    for b in range(bsz):
        n = int(lens[b])
        for key0 in range(0, n, max(chunk, 1)):
            key1 = min(n, key0 + chunk)
            seen = _coverage(key0, key1, lq, n - lq, is_causal, left, right)
            if seen != "none":
                (whole if seen == "all" and key1 - key0 == chunk else cut).append(
                    (b, int(parts[b]), key0, key1))
                parts[b] += 1
    # partial states, one slot per chunk; unused slots are empty parts (lse -inf), which the
    # merge leaves out, and a sequence without any chunk merges to (0, -inf)
    count = max(int(parts.max(initial=0)), 1)
    outs = np.zeros((count, bsz, hq, lq, dv), dtype=acc)
    lses = np.full((count, bsz, hq, lq), -np.inf, dtype=acc)

    def pages_of(b: int, key0: int, key1: int) -> np.ndarray:
        return table[b, key0 // page_size: -(-key1 // page_size)].astype(np.intp)

    group = max(1, group_keys // max(chunk, 1))
    for g0 in range(0, len(whole), group):
        tasks = whole[g0:g0 + group]
        seqs = [t[0] for t in tasks]
        kc = np.empty((len(tasks), hk, chunk, kpool.shape[3]), dtype=acc)
        vc = np.empty((len(tasks), hk, chunk, dv), dtype=acc)
        for i, (b, _, key0, key1) in enumerate(tasks):
            _gather_into(kc[i], kpool, pages_of(b, key0, key1))
            _gather_into(vc[i], vpool, pages_of(b, key0, key1))
        # no band applies, so the queries of a group of heads are rows of one key head's
        # problem ([Hq, Lq] -> [Hk, G * Lq], a view): each key tile serves all of them
        rows = (len(tasks), hk, hq // hk * lq)
        o = np.empty(rows + (dv,), dtype=acc)
        s = np.empty(rows, dtype=acc)
        qg = np.ascontiguousarray(qn[seqs]).reshape(rows + (qn.shape[3],))
        forward_into(readable(qg), kc, vc, o, s, scale, 0, False, -1, -1, softcap)
        slots = [t[1] for t in tasks]
        outs[slots, seqs] = o.reshape(len(tasks), hq, lq, dv)
        lses[slots, seqs] = s.reshape(len(tasks), hq, lq)
    for b, slot, key0, key1 in cut:
        kc = np.empty((1, hk, key1 - key0, kpool.shape[3]), dtype=acc)
        vc = np.empty((1, hk, key1 - key0, dv), dtype=acc)
        _gather_into(kc[0], kpool, pages_of(b, key0, key1))
        _gather_into(vc[0], vpool, pages_of(b, key0, key1))
        forward_into(qn[b:b + 1], kc, vc, outs[slot, b:b + 1],
                     lses[slot, b:b + 1], scale, int(lens[b]) - lq - key0, is_causal, left,
                     right, softcap)
    if count == 1:
        out_acc, lse_acc = outs[0], lses[0]
    else:
        n_rows = bsz * hq * lq
        out_acc, lse_acc = merge_attention(npx, outs=outs.reshape(count, n_rows, dv),
                                           lses=lses.reshape(count, n_rows))
    result = Output((bsz, hq, lq, dv), q.dtype, q, acc)
    lse, lse_s = empty((bsz, hq, lq), accumulator_dtype(xp, q.dtype), q)
    result.storage[...] = out_acc.reshape(bsz, hq, lq, dv)
    lse_s[...] = lse_acc.reshape(bsz, hq, lq)
    return result.finish(), (lse if return_lse else None)
