"""Reference kernels for online summaries: ``summarize``, the exact n-ary ``merge`` and
``normalize``.

A summary of the allowed logits of a row is ``(max, mass, numerator)`` with
``mass = sum(exp(x - max))`` and ``numerator = sum(exp(x - max) * values)``, in the accumulator
dtype (spec/semantics.md, "Summaries").  An empty row is ``(-inf, 0, 0)``, the identity of
:func:`merge`.  :func:`rescale` is the one place a summary is moved to a new reference maximum;
it branches so that ``-inf - (-inf)`` and ``inf - inf`` are never evaluated.  :func:`normalize`
turns a row's summary back into the row's softmax, one chunk of the row at a time.
"""

from __future__ import annotations

import math
from typing import Any

from ..dtypes import accumulator_dtype, dtype_name
from .rows import below_range_to_inf, shifted

NEG_INF = -math.inf


def rescale(xp: Any, old: Any, new: Any) -> Any:
    """``exp(old - new)`` for maxima ``old <= new``: in [0, 1], exactly 1 where ``old == new``.

    ``old == new`` covers two empty summaries (both ``-inf``) and two ``+inf`` maxima, whose
    difference is undefined; a non-finite ``new`` above ``old`` gives 0.  NaN maxima give 0
    here and are propagated by the caller.
    """
    finite = xp.isfinite(new)
    safe_new = xp.where(finite, new, 0.0)
    diff = xp.where(finite, old - safe_new, NEG_INF)
    return xp.exp(xp.where(old == new, 0.0, diff))


def merge_pair(
    xp: Any, m_a: Any, l_a: Any, n_a: Any, m_b: Any, l_b: Any, n_b: Any
) -> tuple[Any, Any, Any]:
    """Merge two summaries ``(max, mass, numerator [..., Dv] or None)`` of disjoint parts."""
    m = xp.maximum(m_a, m_b)
    f_a, f_b = rescale(xp, m_a, m), rescale(xp, m_b, m)
    mass = l_a * f_a + l_b * f_b
    num = None
    if n_a is not None:
        num = n_a * f_a[..., None] + n_b * f_b[..., None]
    nan = xp.isnan(m_a) | xp.isnan(m_b)
    return _poison(xp, nan, m, mass, num)


def _poison(xp: Any, nan: Any, m: Any, mass: Any, num: Any) -> tuple[Any, Any, Any]:
    m = xp.where(nan, math.nan, m)
    mass = xp.where(nan, math.nan, mass)
    if num is not None:
        num = xp.where(nan[..., None], math.nan, num)
    return m, mass, num


def summarize(xp: Any, *, x: Any, where: Any, values: Any) -> tuple[Any, Any, Any]:
    """Summary of each row of ``x`` [R, N] over its allowed positions.

    Excluded positions (``where`` False, or a logit of ``-inf``) contribute nothing: their
    weight is ``exp(-inf) = 0`` and their value is replaced by 0 before the product, so an
    excluded NaN or infinite value cannot leak in.  An allowed NaN makes the whole summary NaN;
    an allowed ``+inf`` gives ``max = +inf`` and NaN mass and numerator.
    """
    acc = accumulator_dtype(xp, x.dtype)
    xa = xp.astype(x, acc)
    if where is not None:
        xa = xp.where(where, xa, NEG_INF)
    isnan = xp.isnan(xa)
    nan = xp.any(isnan, axis=-1)
    clean = xp.where(isnan, NEG_INF, xa)
    rows, n = x.shape[0], x.shape[-1]
    if n == 0:
        m = xp.full((rows,), NEG_INF, dtype=acc, device=_device(x))
    else:
        m = xp.max(clean, axis=-1)
    posinf = m == math.inf
    shift = xp.where(xp.isfinite(m), m, 0.0)
    z = xp.where(posinf[..., None], NEG_INF, shifted(xp, clean, shift[..., None]))
    e = xp.exp(z)
    mass = xp.sum(e, axis=-1)
    num = None
    if values is not None:
        va = xp.astype(values, acc)
        va = xp.where((clean != NEG_INF)[..., None], va, 0.0)
        num = (e[..., None, :] @ va)[..., 0, :]
    mass = xp.where(posinf, math.nan, mass)
    if num is not None:
        num = xp.where(posinf[..., None], math.nan, num)
    return _poison(xp, nan, m, mass, num)


def merge(xp: Any, *, maxes: Any, masses: Any, numerators: Any) -> tuple[Any, Any, Any]:
    """Merge ``S`` summaries [S, R] (numerators [S, R, Dv]) into one, exactly.

    Every part is rescaled to the largest maximum by a factor in [0, 1] and the parts are
    added; an empty part has mass 0 and numerator 0, so it adds nothing.  Summaries held in
    a 16-bit dtype are merged in its accumulator (no sum is held in a 16-bit type) and
    returned in their own dtype.
    """
    dtype = maxes.dtype
    if dtype_name(dtype) in ("float16", "bfloat16"):
        acc = accumulator_dtype(xp, dtype)
        m, mass, num = merge(
            xp, maxes=xp.astype(maxes, acc), masses=xp.astype(masses, acc),
            numerators=None if numerators is None else xp.astype(numerators, acc))
        return (xp.astype(m, dtype), xp.astype(mass, dtype),
                None if num is None else xp.astype(num, dtype))
    m = xp.max(maxes, axis=0)
    factor = rescale(xp, maxes, m[None, ...])
    mass = xp.sum(masses * factor, axis=0)
    num = None
    if numerators is not None:
        num = xp.sum(numerators * factor[..., None], axis=0)
    nan = xp.any(xp.isnan(maxes), axis=0)
    return _poison(xp, nan, m, mass, num)


def normalize(
    xp: Any, *, x: Any, where: Any, maxes: Any, masses: Any, log: bool, masked: str,
    out_dtype: Any,
) -> Any:
    """Softmax (or log_softmax) of the rows of ``x`` [R, N] against given summaries [R].

    ``(maxes, masses)`` summarize a set of positions that contains every allowed position of
    the row (typically the merge of the summaries of all the chunks of a longer row), so the
    result is the row's softmax restricted to these positions: ``exp(x - max) / mass``, or
    ``(x - max) - log(mass)`` with ``log``; excluded positions give 0 (``-inf``).  The summary
    classifies the row as spec/semantics.md does for softmax and log_softmax: a NaN maximum
    is a NaN row, ``+inf`` a +inf row, ``-inf`` an empty row (``masked`` decides).

    Raises
    ------
    ValueError
        When an allowed logit exceeds its row's maximum, or is NaN under a maximum that is
        not: the summary does not cover ``x``.
    """
    acc = accumulator_dtype(xp, x.dtype)
    xa = xp.astype(x, acc)
    allowed = xa != NEG_INF
    if where is not None:
        allowed = allowed & where
    m = xp.astype(maxes, acc)[..., None]
    nan, posinf, empty = xp.isnan(m), m == math.inf, m == NEG_INF
    if bool(xp.any(allowed & ~(xa <= m) & ~nan)):
        raise ValueError(
            "the summaries do not cover x: an allowed logit is above its row's maximum or NaN "
            "(pass the summary of a set of positions that contains the row's)"
        )
    regular = ~(nan | posinf | empty)
    shift = xp.where(regular, m, 0.0)
    total = xp.where(regular, xp.astype(masses, acc)[..., None], 1.0)
    z = xp.where(allowed & regular, shifted(xp, xa, shift), NEG_INF)
    bad = nan | empty if masked == "nan" else nan
    if log:
        out = z - xp.log(total)
        at_inf = xp.where(allowed & (xa == math.inf), math.nan, xp.full_like(out, NEG_INF))
        out = xp.where(posinf, at_inf, out)
    else:
        out = xp.exp(z) / total
        bad = bad | posinf
    out = xp.where(bad, math.nan, out)
    if log:  # a log-probability may lie below a narrower output's range
        out = below_range_to_inf(xp, out, out_dtype)
    return xp.astype(out, out_dtype)


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)
