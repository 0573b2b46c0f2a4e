"""Sequence-sharded attention over Dask arrays: keys in chunks, partials merged in a tree.

``q`` is chunked along its length and ``k``, ``v`` along theirs.  Every pair (query chunk,
key chunk) that the causal and window geometry leaves non-empty becomes one task: the
``attention`` kernel of the chunks' backend with ``return_lse=True``, the causal and window
limits turned into an explicit mask in absolute positions.  The partial ``(out, lse)`` pairs of
a query chunk merge in a tree through the chunks' ``merge_attention`` kernel (the exact
rescaling merge); query chunks run in parallel.  Pairs that the geometry empties are never
computed, and a query chunk without any key gives output 0 and lse ``-inf``.
"""

from __future__ import annotations

import math
from functools import partial
from itertools import accumulate
from typing import Any

import array_api_compat
import dask
import dask.array as da
from dask.array.utils import meta_from_array

from ..dispatch import run
from ..dtypes import accumulator_dtype

SPLIT_EVERY = 8
INF = math.inf


def _starts(chunks: tuple[int, ...]) -> list[int]:
    return [0, *accumulate(chunks)][:-1]


def _bounds(causal: Any, window: tuple[int, int], lq: int, lk: int) -> tuple[int, float, float]:
    """``(shift, below, above)``: query ``i`` sees keys ``i + shift - below`` to
    ``i + shift + above``."""
    shift = lk - lq if causal != "top_left" else 0
    left, right = window
    below = INF if left < 0 else float(left)
    above = INF if right < 0 else float(right)
    if causal is not None:
        above = min(above, 0.0)
    return shift, below, above


def _coverage(q0: int, nq: int, k0: int, nk: int, bounds: tuple[int, float, float]) -> str:
    """``"none"``, ``"all"`` or ``"some"``: which pairs of the block the geometry allows."""
    shift, below, above = bounds
    q1, k1 = q0 + nq - 1, k0 + nk - 1
    first = max(q0, k0 - above - shift)  # the first query whose upper limit reaches k0
    last = min(q1, k1 + below - shift)  # the last query whose lower limit is within the block
    if nq == 0 or nk == 0 or first > last or below + above < 0:
        return "none"
    if q1 + shift - below <= k0 and q0 + shift + above >= k1:
        return "all"
    return "some"


def _partial_block(
    q: Any, k: Any, v: Any, m: Any, *, q0: int, k0: int, bounds: tuple[int, float, float],
    cover: str, scale: float, softcap: Any, acc: Any,
) -> Any:
    """One partial ``[B, Hq, lq, Dv + 1]``: the output in ``acc`` and the lse as last column."""
    xp = array_api_compat.array_namespace(q)
    mask = m
    if cover == "some":
        shift, below, above = bounds
        rows = xp.arange(q0, q0 + q.shape[2])[:, None] + shift
        cols = xp.arange(k0, k0 + k.shape[2])[None, :]
        geometry = (cols >= rows - below) & (cols <= rows + above)
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        geometry = xp.broadcast_to(geometry, full)
        mask = geometry if m is None else (m & geometry)
    out, lse = run(
        "attention", xp, q, None, q=q, k=k, v=v, scale=scale, causal=None, window=(-1, -1),
        mask=mask, softcap=softcap, return_lse=True,
    )
    return xp.concat([xp.astype(out, acc), xp.astype(lse, acc)[..., None]], axis=-1)


def _empty_block(shape: tuple[int, ...], acc: Any, like: Any) -> Any:
    """The partial of a query chunk that no key reaches: output 0, lse -inf."""
    xp = array_api_compat.array_namespace(like)
    out = xp.zeros(shape[:-1] + (shape[-1] - 1,), dtype=acc)
    lse = xp.full(shape[:-1] + (1,), -INF, dtype=acc)
    return xp.concat([out, lse], axis=-1)


def _merge(block: Any, axis: tuple[int, ...], keepdims: bool, width: int) -> Any:
    """Combine step of the tree: ``K`` partials ``[..., K * width]`` into one ``[..., width]``."""
    xp = array_api_compat.array_namespace(block)
    lead = tuple(block.shape[:-1])
    k = block.shape[-1] // width
    parts = xp.reshape(block, lead + (k, width))
    rows = math.prod(lead)
    outs = xp.permute_dims(xp.reshape(parts[..., :-1], (rows, k, width - 1)), (1, 0, 2))
    lses = xp.permute_dims(xp.reshape(parts[..., -1], (rows, k)), (1, 0))
    out, lse = run("merge_attention", xp, outs, None, outs=outs, lses=lses)
    merged = xp.concat([xp.astype(out, block.dtype), xp.astype(lse, block.dtype)[:, None]],
                       axis=-1)
    return xp.reshape(merged, lead + (width,))


def _keep(block: Any, axis: tuple[int, ...], keepdims: bool) -> Any:
    return block


def attention(
    xp: Any, *, q: Any, k: Any, v: Any, scale: float, causal: Any, window: tuple[int, int],
    mask: Any, softcap: Any, return_lse: bool,
) -> tuple[Any, Any]:
    """Attention of ``q [B, Hq, Lq, D]`` over ``k``, ``v`` chunked along their lengths."""
    single = {0: -1, 1: -1, 3: -1}
    q, k = q.rechunk(single), k.rechunk(single)
    v = v.rechunk({0: -1, 1: -1, 2: k.chunks[2], 3: -1})
    qc, kc = q.chunks[2], k.chunks[2]
    if mask is not None:
        mask = mask.rechunk((-1, -1, qc, kc))
    b, hq, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[3]
    chunk_xp = array_api_compat.array_namespace(q._meta)
    acc = chunk_xp.empty((0,), dtype=accumulator_dtype(chunk_xp, q.dtype)).dtype
    bounds = _bounds(causal, window, lq, lk)
    width = dv + 1
    qd, kd, vd = q.to_delayed(), k.to_delayed(), v.to_delayed()
    md = mask.to_delayed() if mask is not None else None
    meta = meta_from_array(q._meta, ndim=4, dtype=acc)
    rows = []
    for i, (q0, nq) in enumerate(zip(_starts(qc), qc, strict=True)):
        shape = (b, hq, nq, width)
        parts = []
        for j, (k0, nk) in enumerate(zip(_starts(kc), kc, strict=True)):
            cover = _coverage(q0, nq, k0, nk, bounds)
            if cover == "none":
                continue
            task = dask.delayed(partial(
                _partial_block, q0=q0, k0=k0, bounds=bounds, cover=cover, scale=scale,
                softcap=softcap, acc=acc,
            ), pure=True)(qd[0, 0, i, 0], kd[0, 0, j, 0], vd[0, 0, j, 0],
                          None if md is None else md[0, 0, i, j])
            parts.append(da.from_delayed(task, shape, dtype=acc, meta=meta))
        if not parts:
            task = dask.delayed(_empty_block, pure=True)(shape, acc, q._meta)
            rows.append(da.from_delayed(task, shape, dtype=acc, meta=meta))
            continue
        row = da.concatenate(parts, axis=3)
        rows.append(da.reduction(
            row, _keep, partial(_merge, width=width), axis=3, keepdims=True, dtype=acc,
            split_every={3: SPLIT_EVERY}, output_size=width, concatenate=True, meta=meta,
            combine=partial(_merge, width=width), name="softmaxkit-merge-attention",
        ))
    merged = da.concatenate(rows, axis=2)
    out = merged[..., :dv].astype(q.dtype)
    lse = merged[..., dv] if return_lse else None
    return out, lse
