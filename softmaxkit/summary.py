"""Online-softmax summaries: :class:`Summary`, :func:`summarize` and the exact :func:`merge`.

A summary of a block of logits is the block's maximum, its mass ``sum(exp(x - max))`` and,
when values are given, the unnormalized weighted numerator ``sum(exp(x - max) * v)``.  The
maximum is the reference level that makes the other two fields meaningful; two summaries merge
exactly by rescaling both to the larger maximum.  spec/semantics.md, "Summaries", is the
contract; docs/summaries.md explains why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from . import arguments as args
from .dispatch import run
from .dtypes import accumulator_dtype
from .frameworks import on_host, refuse_gradient
from .layout import RowLayout


@dataclass(frozen=True, eq=False)
class Summary:
    """The summary of the allowed logits along one axis, in the accumulator dtype.

    Attributes
    ----------
    max : array
        The largest allowed logit, ``-inf`` for an empty block (nothing allowed).
    mass : array
        ``sum(exp(x - max))`` over the allowed positions; 0 for an empty block.
    numerator : array or None
        ``sum(exp(x - max) * values)`` with a trailing value axis ``Dv``; 0 for an empty
        block; None when the summary was made without values.

    Notes
    -----
    The empty summary ``(-inf, 0, 0)`` is the identity of :func:`merge`.  An allowed NaN makes
    every field NaN; an allowed ``+inf`` gives ``max = +inf`` and NaN mass and numerator.
    """

    max: Any
    mass: Any
    numerator: Any = None

    @classmethod
    def empty(
        cls, shape: tuple[int, ...] = (), values_dim: int | None = None, *, like: Any = None
    ) -> Summary:
        """The empty summary ``(-inf, 0, 0)``: the identity of :func:`merge`.

        Parameters
        ----------
        shape : tuple of ints, optional
            The batch shape.
        values_dim : int, optional
            ``Dv``; with it the summary carries a zero numerator.
        like : array, optional
            An array whose library, device and accumulator dtype the fields take (default:
            numpy float64).
        """
        like = np.empty(0) if like is None else like
        xp = array_api_compat.array_namespace(like)
        dtype = accumulator_dtype(xp, like.dtype)
        dev = array_api_compat.device(like)
        num = None
        if values_dim is not None:
            num = xp.zeros(tuple(shape) + (values_dim,), dtype=dtype, device=dev)
        return cls(xp.full(tuple(shape), -math.inf, dtype=dtype, device=dev),
                   xp.zeros(tuple(shape), dtype=dtype, device=dev), num)

    @property
    def shape(self) -> tuple[int, ...]:
        """The batch shape (the summarized array's shape without the summarized axis)."""
        return tuple(self.max.shape)

    def logsumexp(self) -> Any:
        """``max + log(mass)``: the log-sum-exp of the block; ``-inf`` when empty.

        A block with an allowed ``+inf`` gives ``+inf``, and one with an allowed NaN gives NaN,
        as :func:`softmaxkit.logsumexp` does.
        """
        xp = array_api_compat.array_namespace(self.max)
        empty = self.mass == 0
        safe = xp.where(empty | xp.isnan(self.mass), 1.0, self.mass)
        lse = xp.where(empty, -math.inf, self.max + xp.log(safe))
        return xp.where(self.max == math.inf, math.inf, lse)

    def normalized(self) -> Any:
        """``numerator / mass``: the softmax-weighted average of the values; 0 when empty.

        Raises
        ------
        ValueError
            If the summary was made without values.
        """
        if self.numerator is None:
            raise ValueError("this summary has no numerator: pass values= to summarize")
        xp = array_api_compat.array_namespace(self.max)
        empty = (self.mass == 0)[..., None]
        safe = xp.where(self.mass == 0, 1.0, self.mass)[..., None]
        return xp.where(empty, 0.0, self.numerator / safe)


def summarize(
    x: Any,
    axis: int = -1,
    *,
    where: Any = None,
    values: Any = None,
    backend: str | None = None,
) -> Summary:
    """Summarize the logits ``x`` along ``axis`` as (max, mass, numerator).

    Parameters
    ----------
    x : array_like
        Logits, at least one dimension.
    axis : int, optional
        The axis to summarize (default -1).
    where : array_like of bool, optional
        Broadcastable to ``x``; ``False`` excludes a position (a logit of ``-inf`` is
        excluded too).
    values : array_like, optional
        Shape ``[..., N, Dv]``: ``values[..., n, :]`` is the value vector of position ``n`` of
        the summarized axis, and ``...`` broadcasts with ``x``'s shape without ``axis``.  With
        it, the summary carries the numerator.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    Summary
        Fields of shape ``x.shape`` without ``axis`` (numerator: plus ``Dv``), in float32 for
        16- and 32-bit inputs, float64 for float64.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> x = np.array([20.0, 18.0, 17.0, -5.0])
    >>> s = sk.merge(sk.summarize(x[:2]), sk.summarize(x[2:]))
    >>> round(float(s.logsumexp()), 6), round(float(sk.logsumexp(x)), 6)
    (20.169846, 20.169846)
    """
    hosted, result = on_host(summarize, x, axis, where=where, values=values, backend=backend)
    if hosted:
        return result
    refuse_gradient("summarize", x, values)
    xp = args.namespace(x=x, where=where, values=values)
    x = args.floating(xp, args.as_array(xp, x, "x"), "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the summarized axis)")
    ax = args.single_axis(axis, x.ndim)
    w = args.mask(xp, where, tuple(x.shape), like=x)
    layout = RowLayout.of(tuple(x.shape), (ax,))
    batch, n = layout.batch_shape, x.shape[ax]
    rows = math.prod(batch)
    vr = None
    dv = None
    if values is not None:
        vals = args.floating(xp, args.as_array(xp, values, "values", like=x), "values")
        if vals.ndim < 2 or vals.shape[-2] != n:
            raise ValueError(
                f"values of shape {tuple(vals.shape)} must be [..., N, Dv] with N = {n}, the "
                f"length of x along axis {axis}"
            )
        common = xp.result_type(x.dtype, vals.dtype)
        x, vals = xp.astype(x, common), xp.astype(vals, common)
        dv = vals.shape[-1]
        vals = args.broadcast_operand(xp, vals, batch + (n, dv), x, "values")
        vr = xp.reshape(vals, (rows, n, dv))
    xr = xp.reshape(layout.to_rows(xp, x), (rows, n))
    wr = None if w is None else xp.reshape(layout.to_rows(xp, w), (rows, n))
    m, mass, num = run("summarize", xp, xr, backend, x=xr, where=wr, values=vr)
    if num is not None:
        num = xp.reshape(num, batch + (dv,))
    return Summary(xp.reshape(m, batch), xp.reshape(mass, batch), num)


def merge(*summaries: Summary, backend: str | None = None) -> Summary:
    """Merge summaries of disjoint blocks of the same rows into one, exactly.

    The largest maximum is chosen and every part is rescaled to it by ``exp(old - new)``, a
    factor in [0, 1], before the masses and numerators are added.  Exact in real arithmetic,
    hence associative and commutative; empty summaries are the identity.

    Parameters
    ----------
    *summaries : Summary
        One or more summaries whose batch shapes broadcast together; either all or none carry
        a numerator, with the same ``Dv``.  A single list or tuple of summaries is accepted too.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    Summary
        The summary of the union of the blocks.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> x = np.array([1.0, 2.0, 3.0, 4.0])
    >>> s = sk.merge(sk.summarize(x[:1]), sk.summarize(x[1:]), sk.summarize(x[:0]))
    >>> float(s.max), round(float(s.mass), 6)
    (4.0, 1.553002)
    """
    if len(summaries) == 1 and isinstance(summaries[0], (list, tuple)):
        summaries = tuple(summaries[0])
    if not summaries:
        raise ValueError("merge needs at least one summary")
    for i, s in enumerate(summaries):
        if not isinstance(s, Summary):
            raise TypeError(f"summaries[{i}] is a {type(s).__name__}, expected a Summary")
    hosted, result = on_host(merge, *summaries, backend=backend)
    if hosted:
        return result
    refuse_gradient("merge", [f for s in summaries for f in (s.max, s.mass, s.numerator)])
    with_num = [s.numerator is not None for s in summaries]
    if any(with_num) and not all(with_num):
        raise ValueError("either every summary or none must carry a numerator (values=)")
    named = {f"summaries[{i}]": s.max for i, s in enumerate(summaries)}
    xp = args.namespace(**named)
    dtype = xp.result_type(*[s.max.dtype for s in summaries])
    try:
        shape = tuple(xp.broadcast_arrays(*[s.max for s in summaries])[0].shape)
    except Exception:
        raise ValueError(
            "the summaries' shapes do not broadcast together: "
            + ", ".join(str(s.shape) for s in summaries)
        ) from None
    rows = math.prod(shape)

    def stack(fields: list[Any], tail: tuple[int, ...]) -> Any:
        parts = [xp.reshape(xp.broadcast_to(xp.astype(f, dtype), shape + tail), (rows,) + tail)
                 for f in fields]
        return xp.stack(parts, axis=0)

    maxes = stack([s.max for s in summaries], ())
    masses = stack([s.mass for s in summaries], ())
    nums = None
    dv = None
    if all(with_num):
        dvs = {s.numerator.shape[-1] for s in summaries}
        if len(dvs) != 1:
            raise ValueError(f"the summaries' numerators have different lengths {sorted(dvs)}")
        (dv,) = dvs
        nums = stack([s.numerator for s in summaries], (dv,))
    m, mass, num = run("merge", xp, maxes, backend, maxes=maxes, masses=masses, numerators=nums)
    if num is not None:
        num = xp.reshape(num, shape + (dv,))
    return Summary(xp.reshape(m, shape), xp.reshape(mass, shape), num)
