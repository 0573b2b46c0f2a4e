"""Reference attention kernels: tiled forward, backward by recomputation, merges of partials.

The forward walks the keys in tiles of :data:`BLOCK` and folds each tile into a running
summary (max, mass, numerator) with :func:`~softmaxkit.reference.summary.merge_pair`, so at
most one ``[Lq, block]`` tile of scores exists at a time for each (batch, head): memory grows
with ``Lq * block``, never ``Lq * Lk``.  The backward recomputes each tile's probabilities from
the saved log-sum-exp, as FlashAttention's does, and stores no probability matrix.  Layouts
and conventions are those of :data:`softmaxkit.ops.OPERATIONS`; semantics are those of
spec/semantics.md, "Attention".
"""

from __future__ import annotations

from typing import Any

from ..dtypes import accumulator_dtype
from .summary import NEG_INF, merge_pair, rescale

BLOCK = 128
"""Keys per tile of the reference forward and backward."""


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)


def _groups(xp: Any, q: Any, k: Any) -> tuple[Any, int]:
    """``q`` [B, Hq, Lq, D] viewed as [B, Hk, G, Lq, D] so each group shares one k/v head."""
    b, hq, lq, d = q.shape
    hk = k.shape[1]
    return xp.reshape(q, (b, hk, hq // hk, lq, d)), hq // hk


def _operands(xp: Any, q: Any, k: Any, v: Any) -> tuple[Any, Any, int, Any, Any]:
    """``(acc, q5, g, ka, va)``: the accumulator dtype, ``q`` in it grouped by :func:`_groups`,
    and ``k``, ``v`` in it with an axis for the group ([B, Hk, 1, Lk, D])."""
    acc = accumulator_dtype(xp, q.dtype)
    q5, g = _groups(xp, xp.astype(q, acc, copy=False), k)
    ka = xp.astype(k, acc, copy=False)[:, :, None, ...]
    va = xp.astype(v, acc, copy=False)[:, :, None, ...]
    return acc, q5, g, ka, va


def in_bands(ok: Any, diag: Any, j: Any, causal: Any, window: tuple[int, int]) -> Any:
    """``ok`` where key ``j`` also lies in the causal and window bands of the query whose
    diagonal key is ``diag``: causal keeps ``j <= diag``, the window ``(left, right)`` keeps
    ``diag - left <= j <= diag + right`` (a negative bound is unbounded)."""
    if causal is not None:
        ok = ok & (j <= diag)
    left, right = window
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def allowed_positions(
    xp: Any, lq: int, lk: int, start: int, stop: int, causal: Any, window: Any, device: Any
) -> Any:
    """The [Lq, stop - start] boolean of keys ``start:stop`` allowed by causal and window.

    Query ``i`` sits on the diagonal ``d = i + Lk - Lq`` (bottom-right alignment) or ``d = i``
    (top-left, only when ``causal == "top_left"``), and its bands are those of
    :func:`in_bands`.  Returns None when nothing is excluded.
    """
    left, right = window
    if causal is None and left < 0 and right < 0:
        return None
    offset = 0 if causal == "top_left" else lk - lq
    i = xp.reshape(xp.arange(lq, device=device), (lq, 1)) + offset
    j = xp.reshape(xp.arange(start, stop, device=device), (1, stop - start))
    return in_bands(xp.ones((lq, stop - start), dtype=xp.bool, device=device), i, j, causal,
                    window)


def _tile_allowed(
    xp: Any, mask: Any, shape5: tuple[int, ...], lq: int, lk: int, start: int, stop: int,
    causal: Any, window: Any, device: Any,
) -> Any:
    """Allowed entries of one score tile, broadcastable to [B, Hk, G, Lq, block], or None."""
    ok = allowed_positions(xp, lq, lk, start, stop, causal, window, device)
    if mask is not None:
        b, hk, g = shape5[:3]
        tile = xp.reshape(mask[..., start:stop], (b, hk, g, lq, stop - start))
        ok = tile if ok is None else tile & ok
    return ok


def _scores(
    xp: Any, q5: Any, k_tile: Any, scale: float, softcap: Any
) -> tuple[Any, Any]:
    """Scores of one tile, and ``tanh(s / softcap)`` (None without softcap) for the backward."""
    s = (q5 @ xp.matrix_transpose(k_tile)) * scale
    if softcap is None:
        return s, None
    t = xp.tanh(s / softcap)
    return softcap * t, t


def attention(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    mask: Any,
    softcap: Any,
    return_lse: bool,
    block: int = BLOCK,
) -> tuple[Any, Any]:
    """Exact attention by online softmax over key tiles; out 0 and lse -inf for empty rows."""
    dev = _device(q)
    b, hq, lq, _ = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    acc, q5, g, ka, va = _operands(xp, q, k, v)
    shape5 = (b, hk, g, lq)
    m = xp.full(shape5, NEG_INF, dtype=acc, device=dev)
    mass = xp.zeros(shape5, dtype=acc, device=dev)
    num = xp.zeros(shape5 + (dv,), dtype=acc, device=dev)
    for start in range(0, lk, block):
        stop = min(start + block, lk)
        s, _ = _scores(xp, q5, ka[..., start:stop, :], scale, softcap)
        ok = _tile_allowed(xp, mask, shape5, lq, lk, start, stop, causal, window, dev)
        if ok is not None:
            s = xp.where(ok, s, NEG_INF)
        # the tile's own summary, then one exact merge into the running one
        m_t = xp.max(s, axis=-1)
        shift = xp.where(xp.isfinite(m_t), m_t, 0.0)
        p = xp.exp(s - shift[..., None])
        del s
        l_t = xp.sum(p, axis=-1)
        n_t = p @ va[..., start:stop, :]
        del p
        m, mass, num = merge_pair(xp, m, mass, num, m_t, l_t, n_t)
    empty = mass == 0
    safe = xp.where(empty, 1.0, mass)
    out = xp.where(empty[..., None], 0.0, num / safe[..., None])
    out = xp.astype(xp.reshape(out, (b, hq, lq, dv)), q.dtype)
    if not return_lse:
        return out, None
    lse = xp.where(empty, NEG_INF, m + xp.log(safe))
    return out, xp.reshape(lse, (b, hq, lq))


def attention_vjp(
    xp: Any,
    *,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    scale: float,
    causal: Any,
    window: tuple[int, int],
    mask: Any,
    softcap: Any,
    dlse: Any = None,
    block: int = BLOCK,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) by recomputing each tile's probabilities from ``lse``.

    With ``P = exp(S - lse)`` and ``D = rowsum(dout * out) - dlse``: ``dV = P^T dout``,
    ``dS = P * (dout V^T - D)`` (times ``1 - tanh^2`` under softcap), ``dQ = scale dS K`` and
    ``dK = scale dS^T Q``; ``dlse``, the lse's own cotangent (None: 0), enters through ``D``
    alone since ``d lse / d S = P``.  Rows with ``lse = -inf`` have ``P = 0`` and so zero
    gradient.
    """
    dev = _device(q)
    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    acc, q5, g, ka, va = _operands(xp, q, k, v)
    do5 = xp.reshape(xp.astype(dout, acc, copy=False), (b, hk, g, lq, dv))
    o5 = xp.reshape(xp.astype(out, acc, copy=False), (b, hk, g, lq, dv))
    lse5 = xp.reshape(xp.astype(lse, acc, copy=False), (b, hk, g, lq))
    row_ok = lse5 != NEG_INF
    lse_safe = xp.where(row_ok, lse5, 0.0)[..., None]
    delta = xp.sum(xp.where(row_ok[..., None], do5 * o5, 0.0), axis=-1)[..., None]
    if dlse is not None:  # 0 on the rows with no key (contract: softmaxkit.ops)
        delta = delta - xp.reshape(xp.astype(dlse, acc, copy=False), (b, hk, g, lq, 1))
    shape5 = (b, hk, g, lq)
    dq = xp.zeros(shape5 + (d,), dtype=acc, device=dev)
    dk_tiles, dv_tiles = [], []
    for start in range(0, lk, block):
        stop = min(start + block, lk)
        k_t, v_t = ka[..., start:stop, :], va[..., start:stop, :]
        s, t = _scores(xp, q5, k_t, scale, softcap)
        ok = _tile_allowed(xp, mask, shape5, lq, lk, start, stop, causal, window, dev)
        ok = row_ok[..., None] if ok is None else ok & row_ok[..., None]
        p = xp.exp(xp.where(ok, s - lse_safe, NEG_INF))
        del s
        dv_tiles.append(xp.sum(xp.matrix_transpose(p) @ do5, axis=2))
        ds = p * (do5 @ xp.matrix_transpose(v_t) - delta)
        del p
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds = ds * scale
        dq = dq + ds @ k_t
        dk_tiles.append(xp.sum(xp.matrix_transpose(ds) @ q5, axis=2))
    if lk:
        dk = xp.concat(dk_tiles, axis=2)
        dvv = xp.concat(dv_tiles, axis=2)
    else:
        dk = xp.zeros((b, hk, 0, d), dtype=acc, device=dev)
        dvv = xp.zeros((b, hk, 0, dv), dtype=acc, device=dev)
    dq = xp.reshape(dq, (b, hq, lq, d))
    return xp.astype(dq, q.dtype), xp.astype(dk, k.dtype), xp.astype(dvv, v.dtype)


def _weights(xp: Any, lses: Any) -> tuple[Any, Any, Any]:
    """Normalized weights ``exp(lse_s - lse)`` [S, R], the merged lse [R] and its emptiness."""
    m = xp.max(lses, axis=0)
    present = lses != NEG_INF
    w = xp.where(present, rescale(xp, lses, m[None, ...]), 0.0)
    total = xp.sum(w, axis=0)
    empty = total == 0
    safe = xp.where(empty, 1.0, total)
    lse = xp.where(empty, NEG_INF, m + xp.log(safe))
    # rescale() gives NaN maxima weight 0; a NaN part makes the whole merged row NaN.
    nan = xp.any(xp.isnan(lses), axis=0)
    lse = xp.where(nan, xp.nan, lse)
    return xp.where(nan[None, ...], xp.nan, w / safe[None, ...]), lse, empty


def merge_attention(xp: Any, *, outs: Any, lses: Any) -> tuple[Any, Any]:
    """Merge partial attention states: ``out = sum_s exp(lse_s - lse) out_s``, ``lse = LSE``.

    Each part is the summary ``(max = lse_s, mass = 1, numerator = out_s)`` (or the empty
    summary when ``lse_s = -inf``), so this is :func:`~softmaxkit.reference.summary.merge`
    followed by the normalization.
    """
    a, lse, _ = _weights(xp, lses)
    out = xp.sum(a[..., None] * _present_outs(xp, outs, lses), axis=0)
    return xp.astype(out, outs.dtype), lse


def _present_outs(xp: Any, outs: Any, lses: Any) -> Any:
    """``outs`` in the accumulator dtype, 0 for empty parts (whatever a peer wrote there)."""
    return xp.where((lses != NEG_INF)[..., None], xp.astype(outs, lses.dtype), 0.0)


def merge_attention_vjp(
    xp: Any, *, outs: Any, lses: Any, dout: Any, dlse: Any
) -> tuple[Any, Any]:
    """Gradient of :func:`merge_attention`: with ``a_s = exp(lse_s - lse)``,
    ``d out_s = a_s dout`` and ``d lse_s = a_s (<dout, out_s - out> + dlse)``; 0 for empty parts.
    """
    acc = lses.dtype
    a, _, _ = _weights(xp, lses)
    oa = _present_outs(xp, outs, lses)
    do = xp.astype(dout, acc, copy=False)
    out = xp.sum(a[..., None] * oa, axis=0)
    diff = xp.where((lses != NEG_INF)[..., None], oa - out[None, ...], 0.0)
    dl = xp.sum(do[None, ...] * diff, axis=-1)
    if dlse is not None:
        dl = dl + xp.astype(dlse, acc, copy=False)[None, ...]
    douts = a[..., None] * do[None, ...]
    return xp.astype(douts, outs.dtype), a * dl
