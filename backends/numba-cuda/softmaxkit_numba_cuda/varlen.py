"""Packed variable-length attention in float32 and float64 (``varlen_attention``,
``varlen_attention_vjp``, contract: softmaxkit.ops) on the exact attention kernels of
:mod:`.attention`.

The sequences with queries and keys are unpacked into padded dense batches
``[B_j, H, L_j, D]``, one for the sequences whose longer side falls in each power-of-two
range of lengths (all those up to 64 together: the kernels' tiles), so that one long
sequence does not pad many short ones to its length.  Slots past a sequence's length are
set to 0 (they read some other token, and a NaN there times a probability of 0 would still
be NaN), and the sequences' lengths, causal alignment and window become a boolean mask
``[B_j, 1, Lq_j, Lk_j]`` broadcast over the query heads: query ``i`` of sequence ``b`` sits on
its key ``i + Lk_b - Lq_b`` (``i`` under ``"top_left"``) and sees none of the padding, so the
dense kernel computes what the spec defines ("Packed variable-length attention").  Where the
band is the same for every sequence of a batch (top-left alignment, or one ``Lk_b - Lq_b``
for all, as in self-attention) it is also passed to the kernel, which then skips the key
tiles outside it; a batch of sequences of equal lengths needs no mask at all.  The results
of every batch are packed back along the tokens with one gather.

The other sequences' results are fixed by the spec and never computed: rows of a sequence
without keys get out 0 and lse -inf, keys of a sequence without queries a zero gradient,
whatever their values.  The gather indices are built on the host from the cumulative
lengths (one device-to-host copy of ``B + 1`` integers each, which the contract allows) and
expanded over the heads on the device.

Costs: the padded copies of the operands (and of out, dout and lse for the gradient), the
masks' ``B_j * Lq_j * Lk_j`` bytes, and the work on padded rows and keys (up to about four
times a sequence's own where its lengths fall just past a power of two; a causal mask whose
band differs between the sequences of a batch is evaluated on every tile).  The 16-bit varlen
kernels of the cupy backend read the packed arrays in place.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from array_api_compat import device as device_of

from softmaxkit.dtypes import accumulator_name, dtype_name, lookup
from softmaxkit.metadata import host_integers

from . import attention_kernels as kernels
from .attention import attention, attention_vjp

SMALLEST_BATCH_LENGTH = 64
"""Sequences whose longer side is at most this long share one batch: the kernels' tiles are
64 rows or keys at most, so padding within it costs no tile."""


class _Side:
    """The queries (or keys) of the sequences ``members`` in one padded batch.

    ``lengths`` [B_j] and ``longest`` (``L_j``); ``valid`` [B_j, L_j]: the slots holding a
    token; ``tokens`` [B_j, L_j]: the token each slot reads (token 0, any valid row, past the
    length, where the value is then replaced).  All numpy, on the host.
    """

    def __init__(self, bounds: np.ndarray, members: np.ndarray) -> None:
        self.lengths = np.diff(bounds)[members]
        self.longest = int(self.lengths.max())
        slots = np.arange(self.longest, dtype=np.int64)
        self.valid = slots[None, :] < self.lengths[:, None]
        self.tokens = np.where(self.valid, bounds[members][:, None] + slots[None, :], 0)

    def unpack(self, xp: Any, a: Any, fill: float) -> Any:
        """Packed ``a`` [T, H, ...] as a contiguous padded [B_j, H, L_j, ...], ``fill`` in the
        slots past each sequence's length (none when every sequence fills them)."""
        dev = device_of(a)
        t, h, *tail = (int(s) for s in a.shape)
        b = len(self.lengths)
        tokens = xp.asarray(self.tokens, device=dev)
        heads = xp.arange(h, dtype=xp.int64, device=dev)
        # row (b, h, i) of the padded batch is row tokens[b, i] * H + h of a as [T * H, ...]
        rows = xp.reshape(tokens[:, None, :] * h + heads[None, :, None], (-1,))
        dense = xp.take(xp.reshape(a, (t * h, *tail)), rows, axis=0)
        dense = xp.reshape(dense, (b, h, self.longest, *tail))
        if self.valid.all():
            return dense
        valid = xp.reshape(xp.asarray(self.valid, device=dev),
                           (b, 1, self.longest) + (1,) * len(tail))
        return xp.where(valid, dense, xp.full((), fill, dtype=a.dtype, device=dev))


class _Batch:
    """The sequences ``members`` as one padded batch, and how its kernel sees their bands."""

    def __init__(self, bounds_q: np.ndarray, bounds_k: np.ndarray, members: np.ndarray,
                 causal: Any, window: tuple[int, int]) -> None:
        self.queries = _Side(bounds_q, members)
        self.keys = _Side(bounds_k, members)
        lq, lk = self.queries.lengths, self.keys.lengths
        self.equal = bool(np.all(lq == lq[0]) and np.all(lk == lk[0]))
        # every sequence's diagonal is the padded batch's when they share Lk - Lq (then the
        # longest has both the longest queries and the longest keys) or sit top-left
        self.shared_band = causal == "top_left" or bool(np.all(lk - lq == lk[0] - lq[0]))
        self.causal, self.window = causal, window

    def options(self, xp: Any, hq: int, dev: Any) -> dict[str, Any]:
        """The dense kernel's ``causal``, ``window`` and ``mask`` for this batch."""
        if self.equal:  # nothing padded: the kernel's own band is every sequence's
            return {"causal": self.causal, "window": self.window, "mask": None}
        mask = self.mask(xp, hq, dev)
        if self.shared_band:  # also the band, so that the kernel skips tiles outside it
            return {"causal": self.causal, "window": self.window, "mask": mask}
        return {"causal": None, "window": (-1, -1), "mask": mask}

    def mask(self, xp: Any, hq: int, dev: Any) -> Any:
        """The keys each padded query row may see, as a boolean [B_j, Hq, Lq_j, Lk_j] (a
        broadcast view over the heads): inside its sequence's keys and its causal and window
        band aligned with the sequence's own lengths; nothing for the padding rows."""
        queries, keys = self.queries, self.keys
        lq, lk = queries.lengths[:, None], keys.lengths[:, None]
        rows = np.arange(queries.longest, dtype=np.int64)[None, :]
        diagonal = rows + (0 if self.causal == "top_left" else lk - lq)  # [B_j, Lq_j]
        lo, hi = kernels.band_limits(self.causal, self.window)
        # a row's allowed keys are one interval [first, last] (empty when last < first)
        first = np.maximum(diagonal + lo, 0)
        last = np.where(queries.valid, np.minimum(diagonal + hi, lk - 1), -1)
        first_d, last_d = (xp.asarray(a, device=dev)[..., None] for a in (first, last))
        cols = xp.arange(keys.longest, dtype=xp.int64, device=dev)
        allowed = (cols >= first_d) & (cols <= last_d)  # [B_j, Lq_j, Lk_j]
        return xp.broadcast_to(allowed[:, None],
                               (len(lq), hq, queries.longest, keys.longest))


class _Packing:
    """Where each packed token of one side finds its result in the batches' outputs, laid
    end to end as one [sum_j B_j * H * L_j, ...] array: row ``H * first + position + h *
    stride`` for head ``h``.  ``kept`` [T]: the tokens of sequences in a batch (the others
    read row 0 and are then replaced).  All numpy, on the host."""

    def __init__(self, bounds: np.ndarray, sides: list[_Side],
                 members: list[np.ndarray]) -> None:
        lengths = np.diff(bounds)
        n = len(lengths)
        first, stride = np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64)
        kept = np.zeros(n, dtype=bool)
        before = 0  # the rows of the earlier batches, in units of H rows
        for side, seqs in zip(sides, members, strict=True):
            first[seqs] = before + np.arange(len(seqs)) * side.longest
            stride[seqs] = side.longest
            kept[seqs] = True
            before += len(seqs) * side.longest
        sequence = np.repeat(np.arange(n, dtype=np.int64), lengths)
        self.kept = kept[sequence]
        self.first = np.where(self.kept, first[sequence], 0)
        self.stride = stride[sequence]
        self.position = np.where(self.kept,
                                 np.arange(len(sequence)) - bounds[:-1][sequence], 0)

    def pack(self, xp: Any, parts: list[Any], fill: float) -> Any:
        """The padded outputs ``parts`` [B_j, H, L_j, ...] of the batches as packed
        [T, H, ...] (the padding dropped), ``fill`` for the tokens of no batch."""
        a = parts[0]
        dev = device_of(a)
        h, tail = int(a.shape[1]), tuple(int(s) for s in a.shape[3:])
        flat = [xp.reshape(p, (-1, *tail)) for p in parts]
        flat = flat[0] if len(flat) == 1 else xp.concat(flat, axis=0)
        t = len(self.kept)
        first = xp.asarray(h * self.first + self.position, device=dev)
        stride = xp.asarray(self.stride, device=dev)
        heads = xp.arange(h, dtype=xp.int64, device=dev)
        rows = xp.reshape(first[:, None] + heads[None, :] * stride[:, None], (-1,))
        packed = xp.reshape(xp.take(flat, rows, axis=0), (t, h, *tail))
        if self.kept.all():
            return packed
        kept = xp.reshape(xp.asarray(self.kept, device=dev), (t,) + (1,) * (1 + len(tail)))
        return xp.where(kept, packed, xp.full((), fill, dtype=a.dtype, device=dev))


class _Layout:
    """The padded batches of a call and the packing of their results, or ``batches == []``
    when no sequence has both queries and keys (every result is then fixed by the spec)."""

    def __init__(self, cu_q: Any, cu_k: Any, causal: Any, window: tuple[int, int]) -> None:
        reader = "numba-cuda's varlen_attention builds its gather indices from them"
        bounds_q = host_integers(cu_q, "cu_seqlens_q", reader)
        bounds_k = host_integers(cu_k, "cu_seqlens_k", reader)
        lq, lk = np.diff(bounds_q), np.diff(bounds_k)
        live = (lq > 0) & (lk > 0)
        # the batch of each sequence: the power-of-two range of its longer side
        edges = SMALLEST_BATCH_LENGTH << np.arange(48, dtype=np.int64)
        batch = np.searchsorted(edges, np.maximum(lq, lk))
        members = [np.flatnonzero(live & (batch == j)) for j in np.unique(batch[live])]
        window = (int(window[0]), int(window[1]))
        self.batches = [_Batch(bounds_q, bounds_k, m, causal, window) for m in members]
        if self.batches:
            self.queries = _Packing(bounds_q, [b.queries for b in self.batches], members)
            self.keys = _Packing(bounds_k, [b.keys for b in self.batches], members)


def varlen_attention(*, xp: Any, q: Any, k: Any, v: Any, cu_seqlens_q: Any,
                     cu_seqlens_k: Any, scale: float, causal: Any, window: tuple[int, int],
                     softcap: Any, return_lse: bool) -> tuple[Any, Any]:
    """Attention of each packed sequence of ``q`` [Tq, Hq, D] with its own keys of ``k``
    [Tk, Hk, D] and ``v`` [Tk, Hk, Dv]; ``(out [Tq, Hq, Dv], lse [Tq, Hq] or None)``.

    The frontend has validated the cumulative lengths.  A query row with no allowed key gets
    out 0 and lse -inf: all the rows of a sequence without keys, which never enter a batch.
    A call where no sequence has both queries and keys launches nothing.
    """
    dev = device_of(q)
    hq = int(q.shape[1])
    layout = _Layout(cu_seqlens_q, cu_seqlens_k, causal, window)
    if not layout.batches:  # no row sees a key: out 0, lse -inf (spec)
        acc = lookup(xp, accumulator_name(dtype_name(q.dtype)))
        out = xp.zeros((int(q.shape[0]), hq, int(v.shape[2])), dtype=q.dtype, device=dev)
        lse = xp.full((int(q.shape[0]), hq), -math.inf, dtype=acc, device=dev)
        return out, (lse if return_lse else None)
    outs, lses = [], []
    for batch in layout.batches:
        queries, keys = batch.queries, batch.keys
        out, lse = attention(
            xp=xp, q=queries.unpack(xp, q, 0.0), k=keys.unpack(xp, k, 0.0),
            v=keys.unpack(xp, v, 0.0), scale=scale, softcap=softcap, return_lse=return_lse,
            **batch.options(xp, hq, dev))
        outs.append(out)
        lses.append(lse)
    out = layout.queries.pack(xp, outs, 0.0)
    return out, (layout.queries.pack(xp, lses, -math.inf) if return_lse else None)


def varlen_attention_vjp(*, xp: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
                         cu_seqlens_q: Any, cu_seqlens_k: Any, scale: float, causal: Any,
                         window: tuple[int, int], softcap: Any,
                         dlse: Any = None) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of :func:`varlen_attention`, shaped and typed like q, k, v (the
    lse's cotangent ``dlse``, where given, gathered into each batch as lse is).

    The padding rows enter the dense gradient with lse = -inf (rows with no allowed key: P
    is 0 there) and zero q, out and dout, the padding keys as zero k and v that no row may
    see, so they add exactly 0 to the gradients of the sequences' own rows and keys.  The
    sequences without queries or without keys never enter a batch: their gradients are 0,
    whatever their values.
    """
    dev = device_of(q)
    layout = _Layout(cu_seqlens_q, cu_seqlens_k, causal, window)
    if not layout.batches:  # no query reads a key: every gradient is 0
        return tuple(xp.zeros(tuple(a.shape), dtype=a.dtype, device=dev) for a in (q, k, v))
    grads: list[list[Any]] = [[], [], []]
    for batch in layout.batches:
        queries, keys = batch.queries, batch.keys
        parts = attention_vjp(
            xp=xp, q=queries.unpack(xp, q, 0.0), k=keys.unpack(xp, k, 0.0),
            v=keys.unpack(xp, v, 0.0), out=queries.unpack(xp, out, 0.0),
            lse=queries.unpack(xp, lse, -math.inf), dout=queries.unpack(xp, dout, 0.0),
            dlse=None if dlse is None else queries.unpack(xp, dlse, 0.0),
            scale=scale, softcap=softcap, **batch.options(xp, int(q.shape[1]), dev))
        for g, part in zip(grads, parts, strict=True):
            g.append(part)
    dq, dk, dv = grads
    return (layout.queries.pack(xp, dq, 0.0), layout.keys.pack(xp, dk, 0.0),
            layout.keys.pack(xp, dv, 0.0))
