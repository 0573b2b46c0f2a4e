"""Packed variable-length attention and its gradient.

A batch of sequences of different lengths is packed along one token axis, without padding:
``q`` is ``[Tq, Hq, D]`` and sequence ``b`` owns the query rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and the key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
(the FlashAttention ``varlen`` layout).  Each sequence attends only within itself, exactly as
:func:`softmaxkit.attention` would on that sequence alone.  spec/semantics.md, "Packed
variable-length attention", is the contract; the cumulative lengths are validated here, on the
host, before any kernel runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import arguments as args
from .attention import (
    in_common_dtype,
    kernel_args,
    keyless_rows_ignore,
    lse_cotangent,
    lse_in_base,
    vjp_operands,
)
from .dispatch import run
from .frameworks import route
from .metadata import host_integers, index_array, validated


class _Packed:
    """Shapes of packed q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv], checked."""

    def __init__(self, q: Any, k: Any, v: Any) -> None:
        for name, a, layout in (("q", q, "[Tq, Hq, D]"), ("k", k, "[Tk, Hk, D]"),
                                ("v", v, "[Tk, Hk, Dv]")):
            if a.ndim != 3:
                raise ValueError(
                    f"{name} must have the packed shape {layout} (tokens of every sequence "
                    f"along the first axis); got {tuple(a.shape)}"
                )
        self.tq, self.hq, self.d = q.shape
        self.tk, self.hk, dk = k.shape
        if dk != self.d:
            raise ValueError(f"q's head dim {self.d} differs from k's {dk}")
        if tuple(v.shape[:2]) != (self.tk, self.hk):
            raise ValueError(
                f"v of shape {tuple(v.shape)} must be [Tk, Hk, Dv] with (Tk, Hk) = "
                f"{(self.tk, self.hk)} from k"
            )
        self.dv = v.shape[2]
        args.grouped_query_heads(self.hq, self.hk)


def cu_seqlens(
    xp: Any, value: Any, name: str, total: int, what: str, like: Any
) -> tuple[Any, np.ndarray]:
    """Validate cumulative sequence lengths; return them as int64 on ``like``'s device, and
    their values on the host.

    Parameters
    ----------
    xp : namespace
        The caller's array namespace.
    value : array or sequence of int
        ``[B + 1]`` cumulative lengths: int32 or int64, starting at 0, never decreasing,
        ending at ``total``.
    name : str
        The argument's name, for the errors.
    total : int
        The packed length (``Tq`` or ``Tk``) the last entry must equal.
    what : str
        How the packed length is called in the errors (``"Tq = q.shape[0]"``).
    like : array
        The array whose device the result goes to (a Python sequence is converted there).

    Returns
    -------
    (array, numpy.ndarray)
        The lengths as an int64 array of ``xp`` and as a host int64 array.

    Raises
    ------
    TypeError
        A dtype other than int32 or int64.
    ValueError
        Not one-dimensional, empty, not starting at 0, decreasing, or not ending at ``total``.
    """
    a = index_array(xp, value, name, like, "cumulative sequence lengths")
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(
            f"{name} of shape {tuple(a.shape)} must be one-dimensional [B + 1] with at least "
            "one entry (the cumulative lengths, starting at 0)"
        )
    host = host_integers(a, name, "varlen_attention validates cu_seqlens_q and cu_seqlens_k")
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0; got {int(host[0])}")
    steps = np.diff(host)
    if np.any(steps < 0):
        b = int(np.argmax(steps < 0))
        raise ValueError(
            f"{name} decreases from {int(host[b])} to {int(host[b + 1])} at entry {b + 1}: "
            "cumulative lengths never decrease"
        )
    if host[-1] > total:
        raise ValueError(
            f"{name} ends at {int(host[-1])}, past the packed length {what} = {total}"
        )
    if host[-1] < total:
        raise ValueError(
            f"{name} ends at {int(host[-1])}, before the packed length {what} = {total}: its "
            "last entry must equal the packed length (every token belongs to a sequence)"
        )
    return xp.astype(a, xp.int64, copy=False), host


def check_seqlens(
    xp: Any, cu_q: Any, cu_k: Any, tq: int, tk: int, like: Any
) -> tuple[tuple[Any, np.ndarray], tuple[Any, np.ndarray]]:
    """Validate both cumulative lengths (:func:`cu_seqlens`) and that they count the same
    sequences; return each as an int64 array of ``xp`` on ``like``'s device with its host
    values."""
    cq, hq = cu_seqlens(xp, cu_q, "cu_seqlens_q", tq, "Tq = q.shape[0]", like)
    ck, hk = cu_seqlens(xp, cu_k, "cu_seqlens_k", tk, "Tk = k.shape[0]", like)
    if hq.shape != hk.shape:
        raise ValueError(
            f"cu_seqlens_q has {hq.shape[0]} entries and cu_seqlens_k {hk.shape[0]}: both "
            "must be [B + 1] for the same B sequences"
        )
    return (cq, hq), (ck, hk)


def _prepare(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, extra: dict[str, Any] | None = None):
    arrays = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
              **(extra or {})}
    xp = args.namespace(**arrays)
    q, k, v = args.attention_operands(xp, q, k, v)
    dims = _Packed(q, k, v)
    seqlens = check_seqlens(xp, cu_q, cu_k, dims.tq, dims.tk, q)
    return xp, dims, (q, k, v), in_common_dtype(xp, q, k, v), seqlens


class VarlenGradient:
    """The gradient of one packed attention call whose arguments are checked and whose
    cumulative lengths are read to the host: what :func:`varlen_attention_vjp` runs once it
    has validated its own, and what an autograd backward runs directly with the forward's
    operands, ``out`` and ``lse`` and a cotangent of ``out``'s shape and dtype, without
    reading the lengths from the device again (as
    :class:`softmaxkit.attention.AttentionGradient`, it holds no array of the call).

    Parameters
    ----------
    xp : namespace
        The call's array namespace.
    host_lengths : tuple of numpy.ndarray
        The host values of ``cu_seqlens_q`` and ``cu_seqlens_k`` (:func:`check_seqlens`).
    scalars : dict
        The backend call's ``scale``, ``causal``, ``window``, ``softcap`` and ``precision``
        (:func:`softmaxkit.attention.kernel_args`).
    backend : str or None
        The ``backend=`` asked for.
    """

    __slots__ = ("xp", "host_lengths", "scalars", "backend")

    def __init__(self, xp: Any, host_lengths: tuple[np.ndarray, np.ndarray],
                 scalars: dict[str, Any], backend: str | None) -> None:
        self.xp, self.host_lengths = xp, host_lengths
        self.scalars, self.backend = scalars, backend

    def __call__(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                 out: Any, lse: Any, dout: Any, dlse: Any = None) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` for the checked operands and lengths, ``out``, ``dout``
        ``[Tq, Hq, Dv]`` (the operands' common dtype), the natural-log ``lse`` ``[Tq, Hq]``
        in the accumulator dtype and ``dlse`` (its shape and dtype) or None; typed like q,
        k, v."""
        xp = self.xp
        seqlens = tuple((xp.astype(cu, xp.int64, copy=False), host) for cu, host
                        in zip((cu_seqlens_q, cu_seqlens_k), self.host_lengths, strict=True))
        return self.laid_out((q, k, v), in_common_dtype(xp, q, k, v), seqlens, out, lse, dout, dlse)

    def laid_out(self, operands: tuple, flat: tuple, seqlens: tuple, out: Any, lse: Any,
                 dout: Any, dlse: Any) -> tuple[Any, Any, Any]:
        """:meth:`__call__` of q, k, v (``operands``) in their common dtype (``flat``) and
        the lengths as :func:`check_seqlens` gives them (``seqlens``)."""
        qf, kf, vf = flat
        (cq, _), (ck, _) = seqlens
        dlse = keyless_rows_ignore(self.xp, dlse, lse)
        with validated(*seqlens):  # a backend reading the lengths gets the host values
            grads = run("varlen_attention_vjp", self.xp, qf, self.backend, q=qf, k=kf, v=vf,
                        out=out, lse=lse, dout=dout, dlse=dlse, cu_seqlens_q=cq,
                        cu_seqlens_k=ck, **self.scalars)
        return tuple(args.cast(self.xp, g, a.dtype)
                     for g, a in zip(grads, operands, strict=True))


def varlen_attention_with_gradient(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, scale: float | None,
    causal: bool | str, window: tuple[int, int] | None, softcap: float | None,
    precision: str, backend: str | None,
) -> tuple[Any, Any, VarlenGradient]:
    """:func:`varlen_attention`'s ``out`` and natural-log ``lse`` on the plain path (no
    framework routing), and the call's :class:`VarlenGradient`, for an autograd forward
    whose backward then skips the checks (and the reading of the lengths) already made."""
    options = args.attention_options(causal, window, softcap)
    args.precision(precision, "float32")
    xp, dims, _, (qf, kf, vf), seqlens = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scalars = kernel_args(scale, options, precision, dims.d, qf.dtype)
    (cq, host_q), (ck, host_k) = seqlens
    with validated(*seqlens):
        out, lse = run("varlen_attention", xp, qf, backend, q=qf, k=kf, v=vf,
                       cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, **scalars)
    return out, lse, VarlenGradient(xp, (host_q, host_k), scalars, backend)


def varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    lse_base: str | int = "e",
    precision: str = "float32",
    backend: str | None = None,
) -> Any:
    """Exact attention over a batch of variable-length sequences packed along one axis.

    Sequence ``b`` is the query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` and the
    key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and ``v``; it attends only to
    its own keys, and its result is :func:`softmaxkit.attention` of that sequence alone.

    Parameters
    ----------
    q : array
        Packed queries ``[Tq, Hq, D]``.
    k : array
        Packed keys ``[Tk, Hk, D]``; ``Hq`` must be a multiple of ``Hk`` (grouped-query
        attention, as in :func:`softmaxkit.attention`).
    v : array
        Packed values ``[Tk, Hk, Dv]``.
    cu_seqlens_q : array of int32 or int64
        ``[B + 1]`` cumulative query lengths: ``0``, then non-decreasing, the last equal to
        ``Tq``.  Read on the host to be validated (one device-to-host copy for device arrays).
    cu_seqlens_k : array of int32 or int64
        ``[B + 1]`` cumulative key lengths, the last equal to ``Tk``.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    causal : bool or {"bottom_right", "top_left"}, optional
        As in :func:`softmaxkit.attention`, with each sequence's own lengths: ``True`` or
        ``"bottom_right"`` lets query ``i`` of a sequence see its keys ``j <= i + Lk - Lq``,
        ``"top_left"`` its keys ``j <= i``.
    window : (int, int), optional
        Sliding window ``(left, right)`` within each sequence, aligned like ``causal``.
    softcap : float, optional
        Apply ``softcap * tanh(s / softcap)`` to the scaled scores (0 or None: no cap).
    return_lse : bool, optional
        Also return the log-sum-exp of each query row's allowed scores.
    lse_base : {"e", 2}, optional
        Base of the returned log-sum-exp: natural (default) or 2.
    precision : {"float32", "tf32x3", "tf32"}, optional
        The least precision of the products of float32 inputs the caller accepts, as for
        :func:`softmaxkit.attention`; ignored for other dtypes.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    out : array
        ``[Tq, Hq, Dv]`` in the promoted dtype of q, k, v; 0 for a query row with no allowed
        key (every query of a sequence with no keys, for one).
    lse : array
        Only with ``return_lse``: ``[Tq, Hq]`` in float32 (float64 for float64 inputs);
        ``-inf`` for a row with no allowed key.

    Raises
    ------
    TypeError
        ``cu_seqlens_q`` or ``cu_seqlens_k`` is not int32 or int64.
    ValueError
        Cumulative lengths that do not start at 0, decrease, or do not end at the packed
        length; ``cu_seqlens_q`` and ``cu_seqlens_k`` of different lengths; shapes that do not
        match.  The error names the argument, and nothing runs.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(7, 2, 8)), rng.normal(size=(9, 2, 8)), rng.normal(size=(9, 2, 4))
    >>> cu_q, cu_k = np.array([0, 3, 7]), np.array([0, 4, 9])  # two sequences
    >>> out = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    >>> out.shape
    (7, 2, 4)
    >>> second = sk.attention(q[3:].transpose(1, 0, 2), k[4:].transpose(1, 0, 2),
    ...                       v[4:].transpose(1, 0, 2), causal=True)
    >>> bool(np.allclose(out[3:], second.transpose(1, 0, 2)))
    True
    """
    framework = route(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if framework is not None:
        return framework.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, window=window,
            softcap=softcap, return_lse=return_lse, lse_base=lse_base, precision=precision,
            backend=backend,
        )
    # the options are checked before the metadata is read
    base = args.lse_base(lse_base)
    options = args.attention_options(causal, window, softcap)
    args.precision(precision, "float32")
    xp, dims, _, (qf, kf, vf), seqlens = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k)
    (cq, _), (ck, _) = seqlens
    with validated(*seqlens):  # a backend reading the lengths gets the values read here
        out, lse = run(
            "varlen_attention", xp, qf, backend, q=qf, k=kf, v=vf, cu_seqlens_q=cq,
            cu_seqlens_k=ck, return_lse=bool(return_lse),
            **kernel_args(scale, options, precision, dims.d, qf.dtype),
        )
    if not return_lse:
        return out
    return out, lse_in_base(lse, base)


def varlen_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    dlse: Any = None,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    lse_base: str | int = "e",
    precision: str = "float32",
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """Gradient of :func:`varlen_attention`: ``(dq, dk, dv)`` for the upstream gradients
    ``dout`` and, where the loss uses the log-sum-exp too, ``dlse``.

    Computed by recomputation from ``lse``, as :func:`softmaxkit.attention_vjp` is: a query row
    with no allowed key (``lse = -inf``) has zero gradient, and a key of a sequence with no
    queries has ``dk = dv = 0``.

    Parameters
    ----------
    q, k, v : array
        The forward's packed inputs.
    out, lse : array
        The forward's output ``[Tq, Hq, Dv]`` and log-sum-exp ``[Tq, Hq]``
        (``varlen_attention(..., return_lse=True)``).
    dout : array
        Upstream gradient, the shape of ``out``.
    dlse : array, optional
        Upstream gradient of the returned ``lse`` (``[Tq, Hq]``, in ``lse_base``), as for
        :func:`softmaxkit.attention_vjp`: one term of each row's ``rowsum(dout * out) -
        dlse``.
    cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap
        The forward's arguments, unchanged.
    lse_base : {"e", 2}, optional
        The base ``lse`` (and ``dlse``) is given in.
    precision : {"float32", "tf32x3", "tf32"}, optional
        The least precision of the products of float32 inputs the caller accepts, as for
        :func:`softmaxkit.attention`; ignored for other dtypes.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    dq, dk, dv : array
        Shaped and typed like ``q``, ``k``, ``v`` (``dk``, ``dv`` summed over each group of
        query heads).

    Raises
    ------
    TypeError, ValueError
        As for :func:`varlen_attention`, and for ``out``, ``lse`` or ``dout`` of the wrong
        shape.
    """
    framework = route(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, dlse)
    if framework is not None:
        return framework.varlen_attention_vjp(
            q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, dlse=dlse, scale=scale,
            causal=causal, window=window, softcap=softcap, lse_base=lse_base,
            precision=precision, backend=backend,
        )
    # the options are checked before the metadata is read
    base = args.lse_base(lse_base)
    options = args.attention_options(causal, window, softcap)
    args.precision(precision, "float32")
    extra = {"out": out, "lse": lse, "dout": dout} | ({} if dlse is None else {"dlse": dlse})
    xp, dims, operands, flat, seqlens = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, extra)
    out_f, lse_f, dout_f = vjp_operands(
        xp, out, lse, dout, (dims.tq, dims.hq, dims.dv), flat[0], base
    )
    dlse_f = None if dlse is None else lse_cotangent(xp, dlse, lse_f, (dims.tq, dims.hq),
                                                     flat[0], base)
    scalars = kernel_args(scale, options, precision, dims.d, flat[0].dtype)
    gradient = VarlenGradient(xp, (seqlens[0][1], seqlens[1][1]), scalars, backend)
    return gradient.laid_out(operands, flat, seqlens, out_f, lse_f, dout_f, dlse_f)
