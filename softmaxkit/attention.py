"""Exact attention, its gradient, and the merge of partial attention states (with gradient).

The frontend validates and normalizes the arguments (leading dimensions broadcast and
flattened, causal and window spelled one way, log-sum-exp conventions of other libraries
converted) and hands the backend one call in the layout of :data:`softmaxkit.ops.OPERATIONS`.
spec/semantics.md, "Attention", is the contract: in particular a query row with no allowed key
has output 0 and log-sum-exp ``-inf`` on every backend, and zero gradient.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import arguments as args
from .dispatch import run
from .dtypes import accumulator_dtype, dtype_name
from .frameworks import route

LN2 = math.log(2.0)


def lse_in_base(lse: Any, base: str) -> Any:
    """A natural-log ``lse`` in ``base``, ``"e"`` or ``"2"`` (:func:`.arguments.lse_base`)."""
    return lse / LN2 if base == "2" else lse


def natural_lse(lse: Any, base: str) -> Any:
    """An ``lse`` given in ``base`` as a natural log: the inverse of :func:`lse_in_base`."""
    return lse * LN2 if base == "2" else lse


def vjp_operands(
    xp: Any, out: Any, lse: Any, dout: Any, out_shape: tuple[int, ...], like: Any, base: str
) -> tuple[Any, Any, Any]:
    """The forward results an attention gradient takes, checked: ``out`` and ``dout`` of
    ``out_shape`` in ``like``'s dtype, ``lse`` of ``out_shape[:-1]`` as a natural log in the
    accumulator dtype (the kernels' convention)."""
    checked = {}
    for name, a, shape in (("out", out, out_shape), ("dout", dout, out_shape),
                           ("lse", lse, out_shape[:-1])):
        checked[name] = args.shaped_floating(xp, a, name, shape, like)
    lse_f = args.cast(xp, checked["lse"], accumulator_dtype(xp, like.dtype))
    return (args.cast(xp, checked["out"], like.dtype), natural_lse(lse_f, base),
            args.cast(xp, checked["dout"], like.dtype))


def lse_cotangent(
    xp: Any, dlse: Any, lse: Any, shape: tuple[int, ...], like: Any, base: str
) -> Any:
    """The lse's cotangent ``dlse`` (of ``shape``, given in ``base``) checked, in the
    accumulator dtype, for the natural-log ``lse`` the kernels take: ``d lse_2 = d lse_e /
    ln 2`` turns a base-2 cotangent into ``dlse / ln 2`` (rows without keys:
    :func:`keyless_rows_ignore`, which the gradients apply)."""
    dlse = args.shaped_floating(xp, dlse, "dlse", shape, like)
    dlse = xp.astype(dlse, lse.dtype, copy=False)
    return dlse / LN2 if base == "2" else dlse


def keyless_rows_ignore(xp: Any, dlse: Any, lse: Any) -> Any:
    """``dlse`` (or None) with 0 on the rows whose ``lse`` is -inf: a row with no allowed key
    has no score for its lse's cotangent to reach, so a non-finite value there reads as
    nothing (spec "Attention")."""
    return None if dlse is None else xp.where(lse == -math.inf, xp.zeros_like(dlse), dlse)


class _Layout:
    """Shapes of q, k, v (and mask) checked, leading dims broadcast, flattened into B."""

    def __init__(self, xp: Any, q: Any, k: Any, v: Any, mask: Any) -> None:
        for name, a in (("q", q), ("k", k), ("v", v)):
            if a.ndim < 3:
                raise ValueError(
                    f"{name} must have shape [..., heads, length, dim]; got {tuple(a.shape)}"
                )
        self.hq, self.lq, self.d = q.shape[-3:]
        self.hk, self.lk, dk = k.shape[-3:]
        if dk != self.d:
            raise ValueError(f"q's head dim {self.d} differs from k's {dk}")
        if tuple(v.shape[-3:-1]) != (self.hk, self.lk):
            raise ValueError(
                f"v of shape {tuple(v.shape)} must be [..., Hk, Lk, Dv] with (Hk, Lk) = "
                f"{(self.hk, self.lk)} from k"
            )
        self.dv = v.shape[-1]
        args.grouped_query_heads(self.hq, self.hk)
        leads = [tuple(q.shape[:-3]), tuple(k.shape[:-3]), tuple(v.shape[:-3])]
        if mask is not None:
            leads.append(tuple(mask.shape[:-3]))
        try:
            same = all(lead == leads[0] for lead in leads)  # the common case, cheaply
            self.lead = leads[0] if same else tuple(np.broadcast_shapes(*leads))
        except ValueError:
            raise ValueError(
                "the leading dimensions of q, k, v" + (", mask" if mask is not None else "")
                + f" do not broadcast: {leads}"
            ) from None
        self.b = math.prod(self.lead)

    def flat(self, xp: Any, a: Any) -> Any:
        """``a`` broadcast to the common leading shape and flattened to [B, h, l, d]."""
        tail = tuple(a.shape[-3:])
        if tuple(a.shape[:-3]) != self.lead:
            a = xp.broadcast_to(a, self.lead + tail)
        return a if len(self.lead) == 1 else xp.reshape(a, (self.b,) + tail)

    def unflat(self, xp: Any, a: Any) -> Any:
        """Undo :meth:`flat` on a result: [B, ...] -> [*lead, ...]."""
        return a if len(self.lead) == 1 else xp.reshape(a, self.lead + tuple(a.shape[1:]))


def _unbroadcast(xp: Any, g: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``g`` over the leading dimensions that were broadcast to reach it from ``shape``."""
    extra = g.ndim - len(shape)
    if extra:
        g = xp.sum(g, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return g


def _prepare(q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any] | None = None):
    """The call's namespace and layout, its operands checked (q, k, v floating, mask boolean),
    and those laid out for a backend (:func:`_laid_out`)."""
    arrays = {"q": q, "k": k, "v": v, "mask": mask, **(extra or {})}
    xp = args.namespace(**arrays)
    q, k, v = args.attention_operands(xp, q, k, v)
    if mask is not None:
        mask = _heads_rows_keys(xp, args.boolean(args.as_array(xp, mask, "mask", like=q), "mask",
                                                 "True = attend"))
    layout = _Layout(xp, q, k, v, mask)
    if mask is not None:
        full = tuple(mask.shape[:-3]) + (layout.hq, layout.lq, layout.lk)
        try:
            fits = np.broadcast_shapes(tuple(mask.shape), full) == full
        except (ValueError, TypeError):  # TypeError: a length not known yet (Dask)
            fits = False
        if not fits:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to [..., Hq, Lq, Lk] = "
                f"[..., {layout.hq}, {layout.lq}, {layout.lk}]"
            )
    return xp, layout, (q, k, v, mask), _laid_out(xp, layout, q, k, v, mask)


def _laid_out(xp: Any, layout: _Layout, q: Any, k: Any, v: Any, mask: Any) -> tuple:
    """``(qf, kf, vf, mf)``: checked q, k, v in their common dtype and a boolean mask (or
    None) broadcast to ``[..., Hq, Lq, Lk]``, each flattened to ``[B, ...]`` as ``layout``
    says, the layout of a backend call."""
    qf, kf, vf = (layout.flat(xp, a) for a in in_common_dtype(xp, q, k, v))
    if mask is None:
        return qf, kf, vf, None
    mask = _heads_rows_keys(xp, mask)
    full = (layout.hq, layout.lq, layout.lk)
    return qf, kf, vf, layout.flat(xp, xp.broadcast_to(mask, tuple(mask.shape[:-3]) + full))


def in_common_dtype(xp: Any, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """q, k, v in their promoted dtype (themselves when they share one)."""
    if q.dtype == k.dtype == v.dtype:  # the common case: no promotion to work out
        return q, k, v
    common = xp.result_type(q.dtype, k.dtype, v.dtype)
    return tuple(xp.astype(a, common, copy=False) for a in (q, k, v))


def _heads_rows_keys(xp: Any, mask: Any) -> Any:
    """A mask of fewer than three dimensions as ``[1.., Lq, Lk]`` (heads, rows, keys)."""
    if mask.ndim >= 3:
        return mask
    return xp.reshape(mask, (1,) * (3 - mask.ndim) + tuple(mask.shape))


class AttentionGradient:
    """The gradient of one attention call whose arguments are checked: what
    :func:`attention_vjp` runs once it has validated its own, and what an autograd backward
    runs directly with the forward's operands, ``out`` and ``lse`` and a cotangent of
    ``out``'s shape and dtype (nothing checked again).

    It holds no array of the call: the backward passes the operands again (autograd's saved
    tensors, which activation checkpointing may have recomputed or offloading moved), so
    that keeping the gradient keeps no memory alive.

    Parameters
    ----------
    xp, layout
        :func:`_prepare`'s namespace and layout of the call.
    scalars : dict
        The backend call's other arguments (:func:`kernel_args`): ``scale``, ``causal``,
        ``window``, ``softcap`` (normalized) and ``precision`` (for the dtype).
    backend : str or None
        The ``backend=`` asked for.
    """

    __slots__ = ("xp", "layout", "scalars", "backend")

    def __init__(self, xp: Any, layout: _Layout, scalars: dict[str, Any],
                 backend: str | None) -> None:
        self.xp, self.layout, self.scalars, self.backend = xp, layout, scalars, backend

    def __call__(self, q: Any, k: Any, v: Any, mask: Any, out: Any, lse: Any, dout: Any,
                 dlse: Any = None) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` for the checked operands (q, k, v floating, mask boolean or
        None), ``out`` and ``dout`` (``[..., Hq, Lq, Dv]``, the operands' common dtype), the
        natural-log ``lse`` in the accumulator dtype and ``dlse`` (its shape and dtype) or
        None; shaped and typed like q, k, v."""
        return self.laid_out((q, k, v), _laid_out(self.xp, self.layout, q, k, v, mask), out,
                             lse, dout, dlse)

    def laid_out(self, operands: tuple, flat: tuple, out: Any, lse: Any, dout: Any,
                 dlse: Any) -> tuple[Any, Any, Any]:
        """:meth:`__call__` of q, k, v (``operands``) already laid out (``flat``, of
        :func:`_laid_out`)."""
        xp, layout = self.xp, self.layout
        qf, kf, vf, mf = flat
        dlse = keyless_rows_ignore(xp, dlse, lse)
        lead = len(layout.lead)
        if lead != 1:  # the leading dimensions flattened into B, as the operands are
            out, lse, dout, dlse = (
                None if a is None else xp.reshape(a, (layout.b,) + tuple(a.shape[lead:]))
                for a in (out, lse, dout, dlse))
        dq, dk, dv = run("attention_vjp", xp, qf, self.backend, q=qf, k=kf, v=vf, out=out,
                         lse=lse, dout=dout, dlse=dlse, mask=mf, **self.scalars)
        grads = []
        for g, a in zip((dq, dk, dv), operands, strict=True):
            g = _unbroadcast(xp, layout.unflat(xp, g), tuple(a.shape))
            grads.append(args.cast(xp, g, a.dtype))
        return tuple(grads)


def kernel_args(scale: Any, options: dict[str, Any], precision: Any, d: int,
                dtype: Any) -> dict[str, Any]:
    """Attention's scalar arguments as keywords of a backend call on ``dtype`` of head dim
    ``d``: the scale and precision validated here, ``options``
    (:func:`.arguments.attention_options`) by the caller."""
    return {"scale": args.attention_scale(scale, d), **options,
            "precision": args.precision(precision, dtype_name(dtype))}


def attention_with_gradient(
    q: Any, k: Any, v: Any, *, scale: float | None, causal: bool | str,
    window: tuple[int, int] | None, mask: Any, softcap: float | None, precision: str,
    backend: str | None,
) -> tuple[Any, Any, AttentionGradient]:
    """:func:`attention`'s ``out`` and natural-log ``lse`` on the plain path (no framework
    routing), and the call's :class:`AttentionGradient`, for an autograd forward whose
    backward then skips the checks already made."""
    xp, layout, _, (qf, kf, vf, mf) = _prepare(q, k, v, mask)
    scalars = kernel_args(scale, args.attention_options(causal, window, softcap), precision,
                          layout.d, qf.dtype)
    out, lse = run("attention", xp, qf, backend, q=qf, k=kf, v=vf, mask=mf, return_lse=True,
                   **scalars)
    gradient = AttentionGradient(xp, layout, scalars, backend)
    return layout.unflat(xp, out), layout.unflat(xp, lse), gradient


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    mask: Any = None,
    softcap: float | None = None,
    return_lse: bool = False,
    lse_base: str | int = "e",
    precision: str = "float32",
    backend: str | None = None,
) -> Any:
    """Exact scaled dot-product attention, ``softmax(scale * q k^T) v``, without the score matrix.

    Parameters
    ----------
    q : array
        Queries ``[..., Hq, Lq, D]``.
    k : array
        Keys ``[..., Hk, Lk, D]``; ``Hq`` must be a multiple of ``Hk`` (grouped-query
        attention: query head ``h`` uses key head ``h // (Hq // Hk)``, without copying).
    v : array
        Values ``[..., Hk, Lk, Dv]``.  Leading dimensions of q, k, v and mask broadcast.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    causal : bool or {"bottom_right", "top_left"}, optional
        ``True`` or ``"bottom_right"``: query ``i`` sees keys ``j <= i + Lk - Lq`` (the
        FlashAttention alignment, the natural one for decoding with a KV cache).
        ``"top_left"``: keys ``j <= i`` (PyTorch SDPA's ``is_causal`` and JAX).  The two agree
        when ``Lq == Lk``.
    window : (int, int), optional
        Sliding window ``(left, right)``: query ``i`` sees keys within ``left`` before and
        ``right`` after its diagonal (aligned like ``causal``); ``-1`` is unbounded.
    mask : array of bool, optional
        True = attend; broadcastable to ``[..., Hq, Lq, Lk]``.  Combined with causal and window
        by logical and.
    softcap : float, optional
        Apply ``softcap * tanh(s / softcap)`` to the scaled scores (0 or None: no cap).
    return_lse : bool, optional
        Also return the log-sum-exp of each query row's allowed scores.
    lse_base : {"e", 2}, optional
        Base of the returned log-sum-exp: natural (default) or 2 (FlashInfer's convention).
    precision : {"float32", "tf32x3", "tf32"}, optional
        The least precision of the products of float32 inputs the caller accepts, as JAX's
        ``precision``: ``"float32"`` (default) computes within float32 arithmetic's bound;
        ``"tf32x3"`` allows products on tensor cores of each operand split into two TF32
        parts (about float32's accuracy); ``"tf32"`` allows products of inputs rounded to TF32
        (10-bit mantissa), float32 sums.  A backend may compute more precisely (the CPU
        backends always do).  Ignored for inputs of other dtypes.  spec/semantics.md,
        "Precision", gives each one's error bound.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    out : array
        ``[..., Hq, Lq, Dv]`` in the promoted dtype of q, k, v.  A query row with no allowed
        key gives 0.
    lse : array
        Only with ``return_lse``: ``[..., Hq, Lq]`` in float32 (float64 for float64 inputs);
        ``-inf`` for a row with no allowed key.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 4, 8)), rng.normal(size=(2, 6, 8)), rng.normal(size=(2, 6, 3))
    >>> out, lse = sk.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 4, 3), (2, 4))
    """
    framework = route(q, k, v, mask)
    if framework is not None:
        return framework.attention(
            q, k, v, scale=scale, causal=causal, window=window, mask=mask, softcap=softcap,
            return_lse=return_lse, lse_base=lse_base, precision=precision, backend=backend,
        )
    base = args.lse_base(lse_base)
    args.precision(precision, "float32")  # a bad value fails before any work
    xp, layout, _, (qf, kf, vf, mf) = _prepare(q, k, v, mask)
    out, lse = run(
        "attention", xp, qf, backend, q=qf, k=kf, v=vf, mask=mf, return_lse=bool(return_lse),
        **kernel_args(scale, args.attention_options(causal, window, softcap), precision,
                      layout.d, qf.dtype),
    )
    out = layout.unflat(xp, out)
    if not return_lse:
        return out
    return out, lse_in_base(layout.unflat(xp, lse), base)


def attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    *,
    dlse: Any = None,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    mask: Any = None,
    softcap: float | None = None,
    lse_base: str | int = "e",
    precision: str = "float32",
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """Gradient of :func:`attention`: ``(dq, dk, dv)`` for the upstream gradients ``dout``
    and, where the loss uses the log-sum-exp too, ``dlse``.

    Computed by recomputation from ``lse``, as FlashAttention's backward does: no probability
    matrix is stored, and a query row with no allowed key (``lse = -inf``) has zero gradient.

    Parameters
    ----------
    q, k, v : array
        The forward's inputs.
    out, lse : array
        The forward's output and log-sum-exp (``attention(..., return_lse=True)``).
    dout : array
        Upstream gradient, the shape of ``out``.
    dlse : array, optional
        Upstream gradient of the returned ``lse`` (its shape, in ``lse_base``), for a loss
        that uses it (as merging partial results does). It costs the backward nothing beyond
        one term per row (``rowsum(dout * out) - dlse``, in the accumulator dtype); a row with
        no allowed key ignores it.
    scale, causal, window, mask, softcap
        The forward's arguments, unchanged.
    lse_base : {"e", 2}, optional
        The base ``lse`` (and ``dlse``) is given in.
    precision : {"float32", "tf32x3", "tf32"}, optional
        The least precision of the gradient's products the caller accepts, as for
        :func:`attention` (whose precision it need not match).
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    dq, dk, dv : array
        Shaped and typed like ``q``, ``k``, ``v`` (broadcast leading dimensions summed back;
        ``dk``, ``dv`` summed over each group of query heads).
    """
    framework = route(q, k, v, out, lse, dout, mask, dlse)
    if framework is not None:
        return framework.attention_vjp(
            q, k, v, out, lse, dout, dlse=dlse, scale=scale, causal=causal, window=window,
            mask=mask, softcap=softcap, lse_base=lse_base, precision=precision,
            backend=backend,
        )
    base = args.lse_base(lse_base)
    args.precision(precision, "float32")
    extra = {"out": out, "lse": lse, "dout": dout} | ({} if dlse is None else {"dlse": dlse})
    xp, layout, operands, flat = _prepare(q, k, v, mask, extra)
    out_shape = layout.lead + (layout.hq, layout.lq, layout.dv)
    out_v, lse_v, dout_v = vjp_operands(xp, out, lse, dout, out_shape, flat[0], base)
    dlse_v = (None if dlse is None
              else lse_cotangent(xp, dlse, lse_v, out_shape[:-1], flat[0], base))
    scalars = kernel_args(scale, args.attention_options(causal, window, softcap), precision,
                          layout.d, flat[0].dtype)
    gradient = AttentionGradient(xp, layout, scalars, backend)
    return gradient.laid_out(operands[:3], flat, out_v, lse_v, dout_v, dlse_v)


def _states(
    outs: Any, lses: Any, axis: int, lse_base: Any, empty_lse: Any, extra: dict[str, Any]
):
    """Validate partial states and bring them to [S, R, Dv] / [S, R], natural log, -inf empty."""
    base = args.lse_base(lse_base)
    empty = args.empty_lse(empty_lse)
    if isinstance(outs, (list, tuple)) or isinstance(lses, (list, tuple)):
        xp = args.namespace(**{f"outs[{i}]": o for i, o in enumerate(outs)},
                            **{f"lses[{i}]": o for i, o in enumerate(lses)}, **extra)
        outs = xp.stack([args.as_array(xp, o, "outs") for o in outs], axis=axis)
        lses = xp.stack([args.as_array(xp, o, "lses") for o in lses], axis=axis)
    xp = args.namespace(outs=outs, lses=lses, **extra)
    outs = args.floating(xp, args.as_array(xp, outs, "outs"), "outs")
    lses = args.floating(xp, args.as_array(xp, lses, "lses", like=outs), "lses")
    if lses.ndim < 1 or tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(
            f"outs of shape {tuple(outs.shape)} must be lses' shape {tuple(lses.shape)} plus a "
            "trailing value dimension"
        )
    ax = args.single_axis(axis, lses.ndim)
    acc = accumulator_dtype(xp, outs.dtype)
    lses = xp.astype(lses, acc)
    if empty == math.inf:
        lses = xp.where(lses == math.inf, -math.inf, lses)
    lses = natural_lse(lses, base)
    batch = tuple(n for i, n in enumerate(lses.shape) if i != ax)
    s, rows, dv = lses.shape[ax], math.prod(batch), outs.shape[-1]
    lr = xp.reshape(xp.moveaxis(lses, ax, 0), (s, rows))
    orr = xp.reshape(xp.moveaxis(outs, ax, 0), (s, rows, dv))
    return xp, base, (outs, lses, ax, batch, dv), (orr, lr)


def merge_attention_states(
    outs: Any,
    lses: Any,
    axis: int = 0,
    *,
    lse_base: str | int = "e",
    empty_lse: float = -math.inf,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """Merge partial attention results over disjoint key sets into the full result, exactly.

    ``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) * out_s``, computed by
    rescaling to the largest ``lse_s``, so nothing overflows.  This assembles split-KV decoding
    and sequence-parallel attention from per-chunk ``attention(..., return_lse=True)`` calls.

    Parameters
    ----------
    outs : array or sequence of arrays
        Partial outputs ``[..., Dv]``, stacked along ``axis`` (or a list, stacked here).
    lses : array or sequence of arrays
        Their log-sum-exps: ``outs``' shape without the trailing ``Dv``.
    axis : int, optional
        The axis of ``lses`` (and ``outs``) that indexes the partials (default 0).
    lse_base : {"e", 2}, optional
        Base of ``lses`` and of the returned lse: natural or 2 (FlashInfer).
    empty_lse : {-inf, +inf}, optional
        How an empty partial (no key) is marked: ``-inf`` (softmaxkit, FlashInfer; default) or
        ``+inf`` (FlashAttention 2).  An empty partial's output is ignored whatever it holds.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    out : array
        ``outs``' shape without ``axis``, in ``outs``' dtype; 0 where every partial is empty.
    lse : array
        ``lses``' shape without ``axis``, float32 (float64 for float64 ``outs``), in
        ``lse_base``; ``-inf`` where every partial is empty (whatever ``empty_lse`` is).

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = rng.normal(size=(1, 3, 4)), rng.normal(size=(1, 8, 4)), rng.normal(size=(1, 8, 2))
    >>> parts = [sk.attention(q, k[:, i:i + 4], v[:, i:i + 4], return_lse=True) for i in (0, 4)]
    >>> out, lse = sk.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    >>> bool(np.allclose(out, sk.attention(q, k, v)))
    True
    """
    framework = route(outs, lses)
    if framework is not None:
        return framework.merge_attention_states(
            outs, lses, axis, lse_base=lse_base, empty_lse=empty_lse, backend=backend
        )
    xp, base, (outs, _, _, batch, dv), (orr, lr) = _states(
        outs, lses, axis, lse_base, empty_lse, {}
    )
    out, lse = run("merge_attention", xp, orr, backend, outs=orr, lses=lr)
    lse = xp.reshape(lse, batch)
    return xp.reshape(out, batch + (dv,)), lse_in_base(lse, base)


def merge_attention(
    out_a: Any,
    lse_a: Any,
    out_b: Any,
    lse_b: Any,
    *,
    lse_base: str | int = "e",
    empty_lse: float = -math.inf,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """Merge two partial attention states ``(out, lse)``; see :func:`merge_attention_states`.

    Two empty states (``lse = -inf``, or ``+inf`` with ``empty_lse=inf``) give ``(0, -inf)``.
    The gradient is ``merge_attention_vjp([out_a, out_b], [lse_a, lse_b], dout, dlse)``.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> out, lse = sk.merge_attention(np.ones((1, 2)), np.array([0.0]),
    ...                               np.zeros((1, 2)), np.array([-np.inf]))
    >>> out.tolist(), lse.tolist()
    ([[1.0, 1.0]], [0.0])
    """
    xp = args.namespace(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    pairs = []
    for name_o, o, name_l, sl in (("out_a", out_a, "lse_a", lse_a),
                                  ("out_b", out_b, "lse_b", lse_b)):
        o = args.as_array(xp, o, name_o)
        sl = args.as_array(xp, sl, name_l, like=o)
        if tuple(o.shape[:-1]) != tuple(sl.shape) or o.ndim < 1:
            raise ValueError(
                f"{name_o} of shape {tuple(o.shape)} must be {name_l}'s shape "
                f"{tuple(sl.shape)} plus a trailing value dimension"
            )
        pairs.append((o, sl))
    if tuple(pairs[0][0].shape) != tuple(pairs[1][0].shape):
        raise ValueError(
            f"out_a of shape {tuple(pairs[0][0].shape)} and out_b of shape "
            f"{tuple(pairs[1][0].shape)} must have the same shape"
        )
    if pairs[0][1].ndim == 0:
        pairs = [(xp.reshape(o, (1,) + tuple(o.shape)), xp.reshape(sl, (1,))) for o, sl in pairs]
        out, lse = merge_attention_states([p[0] for p in pairs], [p[1] for p in pairs],
                                          lse_base=lse_base, empty_lse=empty_lse,
                                          backend=backend)
        return xp.reshape(out, tuple(out.shape[1:])), xp.reshape(lse, ())
    return merge_attention_states([p[0] for p in pairs], [p[1] for p in pairs],
                                  lse_base=lse_base, empty_lse=empty_lse, backend=backend)


def merge_attention_vjp(
    outs: Any,
    lses: Any,
    dout: Any,
    dlse: Any = None,
    axis: int = 0,
    *,
    lse_base: str | int = "e",
    empty_lse: float = -math.inf,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """Gradient of :func:`merge_attention_states` (and so of :func:`merge_attention`).

    With ``a_s = exp(lse_s - lse)`` the weight of partial ``s``:
    ``d out_s = a_s * dout`` and ``d lse_s = a_s * (<dout, out_s - out> + dlse)``; empty
    partials get zero gradient.

    Parameters
    ----------
    outs, lses, axis, lse_base, empty_lse
        As given to :func:`merge_attention_states`.
    dout : array
        Upstream gradient of the merged output (``outs``' shape without ``axis``).
    dlse : array, optional
        Upstream gradient of the merged lse (in ``lse_base``); None means 0.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    douts : array
        ``outs``' shape and dtype.
    dlses : array
        ``lses``' shape, in the accumulator dtype, with respect to ``lses`` in ``lse_base``.
    """
    framework = route(outs, lses, dout, dlse)
    if framework is not None:
        return framework.merge_attention_vjp(
            outs, lses, dout, dlse, axis, lse_base=lse_base, empty_lse=empty_lse, backend=backend
        )
    extra = {"dout": dout, "dlse": dlse}
    xp, base, (outs_a, lses_a, ax, batch, dv), (orr, lr) = _states(
        outs, lses, axis, lse_base, empty_lse, extra
    )
    rows = math.prod(batch)
    dout = args.shaped_floating(xp, dout, "dout", batch + (dv,), orr)
    dr = xp.reshape(dout, (rows, dv))
    dl = None
    if dlse is not None:
        dlse = args.shaped_floating(xp, dlse, "dlse", batch, orr)
        dl = xp.reshape(xp.astype(dlse, lr.dtype), (rows,))
        if base == "2":
            dl = dl / LN2  # d/d lse_e of the base-2 lse
    douts, dlses = run("merge_attention_vjp", xp, orr, backend,
                       outs=orr, lses=lr, dout=dr, dlse=dl)
    if base == "2":
        dlses = dlses * LN2  # lse_e = LN2 * lse_2
    s = lses_a.shape[ax]
    douts = xp.moveaxis(xp.reshape(douts, (s,) + batch + (dv,)), 0, ax)
    dlses = xp.moveaxis(xp.reshape(dlses, (s,) + batch), 0, ax)
    return douts, dlses
