"""Packed variable-length attention in float32 and float64 (``varlen_attention``,
``varlen_attention_vjp``, contract: softmaxkit.ops) on the exact attention kernels of
:mod:`.attention`.

The sequences with queries and keys are unpacked into a padded dense batch
``[B', H, Lmax, D]`` (slots past a sequence's length set to 0: they read some other token,
and a NaN there times a probability of 0 would still be NaN), and their lengths, causal
alignment and window become a boolean mask ``[B', 1, Lq_max, Lk_max]`` broadcast over the
query heads: query ``i`` of sequence ``b`` sits on its key ``i + Lk_b - Lq_b`` (``i`` under
``"top_left"``) and sees none of the padding, so the dense kernel computes what the spec
defines ("Packed variable-length attention").  The results are packed back along the tokens.
The other sequences' results are fixed by the spec and never computed: rows of a sequence
without keys get out 0 and lse -inf, keys of a sequence without queries a zero gradient,
whatever their values.  The gather indices are built on the host from the cumulative lengths
(one device-to-host copy of ``B + 1`` integers each, which the contract allows) and expanded
over the heads on the device.

Costs: the padded copies of the operands (and of out, dout and lse for the gradient), the
mask's ``B' * Lq_max * Lk_max`` bytes, and the work on padded rows and keys, which grows with
the spread of the lengths: one long sequence among many short ones costs as much as a batch
of long ones.  The 16-bit varlen kernels of the cupy backend read the packed arrays in place.
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


class _Padding:
    """Where the packed tokens of one side (queries or keys) sit in the padded batch of the
    sequences ``live`` [B] (those with queries and keys: the others' results are fixed).

    ``lengths`` [B'] of the live sequences and ``longest`` (``Lmax``); ``valid`` [B', Lmax]:
    the slots holding a token; ``tokens`` [B', Lmax]: the token each slot reads (token 0, any
    valid row, past the length, where the value is then replaced); ``kept`` [T]: the tokens
    of live sequences, and ``batch``, ``position`` [T]: their sequence in the batch and their
    index in it (0 for the others).  All numpy, on the host.
    """

    def __init__(self, bounds: np.ndarray, live: np.ndarray) -> None:
        lengths = np.diff(bounds)
        starts = bounds[:-1]
        self.lengths = lengths[live]
        self.longest = int(self.lengths.max(initial=0))
        slots = np.arange(self.longest, dtype=np.int64)
        self.valid = slots[None, :] < self.lengths[:, None]
        self.tokens = np.where(self.valid, starts[live][:, None] + slots[None, :], 0)
        sequence = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        self.kept = live[sequence]
        batch = np.cumsum(live) - 1  # a live sequence's index in the batch
        self.batch = np.where(self.kept, batch[sequence], 0)
        self.position = np.where(self.kept, np.arange(len(sequence)) - starts[sequence], 0)

    def unpack(self, xp: Any, a: Any, fill: float) -> Any:
        """Packed ``a`` [T, H, ...] as a contiguous padded [B', H, Lmax, ...], ``fill`` in the
        slots past each sequence's length."""
        dev = device_of(a)
        t, h, *tail = (int(s) for s in a.shape)
        b = len(self.lengths)
        tokens = xp.asarray(self.tokens, device=dev)
        heads = xp.arange(h, dtype=xp.int64, device=dev)
        # row (b, h, i) of the padded batch is row tokens[b, i] * H + h of a as [T * H, ...]
        rows = xp.reshape(tokens[:, None, :] * h + heads[None, :, None], (-1,))
        dense = xp.take(xp.reshape(a, (t * h, *tail)), rows, axis=0)
        dense = xp.reshape(dense, (b, h, self.longest, *tail))
        valid = xp.reshape(xp.asarray(self.valid, device=dev),
                           (b, 1, self.longest) + (1,) * len(tail))
        return xp.where(valid, dense, xp.full((), fill, dtype=a.dtype, device=dev))

    def pack(self, xp: Any, a: Any, fill: float) -> Any:
        """Padded ``a`` [B', H, Lmax, ...] as packed [T, H, ...] (the padding dropped),
        ``fill`` for the tokens of the sequences left out of the batch."""
        dev = device_of(a)
        b, h, longest, *tail = (int(s) for s in a.shape)
        t = len(self.kept)
        # token t's row of head h is (batch * H + h) * Lmax + position of a as [B'*H*Lmax]
        first = xp.asarray(self.batch * (h * longest) + self.position, device=dev)
        heads = xp.arange(h, dtype=xp.int64, device=dev)
        rows = xp.reshape(first[:, None] + heads[None, :] * longest, (-1,))
        packed = xp.take(xp.reshape(a, (b * h * longest, *tail)), rows, axis=0)
        packed = xp.reshape(packed, (t, h, *tail))
        if self.kept.all():
            return packed
        kept = xp.reshape(xp.asarray(self.kept, device=dev), (t,) + (1,) * (1 + len(tail)))
        return xp.where(kept, packed, xp.full((), fill, dtype=a.dtype, device=dev))


def _sides(cu_q: Any, cu_k: Any) -> tuple[_Padding, _Padding] | None:
    """The :class:`_Padding` of the queries and of the keys, or None when no sequence has
    both queries and keys (every result is then fixed by the spec)."""
    reader = "numba-cuda's varlen_attention builds its gather indices from them"
    bounds_q = host_integers(cu_q, "cu_seqlens_q", reader)
    bounds_k = host_integers(cu_k, "cu_seqlens_k", reader)
    live = (np.diff(bounds_q) > 0) & (np.diff(bounds_k) > 0)
    if not live.any():
        return None
    return _Padding(bounds_q, live), _Padding(bounds_k, live)


def _mask(xp: Any, queries: _Padding, keys: _Padding, hq: int, causal: Any,
          window: tuple[int, int], dev: Any) -> Any:
    """The keys each padded query row may see, as a boolean [B', Hq, Lq_max, Lk_max] (a
    broadcast view over the heads): inside its sequence's keys and its causal and window band
    aligned with the sequence's own lengths; nothing for the padding rows."""
    lq, lk = queries.lengths[:, None], keys.lengths[:, None]
    rows = np.arange(queries.longest, dtype=np.int64)[None, :]
    diagonal = rows + (0 if causal == "top_left" else lk - lq)  # [B', Lq_max]
    lo, hi = kernels.band_limits(causal, window)
    # a row's allowed keys are one interval [first, last] (empty when last < first)
    first = np.maximum(diagonal + lo, 0)
    last = np.where(queries.valid, np.minimum(diagonal + hi, lk - 1), -1)
    first_d, last_d = (xp.asarray(a, device=dev)[..., None] for a in (first, last))
    cols = xp.arange(keys.longest, dtype=xp.int64, device=dev)
    allowed = (cols >= first_d) & (cols <= last_d)  # [B', Lq_max, Lk_max]
    b = len(queries.lengths)
    return xp.broadcast_to(allowed[:, None], (b, hq, queries.longest, keys.longest))


def varlen_attention(*, xp: Any, q: Any, k: Any, v: Any, cu_seqlens_q: Any,
                     cu_seqlens_k: Any, scale: float, causal: Any, window: tuple[int, int],
                     softcap: Any, return_lse: bool) -> tuple[Any, Any]:
    """Attention of each packed sequence of ``q`` [Tq, Hq, D] with its own keys of ``k``
    [Tk, Hk, D] and ``v`` [Tk, Hk, Dv]; ``(out [Tq, Hq, Dv], lse [Tq, Hq] or None)``.

    The frontend has validated the cumulative lengths.  A query row with no allowed key gets
    out 0 and lse -inf: all the rows of a sequence without keys, which never enter the batch.
    A call where no sequence has both queries and keys launches nothing.
    """
    dev = device_of(q)
    sides = _sides(cu_seqlens_q, cu_seqlens_k)
    if sides is None:  # no row sees a key: out 0, lse -inf (spec)
        tq, hq = int(q.shape[0]), int(q.shape[1])
        acc = lookup(xp, accumulator_name(dtype_name(q.dtype)))
        out = xp.zeros((tq, hq, int(v.shape[2])), dtype=q.dtype, device=dev)
        lse = xp.full((tq, hq), -math.inf, dtype=acc, device=dev)
        return out, (lse if return_lse else None)
    queries, keys = sides
    mask = _mask(xp, queries, keys, int(q.shape[1]), causal,
                 (int(window[0]), int(window[1])), dev)
    out, lse = attention(
        xp=xp, q=queries.unpack(xp, q, 0.0), k=keys.unpack(xp, k, 0.0),
        v=keys.unpack(xp, v, 0.0), scale=scale, causal=None, window=(-1, -1), mask=mask,
        softcap=softcap, return_lse=return_lse)
    return (queries.pack(xp, out, 0.0),
            queries.pack(xp, lse, -math.inf) if return_lse else None)


def varlen_attention_vjp(*, xp: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
                         cu_seqlens_q: Any, cu_seqlens_k: Any, scale: float, causal: Any,
                         window: tuple[int, int], softcap: Any) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of :func:`varlen_attention`, shaped and typed like q, k, v.

    The padding rows enter the dense gradient with lse = -inf (rows with no allowed key: P
    is 0 there) and zero q, out and dout, the padding keys as zero k and v that no row may
    see, so they add exactly 0 to the gradients of the sequences' own rows and keys.  The
    sequences without queries or without keys stay out of the batch: their gradients are 0,
    whatever their values.
    """
    dev = device_of(q)
    sides = _sides(cu_seqlens_q, cu_seqlens_k)
    if sides is None:  # no query reads a key: every gradient is 0
        return tuple(xp.zeros(tuple(a.shape), dtype=a.dtype, device=dev) for a in (q, k, v))
    queries, keys = sides
    mask = _mask(xp, queries, keys, int(q.shape[1]), causal,
                 (int(window[0]), int(window[1])), dev)
    dq, dk, dv = attention_vjp(
        xp=xp, q=queries.unpack(xp, q, 0.0), k=keys.unpack(xp, k, 0.0),
        v=keys.unpack(xp, v, 0.0), out=queries.unpack(xp, out, 0.0),
        lse=queries.unpack(xp, lse, -math.inf), dout=queries.unpack(xp, dout, 0.0),
        scale=scale, causal=None, window=(-1, -1), mask=mask, softcap=softcap)
    return queries.pack(xp, dq, 0.0), keys.pack(xp, dk, 0.0), keys.pack(xp, dv, 0.0)
