"""The row operations of the public API: softmax, log_softmax, logsumexp, cross_entropy, VJPs.

Each function validates its arguments (:mod:`softmaxkit.arguments`), applies the dtype rules
(:mod:`softmaxkit.dtypes`), views the data as rows along the reduced axes
(:mod:`softmaxkit.layout`) and hands one explicit call to the backend the registry chooses.
What every result is, at every edge, is written in spec/semantics.md.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from . import arguments as args
from . import dtypes
from .dispatch import run, run_bound
from .dtypes import accumulator_dtype, dtype_name, output_dtype, result_float
from .frameworks import imported, route
from .layout import RowLayout
from .registry import Binding, device_type

REDUCTIONS = ("mean", "sum", "none")


def scalar_result(xp: Any, r: Any) -> Any:
    """The result convention for 0-d results: a numpy scalar for numpy inputs (as SciPy and
    numpy's own reductions return), the 0-d array itself for every other library."""
    if r.ndim == 0 and array_api_compat.is_numpy_namespace(xp):
        return r[()]
    return r


def _prepare(x: Any, axis: Any, where: Any, name: str = "x") -> tuple[Any, Any, RowLayout, Any]:
    if where is None:
        key = args.checked_key(x, axis)
        try:
            checked = _CHECKED.get(key) if key is not None else None
        except TypeError:  # an unhashable dtype or shape: checked every time
            checked = key = None
        if checked is not None:
            return checked[0], x, checked[1], None
    xp = args.namespace(**{name: x, "where": where})
    given = x
    x = args.floating(xp, args.as_array(xp, x, name), name)
    layout = RowLayout.of(tuple(x.shape), args.axes(axis, x.ndim))
    w = args.mask(xp, where, tuple(x.shape), like=x)
    if where is None and key is not None and x is given and args.fixed_namespace(xp, x):
        if len(_CHECKED) >= 1024:  # a bound on memory
            _CHECKED.clear()
        _CHECKED[key] = (xp, layout)
    return xp, x, layout, w


_CHECKED: dict[tuple[Any, ...], tuple[Any, RowLayout]] = {}
"""The outcome of :func:`_prepare`'s checks for an unmasked array that needed no conversion,
by :func:`~softmaxkit.arguments.checked_key`: a repeated call of the same kind of array
skips them (they would pass again and give the same namespace and layout)."""


_BOUND: dict[tuple[Any, ...], tuple[Any, RowLayout, Any, Binding]] = {}
"""Unmasked row calls with no ``backend=``, under :func:`_bound_key`: the namespace, layout
and result dtype their checks gave, and the binding of the backend's decision
(:func:`~softmaxkit.registry.bind`).  A repeated call skips the checks (they would pass
again with the same outcome, as for :data:`_CHECKED`) and the decision's lookups; when the
binding says the decision may have changed, the call goes the whole way."""


def _bound_key(op: str, x: Any, axis: Any, *options: Any) -> tuple[Any, ...] | None:
    """What a row call's checks, dtype rules, layout and plan depend on besides the
    properties its binding reads: the operation, ``x``'s type, dtype, shape and device type,
    ``axis`` (see :func:`~softmaxkit.arguments.checked_key`) and the other options."""
    key = args.checked_key(x, axis)
    return None if key is None else (op, *key, device_type(x), *options)


def _run_bound(key: tuple[Any, ...] | None, x: Any,
               **options: Any) -> tuple[Any, RowLayout, Any] | None:
    """A repeated call kept under ``key``: no checks, and its kernel if the decision stands.

    Returns the namespace, layout and the kernel's result on ``x``'s rows, the kernel
    arguments being ``x``'s rows, ``options`` and the kept result dtype (all but the rows
    held by ``key``, so the binding reads the rows alone); the kernel's ``repeat`` form runs
    it where the backend gave one.  None where nothing is kept or the binding says the
    decision may have changed (the call then goes the whole way).
    """
    try:
        bound = _BOUND.get(key) if key is not None else None
    except TypeError:  # an unhashable option or dtype
        return None
    if bound is None:
        return None
    xp, layout, out_dtype, binding = bound
    rows = layout.to_rows(xp, x)
    kernel = binding.kernel_for_array(rows)  # the other arguments are in the key
    if kernel is None:
        return None
    repeat = binding.repeat
    y = None if repeat is None else repeat(rows)
    if y is None:
        y = kernel(xp=xp, x=rows, **options, out_dtype=out_dtype)
    return xp, layout, y


def _keep_bound(key: tuple[Any, ...] | None, xp: Any, x: Any, given: Any, layout: RowLayout,
                out_dtype: Any, binding: Binding | None) -> None:
    """Keep a call's outcome under ``key`` when ``x`` needed no conversion and its type
    decides its namespace (as :func:`_prepare` keeps its checks)."""
    if key is None or binding is None or x is not given or not args.fixed_namespace(xp, x):
        return
    if len(_BOUND) >= 1024:  # a bound on memory
        _BOUND.clear()
    try:
        _BOUND[key] = (xp, layout, out_dtype, binding)
    except TypeError:
        pass


def _raise_on_empty_rows(xp: Any, x: Any, where: Any) -> None:
    """The ``masked="raise"`` policy: refuse rows with no allowed position above -inf."""
    present = x != -float("inf")  # NaN compares unequal, so a NaN row is not empty
    if where is not None:
        present = present & where
    if x.shape[-1] == 0:
        empty = math.prod(x.shape[:-1])
    else:
        empty = int(xp.sum(xp.astype(~xp.any(present, axis=-1), xp.int64)))
    if empty:
        raise args.EmptyRowError(
            f"{empty} row(s) have no allowed position (every entry masked by where= or -inf) "
            "and masked='raise' was asked for; use masked='zero' or 'nan' to accept them"
        )


def _normalize(
    op: str, x: Any, axis: Any, where: Any, dtype: Any, masked: str, backend: str | None
) -> Any:
    key = None
    if where is None and backend is None:
        key = _bound_key(op, x, axis, dtype, masked)
        ran = _run_bound(key, x, where=None, masked=masked)
        if ran is not None:
            xp, layout, y = ran
            y = layout.from_rows(xp, y)
            return y if layout.shape else scalar_result(xp, y)  # 0-d only for a 0-d x
    masked = args.masked_policy(masked)
    given = x
    xp, x, layout, w = _prepare(x, axis, where)
    out_dtype = output_dtype(xp, x.dtype, dtype)
    xr = layout.to_rows(xp, x)
    wr = None if w is None else layout.to_rows(xp, w)
    if masked == "raise":  # checked on every call: never kept
        _raise_on_empty_rows(xp, xr, wr)
        masked, key = "zero", None
    kernel_args = {"x": xr, "where": wr, "masked": masked, "out_dtype": out_dtype}
    if key is None:
        y = run(op, xp, xr, backend, **kernel_args)
    else:
        y, made = run_bound(op, xp, xr, kernel_args)
        _keep_bound(key, xp, x, given, layout, out_dtype, made)
    return scalar_result(xp, layout.from_rows(xp, y))


def softmax(
    x: Any,
    axis: Any = None,
    *,
    where: Any = None,
    dtype: Any = None,
    masked: str = "zero",
    backend: str | None = None,
) -> Any:
    """Softmax along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : array_like
        Logits.  Integer and boolean inputs promote to the default floating dtype.
    axis : int, tuple of ints or None, optional
        Axes the softmax normalizes over; ``None`` (the default, as in SciPy) means all axes.
    where : array_like of bool, optional
        Broadcastable to ``x``; ``False`` excludes a position (probability 0), exactly as a
        logit of ``-inf`` would, never by multiplying by zero.
    dtype : dtype, optional
        Output dtype; the default is the input dtype.  Accumulation is float32 (float64 for
        float64 inputs) whatever the output dtype.
    masked : {"zero", "nan", "raise"}, optional
        Policy for a row with no allowed position: probabilities 0 (default), NaN, or raise
        :class:`~softmaxkit.EmptyRowError`.
    backend : str, optional
        Run on this backend only (strict; raises if it cannot).

    Returns
    -------
    array
        Probabilities, the shape of ``x``, in the caller's array library and device.

    See Also
    --------
    log_softmax, logsumexp, scipy.special.softmax

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> sk.softmax(np.array([20.0, 18.0, 17.0, -5.0])).round(5)
    array([0.84379, 0.1142 , 0.04201, 0.     ])
    """
    framework = route(x, where)
    if framework is not None:
        return framework.softmax(x, axis, where=where, dtype=dtype, masked=masked, backend=backend)
    return _normalize("softmax", x, axis, where, dtype, masked, backend)


def log_softmax(
    x: Any,
    axis: Any = None,
    *,
    where: Any = None,
    dtype: Any = None,
    masked: str = "zero",
    backend: str | None = None,
) -> Any:
    """Logarithm of the softmax along ``axis``: ``x - logsumexp(x)``, computed stably.

    Parameters
    ----------
    x : array_like
        Logits.
    axis : int, tuple of ints or None, optional
        Axes to normalize over; ``None`` means all axes.
    where : array_like of bool, optional
        ``False`` excludes a position; its log-probability is ``-inf``.
    dtype : dtype, optional
        Output dtype (default: the input dtype).
    masked : {"zero", "nan", "raise"}, optional
        Policy for a row with no allowed position: ``-inf`` everywhere (the log of the zero
        probabilities, default), NaN, or raise.
    backend : str, optional
        Run on this backend only.

    Returns
    -------
    array
        Log-probabilities, the shape of ``x``.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> sk.log_softmax(np.array([0.0, 0.0])).round(6)
    array([-0.693147, -0.693147])
    """
    framework = route(x, where)
    if framework is not None:
        return framework.log_softmax(
            x, axis, where=where, dtype=dtype, masked=masked, backend=backend
        )
    return _normalize("log_softmax", x, axis, where, dtype, masked, backend)


def logsumexp(
    a: Any,
    axis: Any = None,
    b: Any = None,
    keepdims: bool = False,
    return_sign: bool = False,
    *,
    where: Any = None,
    backend: str | None = None,
) -> Any:
    """``log(sum(b * exp(a)))`` along ``axis``, computed stably, with SciPy's signature.

    Parameters
    ----------
    a : array_like
        Input.
    axis : int, tuple of ints or None, optional
        Axes to reduce; ``None`` reduces all.
    b : array_like, optional
        Weights broadcastable with ``a``; a zero weight excludes its position (so ``b = 0``
        next to ``a = inf`` contributes nothing, as in SciPy).
    keepdims : bool, optional
        Keep the reduced axes with length one.
    return_sign : bool, optional
        Also return the sign of the sum, so negative sums are representable.  Without it a
        negative sum gives NaN, as in SciPy.
    where : array_like of bool, optional
        ``False`` excludes a position.
    backend : str, optional
        Run on this backend only.

    Returns
    -------
    res : array
        The log of the (absolute) sum; ``-inf`` for an empty or fully excluded row.
    sgn : array
        The sign of the sum (only when ``return_sign``): 1, -1, or 0 for a zero sum.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> sk.logsumexp(np.array([1000.0, 1000.0]))
    np.float64(1000.6931471805599)

    A term far below the maximum is kept (``log1p``), and the sign of a negative sum:

    >>> sk.logsumexp([0.0, -40.0])
    np.float64(4.248354255291589e-18)
    >>> sk.logsumexp([1.0, 2.0], b=[1.0, -1.0], return_sign=True)
    (np.float64(1.5413248546129181), np.float64(-1.0))

    Other libraries get 0-d arrays, in their own dtype promotion:

    >>> import torch
    >>> sk.logsumexp(torch.tensor([2.0, 1.0]), b=torch.tensor([1, -1]))
    tensor(1.5413)
    """
    framework = route(a, b, where)
    if framework is not None:
        return framework.logsumexp(a, axis, b, keepdims, return_sign, where=where, backend=backend)
    key = None
    if b is None and where is None and backend is None:
        key = _bound_key("logsumexp", a, axis, keepdims, return_sign)
        ran = _run_bound(key, a, b=None, where=None, return_sign=bool(return_sign))
        if ran is not None:
            xp, layout, result = ran
            return _reduced(xp, layout, result, keepdims, return_sign)
    given = a
    if b is None:
        xp, a, layout, w = _prepare(a, axis, where, "a")
        out_dtype = a.dtype
    else:
        xp = args.namespace(a=a, b=b, where=where)
        a = args.real(xp, args.as_array(xp, a, "a"), "a")
        b = args.real(xp, args.as_array(xp, b, "b", like=a), "b")
        # the result follows the caller's library's promotion of a and b (torch keeps float32
        # with integer weights); integer operands are converted to it
        out_dtype = result_float(xp, array_api_compat.device(a), a.dtype, b.dtype)
        a, b = (v if dtypes.is_float(xp, v.dtype) else xp.astype(v, out_dtype) for v in (a, b))
        try:
            a, b = xp.broadcast_arrays(a, b)
        except Exception:
            raise ValueError(
                f"b of shape {tuple(b.shape)} does not broadcast with a of shape {tuple(a.shape)}"
            ) from None
        layout = RowLayout.of(tuple(a.shape), args.axes(axis, a.ndim))
        w = args.mask(xp, where, tuple(a.shape), like=a)
    ar, br, wr = layout.to_rows(xp, a), layout.to_rows(xp, b), layout.to_rows(xp, w)
    kernel_args = {"x": ar, "b": br, "where": wr, "return_sign": bool(return_sign),
                   "out_dtype": out_dtype}
    if key is None:
        result = run("logsumexp", xp, ar, backend, **kernel_args)
    else:
        result, made = run_bound("logsumexp", xp, ar, kernel_args)
        _keep_bound(key, xp, a, given, layout, out_dtype, made)
    return _reduced(xp, layout, result, keepdims, return_sign)


def _reduced(xp: Any, layout: RowLayout, result: Any, keepdims: bool, return_sign: bool) -> Any:
    """logsumexp's kernel result (the values, or values and signs) shaped as asked."""
    if return_sign:
        lse, sign = result
        return (scalar_result(xp, layout.reduced(xp, lse, keepdims)),
                scalar_result(xp, layout.reduced(xp, sign, keepdims)))
    return scalar_result(xp, layout.reduced(xp, result, keepdims))


def _labels_on_host(index: Any) -> bool:
    """Whether the class indices can be read (range-checked, counted) without a device read.

    True for concrete arrays in host memory (numpy, torch CPU tensors, array_api_strict's
    CPU device): a pass over memory the caller already holds.  False on an accelerator, where
    a read is a device-to-host synchronization on every call (and an error during CUDA-graph
    capture), for Dask arrays, where it would compute the labels' graph a second time, and
    while ``torch.compile`` traces.  There, out-of-range labels give NaN rows instead
    (spec/semantics.md, "cross_entropy") and the mean's count stays an array.
    """
    if array_api_compat.is_dask_array(index) or device_type(index) != "cpu":
        return False
    torch = imported("torch")
    return not (
        torch is not None and isinstance(index, torch.Tensor) and torch.compiler.is_compiling()
    )


def _check_labels(
    xp: Any, index: Any, valid: Any, n_classes: int, ignore_index: int | None
) -> None:
    """Raise the named ``ValueError`` for class indices outside ``[0, n_classes)``."""
    out_of_range = (index < 0) | (index >= n_classes)
    if valid is not None:
        out_of_range = out_of_range & valid
    if bool(xp.any(out_of_range)):
        raise ValueError(
            f"target holds class indices outside [0, {n_classes})"
            + (f" that are not ignore_index={ignore_index}" if valid is not None else "")
        )


def _mean_scale(xp: Any, valid: Any, logits: Any) -> Any:
    """``1 / count`` of the rows that count, as a 0-d array on the labels' device (labels
    that are not in host memory; on the host the count is read back, which costs less).

    The count is summed in int64 and divided in float64 (float32 where the device has no
    float64), then rounded to the accumulator dtype: the value ``1.0 / count`` in Python
    gave before the count stayed on the device.  A count of 0 gives 1 (the mean of no rows is
    the sum of zeros, 0, with gradient 0).
    """
    count = xp.sum(xp.astype(valid, xp.int64))
    wide = xp.float32 if device_type(logits) == "mps" else xp.float64
    count = xp.astype(count, wide)
    count = xp.where(count > 0, count, xp.ones_like(count))
    # asarray: numpy's arithmetic on 0-d arrays gives numpy scalars
    return xp.asarray(xp.astype(1.0 / count, accumulator_dtype(xp, logits.dtype)))


def cross_entropy(
    logits: Any,
    target: Any,
    axis: int = -1,
    *,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    where: Any = None,
    return_grad: bool = False,
    backend: str | None = None,
) -> Any:
    """Cross-entropy of ``target`` under ``softmax(logits)``, from logits, in one fused pass.

    Parameters
    ----------
    logits : array_like
        Unnormalized log-probabilities; ``axis`` is the class axis.
    target : array_like
        Either class indices (an integer array of ``logits``' shape without ``axis``) or
        probabilities (a floating array broadcastable to ``logits``' shape).  A class index
        outside ``[0, C)`` that is not ``ignore_index`` raises ``ValueError`` when the labels
        are in host memory; on an accelerator, for Dask arrays and under ``torch.compile``
        nothing is read back to check, and its row's loss and gradient are NaN instead.
    axis : int, optional
        The class axis (default -1).
    reduction : {"mean", "sum", "none"}, optional
        ``"mean"`` averages over the rows that count (rows whose index target is not
        ``ignore_index``; the count stays on the device, so the call reads nothing back and
        can be captured in a CUDA graph); ``"none"`` returns the per-row losses.
    ignore_index : int, optional
        Index targets equal to it contribute no loss and no gradient.
    label_smoothing : float, optional
        Mix the target with the uniform distribution over the allowed classes:
        ``y = (1 - eps) * y + eps / C``, as in PyTorch.
    where : array_like of bool, optional
        ``False`` excludes a class for that row, like a ``-inf`` logit: its probability is 0,
        its gradient is 0, and target mass on it makes the row's loss ``+inf``.
    return_grad : bool, optional
        Also return ``d loss / d logits = scale * (softmax(logits) - y)`` from the same pass
        (never ``-y / p``).  For ``reduction="none"`` it is the gradient of the sum of the
        per-row losses.
    backend : str, optional
        Run on this backend only.

    Returns
    -------
    loss : array
        A scalar, or per-row losses for ``reduction="none"``, in ``logits``' dtype.
    dlogits : array
        Only with ``return_grad``: the gradient, ``logits``' shape and dtype.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> x = np.array([[2.0, 0.0, -1.0]])
    >>> round(float(sk.cross_entropy(x, np.array([0]))), 6)
    0.169846
    """
    framework = route(logits, target, where)
    if framework is not None:
        return framework.cross_entropy(
            logits, target, axis, reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, where=where, return_grad=return_grad,
            backend=backend,
        )
    reduction = args.choice(reduction, REDUCTIONS, "reduction")
    smoothing = args.finite_scalar(label_smoothing, "label_smoothing", 0.0, 1.0)
    xp = args.namespace(logits=logits, target=target, where=where)
    logits = args.floating(xp, args.as_array(xp, logits, "logits"), "logits")
    if logits.ndim == 0:
        raise ValueError("logits must have at least one dimension (the class axis)")
    class_axis = args.single_axis(axis, logits.ndim)
    layout = RowLayout.of(tuple(logits.shape), (class_axis,))
    n_classes = logits.shape[class_axis]
    target = args.as_array(xp, target, "target", like=logits)
    index = probs = None
    if args.dtypes.is_integral(xp, target.dtype) and dtype_name(target.dtype) != "bool":
        if tuple(target.shape) != layout.batch_shape:
            raise ValueError(
                f"target holds class indices, so its shape must be logits' shape without the "
                f"class axis, {layout.batch_shape}; got {tuple(target.shape)}"
            )
        index = target
        rows_total = math.prod(index.shape)
        valid = index != ignore_index if ignore_index is not None else None
        on_host = bool(rows_total) and _labels_on_host(index)
        if on_host:
            _check_labels(xp, index, valid, n_classes, ignore_index)
        count: int | None = rows_total  # only a mean reads it
        if valid is not None and rows_total and reduction == "mean":
            # on the host a read of host memory costs less than the array operations of
            # _mean_scale; elsewhere the count stays on the labels' device (None here):
            # reading it back would be a synchronization on every call, illegal in capture
            count = int(xp.sum(xp.astype(valid, xp.int64))) if on_host else None
    elif args.dtypes.is_float(xp, target.dtype):
        if ignore_index is not None:
            raise ValueError("ignore_index applies to class-index targets only")
        probs = args.broadcast_operand(xp, target, tuple(logits.shape), logits, "target")
        probs = layout.to_rows(xp, probs)
        count = math.prod(layout.batch_shape)
    else:
        raise TypeError(
            f"target has dtype {dtype_name(target.dtype)}: expected integer class indices or "
            "floating probabilities"
        )
    w = layout.to_rows(xp, args.mask(xp, where, tuple(logits.shape), like=logits))
    rows = layout.to_rows(xp, logits)
    # the mean is over the rows that count; with none counted the loss and gradient are 0
    if reduction != "mean":
        grad_scale: Any = 1.0
    elif count is None:
        grad_scale = _mean_scale(xp, valid, logits)
    else:
        grad_scale = 1.0 / count if count else 1.0
    loss, grad = run(
        "cross_entropy", xp, rows, backend,
        logits=rows, index=index, probs=probs, where=w,
        ignore_index=None if ignore_index is None else int(ignore_index),
        label_smoothing=smoothing, grad_scale=grad_scale if return_grad else None,
        out_dtype=logits.dtype,
    )
    if reduction == "sum":
        loss = xp.sum(loss)
    elif reduction == "mean":
        # times the scale the gradient uses (1 / count rounded to the accumulator), as before
        # the count moved to the device: the same bits whichever form the scale takes
        loss = xp.sum(loss) * grad_scale
    # a reduced loss of a numpy input is a numpy scalar, like logsumexp's (scalar_result)
    loss = scalar_result(xp, xp.asarray(xp.astype(loss, logits.dtype)))
    if return_grad:
        return loss, layout.from_rows(xp, grad)
    return loss


def _vjp(
    op: str, primal_name: str, primal: Any, cotangent: Any, axis: Any, where: Any,
    backend: str | None,
) -> Any:
    xp = args.namespace(**{primal_name: primal, "cotangent": cotangent, "where": where})
    primal = args.floating(xp, args.as_array(xp, primal, primal_name), primal_name)
    shape = tuple(primal.shape)
    cot = args.as_array(xp, cotangent, "cotangent", like=primal)
    if tuple(cot.shape) != shape:
        raise ValueError(
            f"cotangent of shape {tuple(cot.shape)} must have the shape of {primal_name}, {shape}"
        )
    cot = args.floating(xp, cot, "cotangent")
    layout = RowLayout.of(shape, args.axes(axis, primal.ndim))
    w = args.mask(xp, where, shape, like=primal)
    out_dtype = xp.result_type(primal.dtype, cot.dtype)
    pr, cr, wr = (layout.to_rows(xp, v) for v in (primal, cot, w))
    g = run(op, xp, pr, backend, **{primal_name: pr, "cotangent": cr, "where": wr,
                                     "out_dtype": out_dtype})
    return scalar_result(xp, layout.from_rows(xp, g))


def softmax_vjp(
    probs: Any, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Any:
    """Vector-Jacobian product of :func:`softmax`: ``p * (g - sum(p * g))``, in O(N).

    Parameters
    ----------
    probs : array_like
        The output of :func:`softmax` (with the same ``axis`` and ``where``).
    cotangent : array_like
        The upstream gradient ``g``, the shape of ``probs``.
    axis : int, tuple of ints or None, optional
        The axes the softmax normalized over.
    where : array_like of bool, optional
        The mask given to the softmax; excluded positions get gradient 0.
    backend : str, optional
        Run on this backend only.

    Returns
    -------
    array
        ``d <g, softmax(x)> / d x``, the shape of ``probs``; never forms the Jacobian.
    """
    framework = route(probs, cotangent, where)
    if framework is not None:
        return framework.softmax_vjp(probs, cotangent, axis, where=where, backend=backend)
    return _vjp("softmax_vjp", "probs", probs, cotangent, axis, where, backend)


def log_softmax_vjp(
    logprobs: Any, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Any:
    """Vector-Jacobian product of :func:`log_softmax`: ``g - exp(logp) * sum(g)``, in O(N).

    Parameters
    ----------
    logprobs : array_like
        The output of :func:`log_softmax`.
    cotangent : array_like
        The upstream gradient, the shape of ``logprobs``.
    axis : int, tuple of ints or None, optional
        The axes the log_softmax normalized over.
    where : array_like of bool, optional
        The mask given to the log_softmax; excluded positions (and positions whose
        log-probability is ``-inf``) get gradient 0, so a fully masked row has zero gradient.
    backend : str, optional
        Run on this backend only.

    Returns
    -------
    array
        ``d <g, log_softmax(x)> / d x``, the shape of ``logprobs``.
    """
    framework = route(logprobs, cotangent, where)
    if framework is not None:
        return framework.log_softmax_vjp(logprobs, cotangent, axis, where=where, backend=backend)
    return _vjp("log_softmax_vjp", "logprobs", logprobs, cotangent, axis, where, backend)
