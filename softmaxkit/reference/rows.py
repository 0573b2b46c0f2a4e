"""Reference row kernels, one function per operation, along the last axis of ``[..., N]``.

Each function follows spec/semantics.md line by line.  The shared step is :func:`row_stats`:
exclusion of masked positions (never multiplication by zero), the classification of special
rows (NaN, +inf, empty), the row maximum and the sum of shifted exponentials in the
accumulator dtype.  Special rows are sanitized before any arithmetic, so no ``-inf - (-inf)``,
``inf - inf``, ``0 * inf`` or ``log(0)`` is ever evaluated and no floating-point warning is
raised for a row whose answer is finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from array_api_compat import device as _device

from ..dtypes import HUGE, UNIT_ROUNDOFF, accumulator_dtype, dtype_name

NEG_INF = -math.inf
NAN = math.nan


@dataclass
class RowStats:
    """Per-row quantities shared by the row kernels (``[..., 1]`` unless marked ``[..., N]``)."""

    x: Any  # [..., N] logits in the accumulator dtype, -inf at excluded positions
    z: Any  # [..., N] x - shift; -inf at excluded positions; 0 on NaN and +inf rows
    shift: Any  # the row maximum on regular rows, else 0
    total: Any  # sum of exp(z): >= 1 on regular rows, 0 on empty rows, 1 on special rows
    empty: Any  # no allowed position above -inf (N = 0 included)
    nan: Any  # an allowed NaN
    posinf: Any  # an allowed +inf and no allowed NaN

    @property
    def special(self) -> Any:
        """Rows whose result is NaN whatever the policy (an allowed NaN or +inf)."""
        return self.nan | self.posinf

    def safe_total(self, xp: Any) -> Any:
        """``total`` with empty rows' 0 replaced by 1, so dividing or taking a log is safe."""
        return xp.where(self.empty, xp.ones_like(self.total), self.total)


def row_stats(xp: Any, x: Any, where: Any, acc: Any = None) -> RowStats:
    """Classify the rows of ``x`` and compute their maximum and normalizer.

    Parameters
    ----------
    xp
        The array namespace.
    x
        Logits ``[..., N]``.
    where
        ``None`` or a boolean ``[..., N]`` mask; ``False`` excludes a position.
    acc
        The accumulator dtype (default: float32, or float64 for float64 ``x``).
    """
    acc = accumulator_dtype(xp, x.dtype) if acc is None else acc
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
    shift = xp.where(special | empty, xp.zeros_like(m), m)
    z = xp.where(special, xp.zeros_like(clean), shifted(xp, clean, shift))
    total = xp.sum(xp.exp(z), axis=-1, keepdims=True)
    total = xp.where(special, xp.ones_like(total), total)
    return RowStats(x=x, z=z, shift=shift, total=total, empty=empty, nan=nan, posinf=posinf)


def shifted(xp: Any, x: Any, shift: Any) -> Any:
    """``x - shift`` (a finite ``shift``, broadcast) without an overflow warning: computed as
    ``2 (x/2 - shift/2)``, the same number wherever it is finite, and -inf where it rounds
    below the dtype's range (logits near both ends of it)."""
    half = x / 2 - shift / 2
    below = half < -HUGE[dtype_name(x.dtype)] / 2
    return xp.where(below, xp.full_like(half, NEG_INF),
                    xp.where(below, xp.zeros_like(half), half) * 2)


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Spec "softmax": ``p = exp(z) / sum(exp(z))``, 0 at excluded positions.

    A row with an allowed NaN or +inf is NaN; an empty row is 0 (``masked="zero"``) or NaN
    (``masked="nan"``; ``"raise"`` is handled by the frontend before the call).
    """
    s = row_stats(xp, x, where)
    p = xp.exp(s.z) / s.safe_total(xp)
    bad = s.special | s.empty if masked == "nan" else s.special
    p = xp.where(bad, xp.full_like(p, NAN), p)
    return xp.astype(p, out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Spec "log_softmax": ``z - log(sum(exp(z)))``, ``-inf`` at excluded positions.

    A NaN row is NaN; a +inf row is NaN at its allowed +inf positions and ``-inf`` elsewhere
    (as in SciPy); an empty row is ``-inf`` (``"zero"``) or NaN (``"nan"``).
    """
    s = row_stats(xp, x, where)
    out = s.z - xp.log(s.safe_total(xp))
    at_inf = xp.where(s.x == math.inf, xp.full_like(out, NAN), xp.full_like(out, NEG_INF))
    out = xp.where(s.posinf, at_inf, out)
    bad = s.nan | s.empty if masked == "nan" else s.nan
    out = xp.where(bad, xp.full_like(out, NAN), out)
    return xp.astype(below_range_to_inf(xp, out, out_dtype), out_dtype)


def below_range_to_inf(xp: Any, a: Any, dtype: Any) -> Any:
    """``a`` with the values that round to ``-inf`` in ``dtype`` set to ``-inf`` already, so
    the cast rounds them without an overflow warning (a log-probability below a 16-bit
    format's range, say)."""
    name = dtype_name(dtype)
    top = HUGE[name]
    if top >= HUGE[dtype_name(a.dtype)]:  # no narrowing, nothing to round away
        return a
    edge = top + math.ldexp(UNIT_ROUNDOFF[name], math.frexp(top)[1] - 1)  # + ulp / 2
    return xp.where(a <= -edge, xp.full_like(a, NEG_INF), a)


def log_abs_sum(xp: Any, head: Any, rest: Any) -> tuple[Any, Any]:
    """``(log |head + rest|, sign(head + rest))``, keeping a small ``rest`` through ``log1p``.

    ``head`` is the weight at the row's maximum (the number of maxima without weights) and
    ``rest`` the sum of the other terms ``b_i exp(x_i - M)``.  Where ``|rest| <= |head| / 2``
    the log is ``log|head| + log1p(rest / head)``, so terms far below the maximum are not lost
    in a sum rounded at ``head`` (``logsumexp([0, -40])`` is ``4.25e-18``, not 0); elsewhere
    ``log|head + rest|`` loses nothing.  A zero sum gives ``(-inf, 0)``.
    """
    total = head + rest
    magnitude = xp.abs(total)
    zero = magnitude == 0
    small = (head != 0) & (xp.abs(rest) <= 0.5 * xp.abs(head))
    safe_head = xp.where(head == 0, xp.ones_like(head), head)
    # the ratio is formed only where it is at most 1/2, so it cannot overflow
    ratio = xp.where(small, rest, xp.zeros_like(rest)) / safe_head
    near = xp.log(xp.abs(safe_head)) + xp.log1p(ratio)
    far = xp.log(xp.where(zero, xp.ones_like(magnitude), magnitude))
    out = xp.where(small, near, far)
    return xp.where(zero, xp.full_like(out, NEG_INF), out), xp.sign(total)


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """Spec "logsumexp": ``log |sum b exp(x)|`` and its sign over the allowed positions.

    A position whose weight ``b`` is 0 is excluded, like one masked by ``where`` (so
    ``b = 0`` next to ``x = inf`` or NaN contributes nothing; spec S9).  The sum is split
    into the weight at the maximum and the rest (:func:`log_abs_sum`).
    """
    acc = accumulator_dtype(xp, out_dtype)
    nan_b = None
    if b is not None:
        b = xp.astype(b, acc)
        # a NaN weight makes its row NaN wherever where= allows it, even on a -inf logit
        # (NaN * 0 is NaN, as in SciPy)
        isnan_b = xp.isnan(b) if where is None else (xp.isnan(b) & where)
        nan_b = xp.any(isnan_b, axis=-1, keepdims=True)
        keep = b != 0
        where = keep if where is None else (where & keep)
    s = row_stats(xp, x, where, acc)
    # z == 0 exactly at the maxima of a regular row (and everywhere on NaN / +inf rows,
    # whose results are set below); z == -inf at excluded positions
    at_max = s.z == 0
    terms = xp.exp(s.z)
    zeros = xp.zeros_like(terms)
    if b is None:
        weights = xp.ones_like(terms)
        nan = s.nan
        sign_inf = xp.ones_like(s.total)
    else:
        allowed = s.x != NEG_INF
        bz = xp.where(allowed & ~xp.isnan(b), b, xp.zeros_like(b))
        nan = s.nan | nan_b
        # sanitized so that no NaN or 0 * inf is formed on rows handled separately
        weights = xp.where(s.special | nan, xp.zeros_like(bz), bz)
        # a +inf row: +-inf by the sign of the weights on its +inf positions; both signs: NaN
        at_inf = s.x == math.inf
        up = xp.any(at_inf & (bz > 0), axis=-1, keepdims=True)
        down = xp.any(at_inf & (bz < 0), axis=-1, keepdims=True)
        nan = nan | (s.posinf & up & down)
        sign_inf = xp.where(down, -xp.ones_like(s.total), xp.ones_like(s.total))
    head = xp.sum(xp.where(at_max, weights, zeros), axis=-1, keepdims=True)
    rest = xp.sum(xp.where(at_max, zeros, terms * weights), axis=-1, keepdims=True)
    log_t, sign = log_abs_sum(xp, head, rest)
    sign = xp.where(s.posinf, sign_inf, sign)
    lse = log_t + s.shift
    lse = xp.where(s.posinf, xp.full_like(lse, math.inf), lse)
    lse = xp.where(nan, xp.full_like(lse, NAN), lse)
    sign = xp.where(nan, xp.full_like(sign, NAN), sign)
    if not return_sign:
        lse = xp.where(sign < 0, xp.full_like(lse, NAN), lse)
    lse = xp.astype(lse[..., 0], out_dtype)
    if return_sign:
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
    """Spec "cross_entropy": per-row loss ``-sum(y * log p)`` and ``grad_scale * (p - y)``.

    Returns the per-row losses ``[...]`` in the accumulator dtype (the frontend reduces them)
    and, when ``grad_scale`` is not None, the gradient ``[..., N]`` in ``out_dtype``.  A class
    is excluded when ``where`` is False or its logit is ``-inf``; target mass on an excluded
    class makes the loss ``+inf``; excluded classes and ignored rows get gradient 0.  A class
    index outside ``[0, N)`` that is not ``ignore_index`` gives a NaN loss and gradient row.
    ``grad_scale`` is a Python float or a 0-d array beside the logits (ops.py).
    """
    acc = accumulator_dtype(xp, logits.dtype)
    s = row_stats(xp, logits, where)
    n = logits.shape[-1]
    dev = _device(logits)
    included = s.z != NEG_INF  # NaN and +inf rows have z = 0: they are NaN anyway
    logp = s.z - xp.log(s.safe_total(xp))
    if index is not None:
        classes = xp.arange(n, device=dev)
        y = xp.astype(xp.expand_dims(index, axis=-1) == classes, acc)
        if ignore_index is None:
            valid = xp.ones(index.shape, dtype=xp.bool, device=dev)
        else:
            valid = index != ignore_index
        # a class index outside [0, N) that is not ignored makes its row NaN (loss and
        # gradient): the frontend checks only where that costs no device read
        unknown = valid & ((index < 0) | (index >= n))
    else:
        y = xp.astype(probs, acc)
        valid = xp.ones(logits.shape[:-1], dtype=xp.bool, device=dev)
        unknown = xp.zeros(logits.shape[:-1], dtype=xp.bool, device=dev)
    if label_smoothing:
        count = xp.sum(xp.astype(included, acc), axis=-1, keepdims=True)
        share = label_smoothing / xp.where(count == 0, xp.ones_like(count), count)
        y = (1.0 - label_smoothing) * y + xp.where(included, share, xp.zeros_like(y))
    has = y != 0
    zeros = xp.zeros_like(y)
    terms = xp.where(has, y * xp.where(has, logp, zeros), zeros)  # 0 * log 0 is 0
    loss = 0.0 - xp.sum(terms, axis=-1)  # +0.0, not -0.0, for a row without target mass
    nan_rows = s.special | xp.expand_dims(unknown, axis=-1)
    loss = xp.where(nan_rows[..., 0], xp.full_like(loss, NAN), loss)
    loss = xp.where(valid, loss, xp.zeros_like(loss))
    if grad_scale is None:
        return loss, None
    p = xp.exp(logp)
    grad = xp.where(included, (p - y) * grad_scale, zeros)
    grad = xp.where(nan_rows, xp.full_like(grad, NAN), grad)
    grad = xp.where(xp.expand_dims(valid, axis=-1), grad, zeros)
    return loss, xp.astype(grad, out_dtype)


def softmax_vjp(xp: Any, *, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """Spec "softmax_vjp": ``p * (g - sum(p * g))`` in O(N), never the Jacobian.

    Positions excluded by ``where`` or with ``p == 0`` take no part: their gradient is 0 and
    their cotangent is not read, so a fully masked row has gradient 0.
    """
    acc = accumulator_dtype(xp, out_dtype)
    p = xp.astype(probs, acc)
    g = xp.astype(cotangent, acc)
    part = p != 0  # NaN probabilities take part and propagate
    if where is not None:
        part = part & where
    zeros = xp.zeros_like(p)
    p = xp.where(part, p, zeros)
    g = xp.where(part, g, zeros)
    dot = xp.sum(p * g, axis=-1, keepdims=True)
    # where, not 0 * (g - dot): an infinite dot must not make the positions that take no
    # part NaN
    return xp.astype(xp.where(part, p * (g - dot), zeros), out_dtype)


def log_softmax_vjp(
    xp: Any, *, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """Spec "log_softmax_vjp": ``g - exp(log p) * sum(g)`` in O(N).

    Positions excluded by ``where`` or with ``log p == -inf`` take no part: their gradient is
    0 and their cotangent is not summed, so a fully masked row has gradient 0.
    """
    acc = accumulator_dtype(xp, out_dtype)
    lp = xp.astype(logprobs, acc)
    g = xp.astype(cotangent, acc)
    part = lp != NEG_INF
    if where is not None:
        part = part & where
    zeros = xp.zeros_like(g)
    g = xp.where(part, g, zeros)
    total = xp.sum(g, axis=-1, keepdims=True)
    p = xp.exp(xp.where(part, lp, xp.full_like(lp, NEG_INF)))
    return xp.astype(xp.where(part, g - p * total, zeros), out_dtype)
