"""The mergeable per-row state of a chunked reduction, packed into one small array.

A chunk of a row is described by ``WIDTH`` numbers in the accumulator dtype, stored along a
trailing axis so that Dask can move, concatenate and tree-reduce them like any array:

``LEVEL``
    the reference level ``m`` (the chunk's maximum, or a log-sum-exp); 0 when ``MASS`` is 0.
``MASS``
    the signed sum of ``b * exp(x - m)`` over the allowed positions (``b = 1`` without
    weights); 0 means the chunk contributes nothing, whatever ``LEVEL`` holds.
``NAN``
    1 when an allowed NaN (or a NaN weight) was seen.
``UP``
    1 when an allowed ``+inf`` with a positive weight (or no weights) was seen.
``DOWN``
    1 when an allowed ``+inf`` with a negative weight was seen (``UP`` and ``DOWN``
    together make the sum NaN, as ``inf - inf`` would).

Merging picks the largest level among the chunks that contribute, rescales each mass by
``exp(level - largest)`` (a factor in [0, 1]) and adds; a chunk of mass 0 is the identity and
its level never enters an exponent, so ``-inf - (-inf)`` is never evaluated.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

LEVEL, MASS, NAN, UP, DOWN = range(5)
WIDTH = 5


def pack(xp: Any, level: Any, mass: Any, nan: Any, up: Any, down: Any) -> Any:
    """Stack the five fields (each ``[...]``) into a state ``[..., WIDTH]`` of ``level``'s dtype."""
    dtype = level.dtype
    fields = [level, mass, nan, up, down]
    return xp.stack([xp.astype(xp.asarray(f), dtype) for f in fields], axis=-1)


def from_summary(xp: Any, maximum: Any, mass: Any) -> Any:
    """The state of a chunk from its summary ``(max, mass)`` (:func:`softmaxkit.summarize`).

    A summary marks an allowed NaN with a NaN maximum, an allowed ``+inf`` with an infinite
    maximum, and an empty chunk with ``(-inf, 0)``.
    """
    nan = xp.isnan(maximum)
    finite = xp.isfinite(maximum)
    posinf = (maximum == math.inf) & ~nan
    level = xp.where(finite, maximum, 0.0)
    weight = xp.where(finite, mass, 0.0)
    return pack(xp, level, weight, nan, posinf, xp.zeros_like(posinf))


def to_summary(xp: Any, state: Any) -> tuple[Any, Any]:
    """The summary ``(max, mass)`` of a state without weights: the inverse of
    :func:`from_summary` (NaN maximum for an allowed NaN, ``+inf`` for an allowed ``+inf``,
    ``(-inf, 0)`` for nothing allowed)."""
    level, mass = state[..., LEVEL], state[..., MASS]
    maximum = xp.where(mass == 0, -math.inf, level)
    maximum = xp.where(posinf(state), math.inf, maximum)
    return xp.where(state[..., NAN] != 0, math.nan, maximum), mass


def merge(xp: Any, states: Any) -> Any:
    """Merge states ``[..., K, WIDTH]`` along the ``K`` axis into one ``[..., WIDTH]``."""
    level, mass = states[..., LEVEL], states[..., MASS]
    live = mass != 0
    top = xp.max(xp.where(live, level, -math.inf), axis=-1, keepdims=True)
    any_live = xp.any(live, axis=-1, keepdims=True)
    top = xp.where(any_live, top, 0.0)
    factor = xp.exp(xp.where(live, level - top, 0.0))
    total = xp.sum(xp.where(live, mass * factor, 0.0), axis=-1)
    return pack(
        xp,
        top[..., 0],
        total,
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
    return (state[..., MASS] == 0) & (state[..., NAN] == 0) & ~posinf(state)
