"""The mergeable per-row state of a chunked reduction, packed into one small array.

A chunk of a row is described by ``WIDTH`` numbers in the accumulator dtype, stored along a
trailing axis so that Dask can move, concatenate and tree-reduce them like any array:

``LEVEL``
    the reference level ``m`` (the chunk's maximum, or a log-sum-exp); 0 when the chunk
    contributes nothing.
``HEAD``
    the signed weight of the terms at the level itself (1 for a maximum without weights, the
    sign of a chunk's log-sum-exp);
``REST``
    the signed sum of the other terms ``b * exp(x - m)``.  The chunk's sum is
    ``exp(m) * (HEAD + REST)``; held apart, a small ``REST`` keeps its relative precision
    and the result is ``m + log|HEAD| + log1p(REST / HEAD)`` (spec "logsumexp").
    ``HEAD = REST = 0`` means the chunk contributes nothing, whatever ``LEVEL`` holds.
``NAN``
    1 when an allowed NaN (or a NaN weight) was seen.
``UP``
    1 when an allowed ``+inf`` with a positive weight (or no weights) was seen.
``DOWN``
    1 when an allowed ``+inf`` with a negative weight was seen (``UP`` and ``DOWN``
    together make the sum NaN, as ``inf - inf`` would).

Merging picks the largest level among the chunks that contribute; the heads at that level
add, and every other chunk's whole sum ``HEAD + REST``, rescaled by ``exp(level - largest)``
(a factor in [0, 1]), joins the rest.  A chunk that contributes nothing is the identity and
its level never enters an exponent, so ``-inf - (-inf)`` is never evaluated.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

LEVEL, HEAD, REST, NAN, UP, DOWN = range(6)
WIDTH = 6


def pack(xp: Any, level: Any, head: Any, rest: Any, nan: Any, up: Any, down: Any) -> Any:
    """Stack the six fields (each ``[...]``) into a state ``[..., WIDTH]`` of ``level``'s dtype."""
    dtype = level.dtype
    fields = [level, head, rest, nan, up, down]
    return xp.stack([xp.astype(xp.asarray(f), dtype) for f in fields], axis=-1)


def mass(state: Any) -> Any:
    """The chunk's sum relative to its level, ``HEAD + REST`` (0: nothing contributes)."""
    return state[..., HEAD] + state[..., REST]


def from_summary(xp: Any, maximum: Any, mass: Any) -> Any:
    """The state of a chunk from its summary ``(max, mass)`` (:func:`softmaxkit.summarize`).

    A summary marks an allowed NaN with a NaN maximum, an allowed ``+inf`` with an infinite
    maximum, and an empty chunk with ``(-inf, 0)``.  The maximum contributes exactly 1 to
    the mass, so ``REST = mass - 1`` (exact for a mass of at least 1).
    """
    nan = xp.isnan(maximum)
    finite = xp.isfinite(maximum)
    posinf = (maximum == math.inf) & ~nan
    level = xp.where(finite, maximum, 0.0)
    head = xp.where(finite, 1.0, 0.0)
    rest = xp.where(finite, mass - 1.0, 0.0)
    return pack(xp, level, head, rest, nan, posinf, xp.zeros_like(posinf))


def to_summary(xp: Any, state: Any) -> tuple[Any, Any]:
    """The summary ``(max, mass)`` of a state without weights: the inverse of
    :func:`from_summary` (NaN maximum for an allowed NaN, ``+inf`` for an allowed ``+inf``,
    ``(-inf, 0)`` for nothing allowed)."""
    level, total = state[..., LEVEL], mass(state)
    maximum = xp.where(total == 0, -math.inf, level)
    maximum = xp.where(posinf(state), math.inf, maximum)
    return xp.where(state[..., NAN] != 0, math.nan, maximum), total


def merge(xp: Any, states: Any) -> Any:
    """Merge states ``[..., K, WIDTH]`` along the ``K`` axis into one ``[..., WIDTH]``."""
    level, head, rest = states[..., LEVEL], states[..., HEAD], states[..., REST]
    live = (head != 0) | (rest != 0)
    top = xp.max(xp.where(live, level, -math.inf), axis=-1, keepdims=True)
    any_live = xp.any(live, axis=-1, keepdims=True)
    top = xp.where(any_live, top, 0.0)
    at_top = live & (level == top)
    below = live & ~at_top
    factor = xp.exp(xp.where(below, level - top, 0.0))
    new_head = xp.sum(xp.where(at_top, head, 0.0), axis=-1)
    new_rest = xp.sum(
        xp.where(at_top, rest, xp.where(below, (head + rest) * factor, 0.0)), axis=-1)
    return pack(
        xp,
        top[..., 0],
        new_head,
        new_rest,
        xp.any(states[..., NAN] != 0, axis=-1),
        xp.any(states[..., UP] != 0, axis=-1),
        xp.any(states[..., DOWN] != 0, axis=-1),
    )


def combine(block: Any, axis: tuple[int, ...], keepdims: bool) -> Any:
    """The combine / aggregate step of :func:`dask.array.reduction` over packed states.

    ``block`` holds ``K`` states concatenated along the (last) reduced axis:
    ``[..., K * WIDTH]`` becomes ``[..., WIDTH]``.
    """
    xp = array_api_compat.array_namespace(block)
    k = block.shape[-1] // WIDTH
    merged = merge(xp, xp.reshape(block, tuple(block.shape[:-1]) + (k, WIDTH)))
    return merged if keepdims else merged[..., 0]


def keep(block: Any, axis: tuple[int, ...], keepdims: bool) -> Any:
    """The chunk step of :func:`dask.array.reduction`: the states are already per chunk."""
    return block


def posinf(state: Any) -> Any:
    """Rows with an allowed ``+inf`` (of either weight sign)."""
    return (state[..., UP] != 0) | (state[..., DOWN] != 0)


def empty(state: Any) -> Any:
    """Rows with nothing allowed: no mass, no NaN, no ``+inf``."""
    return (mass(state) == 0) & (state[..., NAN] == 0) & ~posinf(state)
