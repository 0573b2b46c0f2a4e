"""Row kernels over Dask arrays chunked along the reduced (last) axis.

Each kernel builds a graph of one task per chunk plus a merge tree:

1. per chunk, a state (:mod:`softmaxkit.chunked.state`) from the kernels of whichever backend
   serves the chunk's array type, device and dtype: a summary ``(max, mass)`` for softmax and
   log_softmax (:func:`_summary`), the ``logsumexp`` kernel with signs for logsumexp;
2. the states of a row merge in a tree (:func:`dask.array.reduction`, ``SPLIT_EVERY`` states
   per task), so no task holds more than one chunk of a row;
3. logsumexp finishes from the merged state; softmax and log_softmax read each chunk once more
   and normalize it with the row's merged summary by the chunk backend's ``normalize`` kernel
   (one fused pass: ``exp(x - max) / mass`` or ``(x - max) - log(mass)``).  Where only the
   reference serves ``normalize`` (CuPy chunks today), softmax runs the chunk backend's
   ``softmax`` kernel instead and rescales it from the chunk's own summary to the row's.

The results agree with the reference kernels at every edge (spec/semantics.md): masks, rows
with nothing allowed, NaN, ``+inf``, weights ``b`` and signs.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import array_api_compat
import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array

from ..dispatch import run
from ..dtypes import accumulator_dtype, dtype_name
from ..reference.rows import log_abs_sum
from ..registry import REFERENCE, device_type, registry
from . import state as st

SPLIT_EVERY = 8
"""States merged per task of the tree: the tree has about ``chunks / (SPLIT_EVERY - 1)`` tasks."""


def _like_x(x: Any, other: Any) -> Any:
    """``other`` (a mask or weights already broadcast to ``x``'s shape) chunked like ``x``."""
    if other is None:
        return None
    if not array_api_compat.is_dask_array(other):
        other = da.from_array(other, chunks=x.chunks)
    return other if other.chunks == x.chunks else other.rechunk(x.chunks)


def _per_chunk(fn: Any, x: Any, *extra: Any, width: int | None, dtype: Any, **kwargs: Any) -> Any:
    """``fn(x_chunk, *extra_chunks, **kwargs)`` for every chunk of ``x``.

    ``extra`` are arrays chunked like ``x`` along the batch axes (or None); their chunks along
    the last axis are paired with ``x``'s by position, and a single one is broadcast.  Each
    result has ``x``'s chunk shape, or ``width`` along the last axis when given.
    """
    chunks = x.chunks if width is None else x.chunks[:-1] + ((width,) * len(x.chunks[-1]),)
    return da.map_blocks(
        fn, x, *extra,
        chunks=chunks, dtype=dtype,
        meta=meta_from_array(x._meta, ndim=x.ndim, dtype=dtype),
        token=f"softmaxkit-{fn.__name__.strip('_').replace('_', '-')}", **kwargs,
    )


def merged_state(states: Any, acc: Any, split_every: int = SPLIT_EVERY) -> Any:
    """Merge the per-chunk states ``[..., WIDTH * chunks]`` of each row into ``[..., WIDTH]``."""
    return da.reduction(
        states, st.keep, st.combine,
        combine=st.combine, axis=states.ndim - 1, keepdims=True, dtype=acc,
        split_every={states.ndim - 1: split_every}, output_size=st.WIDTH,
        concatenate=True, name="softmaxkit-merge",
        meta=meta_from_array(states._meta, ndim=states.ndim, dtype=acc),
    )


# -- per-chunk work (runs on the workers, on numpy or CuPy chunks) ----------------------------


def _acc(xp: Any, dtype: Any) -> Any:
    """The accumulator dtype for ``dtype``, as a dtype object (never a scalar type)."""
    return xp.empty((0,), dtype=accumulator_dtype(xp, dtype)).dtype


def _rows_of(xp: Any, a: Any) -> Any:
    return None if a is None else xp.reshape(a, (math.prod(a.shape[:-1]), a.shape[-1]))


def _declares(op: str, x: Any) -> bool:
    """Whether a backend other than the reference serves ``op`` for chunks like ``x``."""
    device, dtype = device_type(x), dtype_name(x.dtype)
    return any(b.serves_key(op, device, dtype)
               for name, b in registry().items() if name != REFERENCE)


_scratch = threading.local()


def _shifted(xp: Any, a: Any, shift: Any) -> Any:
    """``a - shift``; for numpy chunks into a per-thread buffer that is reused, because a
    fresh chunk-sized allocation costs more (in page faults) than the subtraction itself."""
    if not array_api_compat.is_numpy_array(a):
        return a - shift
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.dtype != a.dtype or buffer.size < a.size:
        buffer = _scratch.buffer = np.empty(a.size, dtype=a.dtype)
    out = buffer[: a.size].reshape(a.shape)
    np.subtract(a, shift, out=out)
    return out


def _summary(xp: Any, x: Any, where: Any) -> tuple[Any, Any]:
    """``(max, mass)`` of each row of one chunk ``[R, n]``, as ``summarize`` defines them.

    The ``summarize`` kernel of the chunk's backend when a backend other than the reference
    declares it.  Otherwise the exact maximum and the chunk's (fast) ``logsumexp`` kernel on
    the rows shifted by it: their log-sum-exp lies in [0, log n], so rounding it costs the mass
    only a few units of its last place.  (The log-sum-exp of the unshifted rows is rounded at
    the magnitude of the logits, which would cost probabilities ``|lse| * u`` of accuracy.)
    """
    if _declares("summarize", x):
        maximum, mass, _ = run("summarize", xp, x, None, x=x, where=where, values=None)
        return maximum, mass
    acc = _acc(xp, x.dtype)
    a = xp.astype(x, acc, copy=False)
    if where is not None:
        a = xp.where(where, a, -math.inf)
    if a.shape[-1] == 0:
        return xp.full(a.shape[:-1], -math.inf, dtype=acc), xp.zeros(a.shape[:-1], dtype=acc)
    maximum = xp.max(a, axis=-1)  # NaN when an allowed NaN is present
    finite = xp.isfinite(maximum)
    shifted = _shifted(xp, a, xp.where(finite, maximum, 0.0)[..., None])
    lse = run("logsumexp", xp, shifted, None, x=shifted, b=None, where=None,
              return_sign=False, out_dtype=acc)
    mass = xp.where(finite, xp.exp(xp.where(finite, lse, 0.0)), 0.0)
    return maximum, mass


def _summary_state(x: Any, where: Any) -> Any:
    """The state of one chunk from its summary (:func:`_summary`)."""
    xp = array_api_compat.array_namespace(x)
    xr, wr = _rows_of(xp, x), _rows_of(xp, where)
    state = st.from_summary(xp, *_summary(xp, xr, wr))
    return xp.reshape(state, tuple(x.shape[:-1]) + (st.WIDTH,))


def _lse_state(x: Any, b: Any, where: Any, *, acc: Any) -> Any:
    """The state of one chunk from the ``logsumexp`` kernel (with signs) of its backend."""
    xp = array_api_compat.array_namespace(x)
    lse, sign = run("logsumexp", xp, x, None, x=x, b=b, where=where, return_sign=True,
                    out_dtype=acc)
    nan = xp.isnan(lse) | xp.isnan(sign)
    finite = xp.isfinite(lse)
    posinf = (lse == math.inf) & ~nan
    level = xp.where(finite, lse, 0.0)
    # the chunk's sum is sign * exp(lse): all of it at the level, nothing in the rest
    head = xp.where(finite, sign, 0.0)
    return st.pack(xp, level, head, xp.zeros_like(head), nan, posinf & (sign > 0),
                   posinf & (sign < 0))


def _lse_finish(state: Any, return_sign: bool, out_dtype: Any) -> Any:
    """``(lse, sign)`` of each row from its merged state ``[..., WIDTH]``, as the reference."""
    xp = array_api_compat.array_namespace(state)
    level = state[..., st.LEVEL]
    up, down = state[..., st.UP] != 0, state[..., st.DOWN] != 0
    # +inf logits of both weight signs make inf - inf: NaN, as in one row
    nan = (state[..., st.NAN] != 0) | (up & down)
    posinf = (up | down) & ~nan
    log_t, sign = log_abs_sum(xp, state[..., st.HEAD], state[..., st.REST])
    sign = xp.where(posinf, xp.where(down, -1.0, 1.0), sign)
    lse = level + log_t
    lse = xp.where(posinf, math.inf, lse)
    lse = xp.where(nan, math.nan, lse)
    sign = xp.where(nan, math.nan, sign)
    if not return_sign:
        lse = xp.where(sign < 0, math.nan, lse)
    out = xp.stack([lse, sign], axis=-1)
    return xp.astype(out, out_dtype)


def _normalize_block(x: Any, where: Any, row: Any, *, log: bool, masked: str,
                     out_dtype: Any) -> Any:
    """softmax (log_softmax) of one chunk from the row's merged state, by the ``normalize``
    kernel of the chunk's backend: one pass over the chunk."""
    xp = array_api_compat.array_namespace(x)
    xr, wr = _rows_of(xp, x), _rows_of(xp, where)
    maximum, mass = st.to_summary(xp, xp.reshape(row, (xr.shape[0], st.WIDTH)))
    out = run("normalize", xp, xr, None, x=xr, where=wr, maxes=maximum, masses=mass, log=log,
              masked=masked, out_dtype=out_dtype)
    return xp.reshape(out, tuple(x.shape))


def _softmax_block(x: Any, where: Any, own: Any, row: Any, *, masked: str, out_dtype: Any) -> Any:
    """Softmax of one chunk: the ``normalize`` kernel of its backend (:func:`_normalize_block`)
    or, where only the reference offers one, the backend's ``softmax`` kernel rescaled from the
    chunk's state to the row's.

    ``p = p_chunk * mass_c * exp(m_c - m) / mass``: the factor lies in [0, 1] and carries
    only relative rounding, so the result keeps the accuracy of the chunk's kernel.
    """
    if _declares("normalize", x):
        return _normalize_block(x, where, row, log=False, masked=masked, out_dtype=out_dtype)
    xp = array_api_compat.array_namespace(x)
    acc = _acc(xp, x.dtype)
    part = run("softmax", xp, x, None, x=x, where=where, masked="zero", out_dtype=acc)
    level_c, mass_c = own[..., st.LEVEL], st.mass(own)
    level, mass = row[..., st.LEVEL], st.mass(row)
    live = mass_c != 0
    shift = xp.exp(xp.where(live, level_c - level, 0.0))
    factor = xp.where(live, mass_c * shift / xp.where(mass == 0, 1.0, mass), 0.0)
    out = part
    out *= xp.astype(factor, acc)[..., None]  # the kernel's fresh result, scaled in place
    bad = (row[..., st.NAN] != 0) | st.posinf(row)
    if masked == "nan":
        bad = bad | st.empty(row)
    if bool(xp.any(bad)):
        out = xp.where(bad[..., None], math.nan, out)
    return xp.astype(out, out_dtype, copy=False)


# -- the kernels (called by the registry with Dask arrays of shape [..., N]) ------------------


def _chunk_namespace(x: Any) -> Any:
    return array_api_compat.array_namespace(x._meta)


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """``log |sum b exp(x)|`` (and its sign) along the last axis, reading each chunk once."""
    # the accumulator follows the output dtype, which b may have widened
    acc = _acc(_chunk_namespace(x), out_dtype)
    b, where = _like_x(x, b), _like_x(x, where)
    states = _per_chunk(_lse_state, x, b, where, width=st.WIDTH, dtype=acc, acc=acc)
    row = merged_state(states, acc)
    pair = _per_chunk(_lse_finish, row, width=2, dtype=out_dtype, return_sign=return_sign,
                      out_dtype=out_dtype)
    lse, sign = pair[..., 0], pair[..., 1]
    return (lse, sign) if return_sign else lse


def _states(x: Any, where: Any) -> tuple[Any, Any]:
    """Per-chunk states from the chunks' summaries, and each row's merged state."""
    acc = _acc(_chunk_namespace(x), x.dtype)
    own = _per_chunk(_summary_state, x, where, width=st.WIDTH, dtype=acc)
    return own, merged_state(own, acc)


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis in two reads of each chunk (summaries, then normalize)."""
    where = _like_x(x, where)
    own, row = _states(x, where)
    # the row's state has one block along the last axis: it is broadcast to every chunk
    return _per_chunk(_softmax_block, x, where, own, row, width=None, dtype=out_dtype,
                      masked=masked, out_dtype=out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """log_softmax along the last axis in two reads of each chunk."""
    where = _like_x(x, where)
    _, row = _states(x, where)
    return _per_chunk(_normalize_block, x, where, row, width=None, dtype=out_dtype, log=True,
                      masked=masked, out_dtype=out_dtype)
