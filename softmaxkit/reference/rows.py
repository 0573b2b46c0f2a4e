"""Reference row kernels, one function per operation, along the last axis of ``[..., N]``.

Each function follows spec/semantics.md line by line.  The shared step is :func:`row_stats`:
exclusion of masked positions (never multiplication by zero), the row maximum, the sum of
shifted exponentials in the accumulator dtype, and the classification of special rows.
Special rows are sanitized before any arithmetic, so no ``-inf - (-inf)`` or ``inf / inf`` is
ever evaluated and no floating-point warning is raised for a row whose answer is finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..dtypes import accumulator_dtype

NEG_INF = -math.inf


@dataclass
class RowStats:
    """Per-row quantities shared by the row kernels (all ``[..., 1]`` except ``z``)."""

    z: Any  # x - shift on allowed positions, -inf on excluded ones, 0 on special rows
    shift: Any  # the row maximum where finite, else 0
    total: Any  # sum of exp(z) over allowed positions (0 for an empty row)
    empty: Any  # no allowed position with a logit above -inf
    nan: Any  # an allowed NaN
    posinf: Any  # an allowed +inf and no NaN


def row_stats(xp: Any, x: Any, where: Any) -> RowStats:
    """The row maximum and normalizer of ``x`` over the allowed positions, in float32 or wider."""
    acc = accumulator_dtype(xp, x.dtype)
    x = xp.astype(x, acc)
    if where is not None:
        x = xp.where(where, x, NEG_INF)
    isnan = xp.isnan(x)
    nan = xp.any(isnan, axis=-1, keepdims=True)
    clean = xp.where(isnan, NEG_INF, x)
    if x.shape[-1] == 0:
        m = xp.full(x.shape[:-1] + (1,), NEG_INF, dtype=acc, device=_device(x))
    else:
        m = xp.max(clean, axis=-1, keepdims=True)
    posinf = (m == math.inf) & ~nan
    empty = (m == NEG_INF) & ~nan
    special = nan | posinf
    shift = xp.where(special | empty, 0.0, m)
    z = xp.where(special, 0.0, clean - shift)
    total = xp.sum(xp.exp(z), axis=-1, keepdims=True)
    total = xp.where(special, 1.0, total)
    return RowStats(z=z, shift=shift, total=total, empty=empty, nan=nan, posinf=posinf)


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """p = exp(z) / sum(exp(z)); excluded positions 0; see spec section "softmax"."""
    s = row_stats(xp, x, where)
    safe = xp.where(s.empty, 1.0, s.total)
    p = xp.exp(s.z) / safe
    bad = s.nan | s.posinf
    if masked == "nan":
        bad = bad | s.empty
    p = xp.where(bad, math.nan, p)
    return xp.astype(p, out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """log p = z - log(sum(exp(z))); excluded positions -inf; see spec "log_softmax"."""
    s = row_stats(xp, x, where)
    safe = xp.where(s.empty, 1.0, s.total)
    out = s.z - xp.log(safe)
    # an allowed +inf has an undefined log-probability; the finite ones tend to -inf
    acc = accumulator_dtype(xp, x.dtype)
    xa = xp.astype(x, acc)
    allowed_inf = xa == math.inf if where is None else (xa == math.inf) & where
    out = xp.where(s.posinf, xp.where(allowed_inf, math.nan, NEG_INF), out)
    bad = s.nan | (s.empty if masked == "nan" else xp.zeros_like(s.nan))
    out = xp.where(bad, math.nan, out)
    return xp.astype(out, out_dtype)


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """log |sum b exp(x)| (and its sign); positions with b == 0 are excluded, like SciPy."""
    acc = accumulator_dtype(xp, x.dtype)
    if b is not None:
        b = xp.astype(b, acc)
        keep = b != 0
        where = keep if where is None else (where & keep)
    s = row_stats(xp, x, where)
    if b is None:
        total = s.total
    else:
        bz = xp.where(s.nan | s.posinf, 0.0, b)
        weighted = xp.exp(s.z) * bz
        total = xp.sum(weighted, axis=-1, keepdims=True)
        # +inf rows: the sum is +-inf by the sign of the weights on the +inf positions
        xa = xp.astype(x, acc)
        inf_w = xp.sum(xp.where(xa == math.inf, b, 0.0), axis=-1, keepdims=True)
        total = xp.where(s.posinf, inf_w, total)
        nan_b = xp.any(xp.isnan(b), axis=-1, keepdims=True)
        total = xp.where(nan_b, math.nan, total)
    sign = xp.sign(total)
    magnitude = xp.abs(total)
    zero = magnitude == 0
    lse = xp.log(xp.where(zero, 1.0, magnitude))
    lse = xp.where(zero, NEG_INF, lse + s.shift)
    lse = xp.where(s.posinf & (b is None or ~zero), math.inf, lse)
    lse = xp.where(s.nan, math.nan, lse)
    if not return_sign:
        lse = xp.where(sign < 0, math.nan, lse)
    lse = xp.astype(lse[..., 0], out_dtype)
    if return_sign:
        sign = xp.where(s.nan, math.nan, sign)
        return lse, xp.astype(sign[..., 0], out_dtype)
    return lse


def cross_entropy(
    xp: Any,
    *,
    logits: Any,
    index: Any,
    probs: Any,
    where: Any,
    ignore_index: int | None,
    label_smoothing: float,
    grad_scale: Any,
    out_dtype: Any,
) -> tuple[Any, Any]:
    """Per-row loss lse - sum(y * x) and, when ``grad_scale`` is given, scale * (p - y)."""
    acc = accumulator_dtype(xp, logits.dtype)
    s = row_stats(xp, logits, where)
    n = logits.shape[-1]
    allowed = where if where is not None else xp.ones(logits.shape, dtype=xp.bool,
                                                        device=_device(logits))
    safe = xp.where(s.empty, 1.0, s.total)
    logp = s.z - xp.log(safe)  # -inf at excluded positions
    if index is not None:
        classes = xp.arange(n, device=_device(logits))
        onehot = xp.astype(xp.expand_dims(index, axis=-1) == classes, acc)
        valid = xp.ones(index.shape, dtype=xp.bool, device=_device(logits))
        if ignore_index is not None:
            valid = index != ignore_index
        y = onehot
    else:
        y = xp.astype(probs, acc)
        valid = xp.ones(logits.shape[:-1], dtype=xp.bool, device=_device(logits))
    if label_smoothing:
        count = xp.sum(xp.astype(allowed, acc), axis=-1, keepdims=True)
        y = (1.0 - label_smoothing) * y + xp.where(
            allowed, label_smoothing / xp.where(count == 0, 1.0, count), 0.0
        )
    # loss = -sum over y > 0 of y * log p: a zero target weight excludes its position
    terms = xp.where(y != 0, y * xp.where(y != 0, logp, 0.0), 0.0)
    loss = -xp.sum(terms, axis=-1)
    loss = xp.where(s.nan[..., 0], math.nan, loss)
    loss = xp.where(s.posinf[..., 0] & ~s.nan[..., 0], math.nan, loss)
    loss = xp.where(valid, loss, 0.0)
    if grad_scale is None:
        return loss, None
    p = xp.where(s.empty, 0.0, xp.exp(s.z) / safe)
    p = xp.where(s.nan | s.posinf, math.nan, p)
    grad = (p - y) * grad_scale
    grad = xp.where(xp.expand_dims(valid, axis=-1), grad, 0.0)
    return loss, xp.astype(grad, out_dtype)


def softmax_vjp(xp: Any, *, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """g = p * (c - sum(p * c)) over allowed positions; excluded positions 0."""
    acc = accumulator_dtype(xp, probs.dtype)
    p = xp.astype(probs, acc)
    c = xp.astype(cotangent, acc)
    if where is not None:
        p = xp.where(where, p, 0.0)
        c = xp.where(where, c, 0.0)
    c = xp.where(p == 0, 0.0, c)  # a zero-probability position contributes nothing
    dot = xp.sum(p * c, axis=-1, keepdims=True)
    g = p * (c - dot)
    return xp.astype(g, out_dtype)


def log_softmax_vjp(
    xp: Any, *, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """g = c - exp(log p) * sum(c) over allowed positions; excluded positions (and -inf) 0."""
    acc = accumulator_dtype(xp, logprobs.dtype)
    lp = xp.astype(logprobs, acc)
    c = xp.astype(cotangent, acc)
    allowed = lp != NEG_INF
    if where is not None:
        allowed = allowed & where
    c = xp.where(allowed, c, 0.0)
    total = xp.sum(c, axis=-1, keepdims=True)
    g = c - xp.exp(xp.where(allowed, lp, NEG_INF)) * total
    g = xp.where(allowed, g, 0.0)
    return xp.astype(g, out_dtype)
