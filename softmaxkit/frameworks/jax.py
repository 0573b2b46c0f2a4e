"""JAX wrappers: ``jax.custom_vjp`` around the library's forward and VJP kernels.

Each differentiable operation is a ``jax.custom_vjp`` whose forward and backward run the
library's own kernels on the host through ``jax.pure_callback``: under ``jit`` the Numba (or
any other) backend the registry chooses for numpy arrays runs as it does eagerly, and the
callback receives host numpy views of CPU buffers (no copy where JAX allows).  ``jax.grad``
therefore uses the library's VJPs and policies (a fully masked row has zero gradient, never
NaN), not the derivative of a reference formula.

Concrete arrays outside any transformation (no tracer among the arguments) skip the
custom_vjp and the callback: the call runs on host views of them and its results become JAX
arrays, as the callback's would.  Each callback is one object per operation and options, so
that JAX compiles its call once, not at every eager call.

``vmap`` works because every static axis is counted from the end and the callbacks use
``vmap_method="broadcast_all"``: a batch dimension is one more leading row dimension.  The
mean of :func:`cross_entropy` is taken here, outside the callback, so that it never spans
vmapped examples.  The public VJP functions themselves are not differentiable (JAX raises
when asked to differentiate a callback).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .. import arguments as _args
from .. import rows as _rows
from ..arguments import AxisError
from ..attention import attention as _attention_fn
from ..attention import attention_vjp as _attention_vjp_fn
from ..attention import merge_attention_states as _merge_fn
from ..attention import merge_attention_vjp as _merge_vjp_fn
from ..paged import check_shapes as _check_paged_shapes
from ..paged import paged_attention as _paged_fn
from ..varlen import check_seqlens as _check_seqlens
from ..varlen import varlen_attention as _varlen_fn
from ..varlen import varlen_attention_vjp as _varlen_vjp_fn

LN2 = math.log(2.0)


def _spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _traced(*values: Any) -> bool:
    """Whether a JAX transformation (``jit``, ``grad``, ``vmap``) traces one of ``values``."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _to_jax(value: Any) -> Any:
    """A host result as a JAX array (other values as they are)."""
    return jnp.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else value


def _host(fn: Any, results: Any, *args: Any) -> Any:
    """``fn(*args)`` on host numpy arrays, under jit and vmap; None arguments pass through.
    ``results`` is one ``jax.ShapeDtypeStruct`` or a tuple of them.

    The callback JAX receives is one object for one ``fn`` and result dtypes: outside ``jit``
    JAX compiles a callback's call once per callback object and shapes, so a new function at
    every call would be compiled at every call (milliseconds).  ``fn`` is therefore made
    once per operation and options (the cached functions below, :func:`_bind`).
    """
    several = isinstance(results, tuple)
    dtypes = tuple(np.dtype(r.dtype) for r in results) if several else np.dtype(results.dtype)
    call = _callback(fn, dtypes)
    if not _traced(*args):
        # concrete arrays, outside jit, grad and vmap: the call itself, with no callback
        out = call(*args)
        return tuple(_to_jax(o) for o in out) if several else _to_jax(out)
    return jax.pure_callback(call, results, *args, vmap_method="broadcast_all")


@functools.lru_cache(maxsize=1024)
def _callback(fn: Any, dtypes: Any) -> Any:
    """The host call of ``fn`` whose results are converted to ``dtypes`` (one, or a tuple)."""
    def call(*host_args: Any) -> Any:
        out = fn(*[None if a is None else np.asarray(a) for a in host_args])
        if isinstance(dtypes, tuple):
            return tuple(np.asarray(o, dtype=d) for o, d in zip(out, dtypes, strict=True))
        return np.asarray(out, dtype=dtypes)

    return call


@functools.lru_cache(maxsize=1024)
def _bound(fn: Any, options: tuple[tuple[str, type, Any], ...]) -> Any:
    return functools.partial(fn, **{name: value for name, _, value in options})


def _bind(fn: Any, **options: Any) -> Any:
    """``fn`` with ``options`` bound, one object for options of equal types and values (see
    :func:`_host`); a fresh one when an option is unhashable."""
    try:
        return _bound(fn, tuple((name, type(v), v) for name, v in sorted(options.items())))
    except TypeError:
        return functools.partial(fn, **options)


def _walk(value: Any, leaf: Any) -> Any:
    """``value`` with ``leaf`` applied to its arrays, through lists, tuples and summaries."""
    from ..summary import Summary

    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, leaf) for v in value)
    if isinstance(value, Summary):
        return Summary(*(_walk(f, leaf) for f in (value.max, value.mass, value.numerator)))
    return leaf(value)


def on_host(fn: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """See :func:`softmaxkit.frameworks.on_host`."""
    arrays: list[Any] = []
    _walk((args, tuple(kwargs.values())),
          lambda v: arrays.append(v) if isinstance(v, jax.Array) else None)
    if not arrays or _traced(*arrays):
        return False, None

    def to_host(v: Any) -> Any:
        return np.asarray(v) if isinstance(v, jax.Array) else v

    out = fn(*_walk(args, to_host), **{k: _walk(v, to_host) for k, v in kwargs.items()})
    return True, _walk(out, _to_jax)


def _differentiable(primal: Any, fwd: Any, bwd: Any, symbolic_zeros: bool = False) -> Any:
    """``primal`` as a ``jax.custom_vjp`` function with ``fwd`` and ``bwd``, called plainly on
    concrete arrays: with no tracer among its arguments (outside ``jit``, ``grad`` and
    ``vmap``) nothing can record the call, and JAX's custom_vjp machinery would cost more
    than the call itself."""
    f = jax.custom_vjp(primal)
    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros)

    def call(*args: Any) -> Any:
        return f(*args) if _traced(*args) else primal(*args)

    return call


def _floating(x: Any) -> jax.Array:
    if not isinstance(x, jax.Array):  # a JAX array is taken as it is (asarray dispatches)
        x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.result_type(float))


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """``axis`` as negative axes (unchanged by vmap's leading batch axis); None is all."""
    if axis is None:
        return tuple(range(-ndim, 0))
    items = [axis] if not isinstance(axis, Sequence) else list(axis)
    out = []
    for a in items:
        a = int(a)
        if not -ndim <= a < ndim:
            raise AxisError(f"axis {a} is out of range for an array with {ndim} dimension(s)")
        out.append(a - ndim if a >= 0 else a)
    return tuple(sorted(out))


def _mask(where: Any, shape: tuple[int, ...]) -> jax.Array | None:
    if where is None:
        return None
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(f"where must be a boolean array; got dtype {where.dtype}")
    return jnp.broadcast_to(where, shape)


def _expand(g: jax.Array, axes: tuple[int, ...], ndim: int) -> jax.Array:
    """A reduction's cotangent with its reduced (negative) axes reinserted as length one."""
    for a in sorted(a + ndim for a in axes):
        g = jnp.expand_dims(g, a)
    return g


# ---------------------------------------------------------------------------------------------
# softmax, log_softmax and their VJPs


@functools.lru_cache(maxsize=256)
def _normalize_fn(op: str, axes: tuple[int, ...], masked: str, out_dtype: Any, x_dtype: Any,
                  backend: str | None) -> Any:
    forward = getattr(_rows, op)
    vjp = getattr(_rows, op + "_vjp")

    def host_forward(x: np.ndarray, w: np.ndarray | None) -> Any:
        return forward(x, axes, where=w, dtype=out_dtype, masked=masked, backend=backend)

    def host_vjp(y: np.ndarray, g: np.ndarray, w: np.ndarray | None) -> Any:
        return vjp(y, g, axes, where=w, backend=backend)

    def f(x: jax.Array, where: jax.Array | None) -> jax.Array:
        return _host(host_forward, _spec(x.shape, out_dtype), x, where)

    def fwd(x, where):
        y = f(x, where)
        return y, (y, where)

    def bwd(res, g):
        y, where = res
        spec = _spec(y.shape, jnp.promote_types(y.dtype, g.dtype))
        gx = _host(host_vjp, spec, y, g, where)
        return gx.astype(x_dtype), None

    return _differentiable(f, fwd, bwd)


def _normalize(op: str, x: Any, axis: Any, where: Any, dtype: Any, masked: str,
               backend: str | None) -> jax.Array:
    x = _floating(x)
    out_dtype = jnp.dtype(dtype) if dtype is not None else x.dtype
    fn = _normalize_fn(op, _axes(axis, x.ndim), masked, out_dtype, x.dtype, backend)
    return fn(x, _mask(where, x.shape))


def softmax(x: Any, axis: Any = None, *, where: Any = None, dtype: Any = None,
            masked: str = "zero", backend: str | None = None) -> jax.Array:
    """:func:`softmaxkit.softmax` for JAX arrays, differentiable with :func:`softmax_vjp`."""
    return _normalize("softmax", x, axis, where, dtype, masked, backend)


def log_softmax(x: Any, axis: Any = None, *, where: Any = None, dtype: Any = None,
                masked: str = "zero", backend: str | None = None) -> jax.Array:
    """:func:`softmaxkit.log_softmax` for JAX arrays, differentiable with its VJP."""
    return _normalize("log_softmax", x, axis, where, dtype, masked, backend)


def _vjp(op: str, y: Any, cotangent: Any, axis: Any, where: Any, backend: str | None) -> Any:
    y, g = _floating(y), _floating(cotangent)
    if g.shape != y.shape:
        raise ValueError(f"cotangent of shape {g.shape} must have the shape {y.shape}")
    axes = _axes(axis, y.ndim)
    spec = _spec(y.shape, jnp.promote_types(y.dtype, g.dtype))
    fn = _bind(_row_vjp, op=op, axes=axes, backend=backend)
    return _host(fn, spec, y, g, _mask(where, y.shape))


def _row_vjp(y: np.ndarray, g: np.ndarray, w: np.ndarray | None, *, op: str,
             axes: tuple[int, ...], backend: str | None) -> Any:
    return getattr(_rows, op)(y, g, axes, where=w, backend=backend)


def softmax_vjp(probs: Any, cotangent: Any, axis: Any = None, *, where: Any = None,
                backend: str | None = None) -> jax.Array:
    """:func:`softmaxkit.softmax_vjp` for JAX arrays (under jit and vmap)."""
    return _vjp("softmax_vjp", probs, cotangent, axis, where, backend)


def log_softmax_vjp(logprobs: Any, cotangent: Any, axis: Any = None, *, where: Any = None,
                    backend: str | None = None) -> jax.Array:
    """:func:`softmaxkit.log_softmax_vjp` for JAX arrays (under jit and vmap)."""
    return _vjp("log_softmax_vjp", logprobs, cotangent, axis, where, backend)


# ---------------------------------------------------------------------------------------------
# logsumexp


@functools.lru_cache(maxsize=256)
def _logsumexp_fn(axes: tuple[int, ...], shape: tuple[int, ...], out_dtype: Any,
                  backend: str | None) -> Any:
    kept = tuple(n for i, n in enumerate(shape) if i - len(shape) not in axes)

    def host(a: np.ndarray, b: np.ndarray | None, w: np.ndarray | None) -> Any:
        return _rows.logsumexp(a, axes, b, return_sign=True, where=w, backend=backend)

    def f(a, b, where):
        spec = (_spec(kept, out_dtype), _spec(kept, out_dtype))
        return _host(host, spec, a, b, where)

    def fwd(a, b, where):
        lse, sign = f(a, b, where)
        return (lse, sign), (a, b, where, lse, sign)

    def bwd(res, cots):
        a, b, where, lse, sign = res
        g = _expand(cots[0], axes, a.ndim)
        if b is None:
            # d lse / d a is the library's softmax over the reduced axes (0 on an empty row)
            p = _normalize_fn("softmax", axes, "zero", a.dtype, a.dtype, backend)(a, where)
            return (p * g).astype(a.dtype), None, None
        # with weights: d log|S| / d a = b exp(a - lse) / sign, d / d b = exp(a - lse) / sign
        lse_k, sign_k = _expand(lse, axes, a.ndim), _expand(sign, axes, a.ndim)
        keep = (b != 0) & jnp.isfinite(lse_k) & (sign_k != 0)
        if where is not None:
            keep = keep & where
        e = jnp.where(keep, jnp.exp(jnp.where(keep, a - lse_k, 0.0)) * sign_k, 0.0) * g
        return (b * e).astype(a.dtype), e.astype(b.dtype), None

    return _differentiable(f, fwd, bwd)


def logsumexp(a: Any, axis: Any = None, b: Any = None, keepdims: bool = False,
              return_sign: bool = False, *, where: Any = None,
              backend: str | None = None) -> Any:
    """:func:`softmaxkit.logsumexp` for JAX arrays, differentiable in ``a`` and ``b``."""
    a = _floating(a)
    if b is not None:
        b = _floating(b)
        a, b = jnp.broadcast_arrays(a, b)
    out_dtype = a.dtype if b is None else jnp.promote_types(a.dtype, b.dtype)
    a = a.astype(out_dtype)
    axes = _axes(axis, a.ndim)
    lse, sign = _logsumexp_fn(axes, a.shape, out_dtype, backend)(
        a, None if b is None else b.astype(out_dtype), _mask(where, a.shape)
    )
    if keepdims:
        lse, sign = _expand(lse, axes, a.ndim), _expand(sign, axes, a.ndim)
    return (lse, sign) if return_sign else lse


# ---------------------------------------------------------------------------------------------
# cross_entropy


@functools.lru_cache(maxsize=256)
def _cross_entropy_rows_fn(axis: int, ignore_index: int | None, smoothing: float,
                           backend: str | None) -> Any:
    """Per-row losses, with the gradient of each from the same fused pass as the residual."""

    def host(logits, target, where):
        return _rows.cross_entropy(logits, target, axis, reduction="none",
                                   ignore_index=ignore_index, label_smoothing=smoothing,
                                   where=where, return_grad=True, backend=backend)

    def call(logits, target, where):
        batch = list(logits.shape)
        del batch[axis]
        spec = (_spec(batch, logits.dtype), _spec(logits.shape, logits.dtype))
        return _host(host, spec, logits, target, where)

    def f(logits, target, where):
        return call(logits, target, where)[0]

    def fwd(logits, target, where):
        losses, grad = call(logits, target, where)
        return losses, (grad, target, logits, where)

    def bwd(res, g):
        grad, target, logits, where = res
        dlogits = grad * jnp.expand_dims(g, axis).astype(grad.dtype)
        dtarget = None
        if jnp.issubdtype(target.dtype, jnp.floating):
            # d loss / d y = -(1 - eps) log_softmax(logits): the library's log_softmax
            logp = _normalize_fn("log_softmax", (axis,), "zero", logits.dtype, logits.dtype,
                                 backend)(
                logits, where)
            dtarget = (-(1.0 - smoothing) * logp * jnp.expand_dims(g, axis)).astype(target.dtype)
        return dlogits, dtarget, None

    return _differentiable(f, fwd, bwd)


def cross_entropy(logits: Any, target: Any, axis: int = -1, *, reduction: str = "mean",
                  ignore_index: int | None = None, label_smoothing: float = 0.0,
                  where: Any = None, return_grad: bool = False,
                  backend: str | None = None) -> Any:
    """:func:`softmaxkit.cross_entropy` for JAX arrays, differentiable in ``logits``.

    The per-row losses and their fused gradient come from one callback; the reduction is taken
    here so that it never mixes examples under ``vmap``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not valid: expected 'mean', 'sum', 'none'")
    logits = _floating(logits)
    if logits.ndim == 0:
        raise ValueError("logits must have at least one dimension (the class axis)")
    ax = _axes(axis, logits.ndim)[0]
    target = jnp.asarray(target)
    if jnp.issubdtype(target.dtype, jnp.floating):
        target = jnp.broadcast_to(target, logits.shape).astype(logits.dtype)
    # concrete arrays: the library's call on host views, its fused gradient included (eager
    # jax.grad would trace the definition below at every call)
    hosted, out = on_host(_rows.cross_entropy, (logits, target, ax),
                          dict(reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, where=where,
                               return_grad=return_grad, backend=backend))
    if hosted:
        return out
    fn = _cross_entropy_rows_fn(ax, None if ignore_index is None else int(ignore_index),
                                float(label_smoothing), backend)
    losses = fn(logits, target, _mask(where, logits.shape))
    scale: Any
    if reduction == "none":
        loss, scale = losses, 1.0
    elif reduction == "sum":
        loss, scale = jnp.sum(losses), 1.0
    else:
        if ignore_index is not None and not jnp.issubdtype(target.dtype, jnp.floating):
            count = jnp.sum(target != ignore_index)
        else:
            count = math.prod(losses.shape)
        # with no row counted the mean (and its gradient) is 0, as the library defines it
        scale = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1), 0.0).astype(logits.dtype)
        loss = jnp.sum(losses) * scale
    loss = loss.astype(logits.dtype)
    if not return_grad:
        return loss
    grad = jax.grad(lambda x: jnp.sum(fn(x, target, _mask(where, logits.shape))) * scale)(logits)
    return loss, jax.lax.stop_gradient(grad)


# ---------------------------------------------------------------------------------------------
# attention


def _result_dtypes(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """The dtypes of attention's ``out`` (q, k, v promoted) and ``lse`` (its accumulator)."""
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype)
    return dtype, (jnp.float64 if dtype == jnp.float64 else jnp.float32)


def _operands(q: Any, k: Any, v: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q``, ``k``, ``v`` as floating arrays of their promoted dtype."""
    q, k, v = _floating(q), _floating(k), _floating(v)
    common = _result_dtypes(q, k, v)[0]
    return q.astype(common), k.astype(common), v.astype(common)


def _options(scale: Any, causal: Any, window: Any, softcap: Any, backend: Any,
             d: int, precision: Any = "float32") -> tuple[tuple[str, Any], ...]:
    """The keyword arguments of attention and varlen_attention, validated, as hashable pairs:
    the key of their cached custom_vjp builders (``d`` is the head dimension)."""
    return (("scale", None if scale is None else _args.attention_scale(scale, d)),
            ("causal", _args.causal(causal) or False), ("window", _args.window(window)),
            ("softcap", _args.softcap(softcap)),
            ("precision", _args.precision(precision, "float32")), ("backend", backend))


def _attention_shapes(q, k, v, mask):
    leads = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    if mask is not None and mask.ndim > 3:
        leads.append(mask.shape[:-3])
    lead = tuple(np.broadcast_shapes(*leads))
    dtype, acc = _result_dtypes(q, k, v)
    hq, lq = q.shape[-3], q.shape[-2]
    return _spec(lead + (hq, lq, v.shape[-1]), dtype), _spec(lead + (hq, lq), acc)


def _is_primal(x: Any) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _recomputing_vjp(forward: Any, vjp: Any, shapes: Any, lse_used: bool) -> Any:
    """A ``jax.custom_vjp`` function ``(q, k, v, *metadata) -> (out, lse)`` whose backward
    recomputes from the saved ``out`` and ``lse``.

    Parameters
    ----------
    forward : callable
        ``forward(q, k, v, *metadata) -> (out, lse)`` on host arrays.
    vjp : callable
        ``vjp(q, k, v, out, lse, dout, dlse, *metadata) -> (dq, dk, dv)`` on host arrays,
        ``dlse`` the lse's cotangent or None.
    shapes : callable
        ``shapes(q, k, v, *metadata)``: the ``jax.ShapeDtypeStruct`` of ``(out, lse)``.
    lse_used : bool
        Whether the lse is returned, so that its cotangent must reach the backward; else it is
        left out.  Cotangents are symbolic zeros where an output does not reach the loss: a
        returned but unused lse is left out too (``dlse`` None).

    Returns
    -------
    callable
        Differentiable in ``q``, ``k``, ``v``; the metadata (a mask, cumulative lengths) gets
        no cotangent.
    """

    def f(q, k, v, *metadata):
        return _host(forward, shapes(q, k, v, *metadata), q, k, v, *metadata)

    def fwd(*primals):
        # symbolic zeros: each argument comes as (value, perturbed); only the values are used
        q, k, v, *metadata = jax.tree.map(lambda p: p.value, primals, is_leaf=_is_primal)
        out, lse = f(q, k, v, *metadata)
        return (out, lse), (q, k, v, metadata, out, lse)  # the backward recomputes from these

    def bwd(res, cots):
        q, k, v, metadata, out, lse = res
        dout, dlse = cots
        if isinstance(dout, SymbolicZero):  # only the lse reaches the loss
            dout = jnp.zeros(out.shape, out.dtype)
        used = lse_used and not isinstance(dlse, SymbolicZero)  # an unused lse: left out
        spec = tuple(_spec(a.shape, a.dtype) for a in (q, k, v))
        dq, dk, dv = _host(vjp, spec, q, k, v, out, lse, dout.astype(out.dtype),
                           dlse.astype(lse.dtype) if used else None, *metadata)
        return (dq, dk, dv) + (None,) * len(metadata)

    return _differentiable(f, fwd, bwd, symbolic_zeros=True)


@functools.lru_cache(maxsize=256)
def _attention_custom(options: tuple, lse_used: bool) -> Any:
    kw = dict(options)
    return _recomputing_vjp(
        lambda q, k, v, m: _attention_fn(q, k, v, mask=m, return_lse=True, **kw),
        lambda q, k, v, o, s, d, dl, m: _attention_vjp_fn(q, k, v, o, s, d, dlse=dl, mask=m,
                                                          **kw),
        _attention_shapes, lse_used,
    )


def attention(q: Any, k: Any, v: Any, *, scale: float | None = None, causal: Any = False,
              window: Any = None, mask: Any = None, softcap: float | None = None,
              return_lse: bool = False, lse_base: Any = "e", precision: str = "float32",
              backend: str | None = None) -> Any:
    """:func:`softmaxkit.attention` for JAX arrays, differentiable in q, k, v (and its lse).

    The forward keeps ``out`` and ``lse``; the backward recomputes from them
    (:func:`softmaxkit.attention_vjp`), as FlashAttention does.
    """
    base = _args.lse_base(lse_base)
    q, k, v = _operands(q, k, v)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array (True = attend); got {mask.dtype}")
        if mask.ndim < 3:
            mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)
    options = _options(scale, causal, window, softcap, backend, q.shape[-1], precision)
    out, lse = _attention_custom(options, bool(return_lse))(q, k, v, mask)
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


def attention_vjp(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, *,
                  dlse: Any = None, scale: float | None = None, causal: Any = False,
                  window: Any = None, mask: Any = None, softcap: float | None = None,
                  lse_base: Any = "e", precision: str = "float32",
                  backend: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`softmaxkit.attention_vjp` for JAX arrays (under jit and vmap)."""
    arrays = [jnp.asarray(a) for a in (q, k, v, out, lse, dout)]
    spec = tuple(_spec(a.shape, a.dtype) for a in arrays[:3])
    fn = _bind(_attention_vjp_host, scale=scale, causal=causal, window=window,
               softcap=softcap, lse_base=lse_base, precision=precision, backend=backend)
    return _host(fn, spec, *arrays, None if dlse is None else jnp.asarray(dlse),
                 None if mask is None else jnp.asarray(mask))


def _attention_vjp_host(q, k, v, o, s, d, dl, m, **options: Any) -> Any:
    return _attention_vjp_fn(q, k, v, o, s, d, dlse=dl, mask=m, **options)


# ---------------------------------------------------------------------------------------------
# merge of partial attention states


def _states(outs: Any, lses: Any, axis: int, empty_lse: Any) -> tuple[Any, Any, int]:
    """Stacked states, lses in the accumulator dtype, -inf for empty, axis counted from the end
    of lses (so a vmapped batch axis never moves it)."""
    empty = _args.empty_lse(empty_lse)
    if isinstance(outs, (list, tuple)):
        outs = jnp.stack([jnp.asarray(o) for o in outs], axis=axis)
    if isinstance(lses, (list, tuple)):
        lses = jnp.stack([jnp.asarray(s) for s in lses], axis=axis)
    outs, lses = _floating(outs), _floating(lses)
    if lses.ndim < 1 or outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"outs of shape {outs.shape} must be lses' shape {lses.shape} plus a trailing "
            "value dimension"
        )
    (ax,) = _axes(axis, lses.ndim)
    lses = lses.astype(jnp.float64 if outs.dtype == jnp.float64 else jnp.float32)
    if empty == math.inf:
        lses = jnp.where(lses == math.inf, -math.inf, lses)
    return outs, lses, ax


@functools.lru_cache(maxsize=64)
def _merge_custom(ax: int, backend: str | None) -> Any:
    def specs(outs, lses):
        batch = list(lses.shape)
        del batch[ax]
        return _spec(batch + [outs.shape[-1]], outs.dtype), _spec(batch, lses.dtype)

    def host_merge(o: np.ndarray, s: np.ndarray) -> Any:
        return _merge_fn(o, s, ax, backend=backend)

    def host_vjp(o: np.ndarray, s: np.ndarray, d: np.ndarray, dl: np.ndarray | None) -> Any:
        return _merge_vjp_fn(o, s, d, dl, ax, backend=backend)

    def f(outs, lses):
        return _host(host_merge, specs(outs, lses), outs, lses)

    def fwd(outs, lses):
        return f(outs, lses), (outs, lses)

    def bwd(res, cots):
        outs, lses = res
        dout, dlse = cots
        spec = (_spec(outs.shape, outs.dtype), _spec(lses.shape, lses.dtype))
        return _host(host_vjp, spec, outs, lses, dout.astype(outs.dtype),
                     dlse.astype(lses.dtype))

    return _differentiable(f, fwd, bwd)


def merge_attention_states(outs: Any, lses: Any, axis: int = 0, *, lse_base: Any = "e",
                           empty_lse: float = -math.inf,
                           backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`softmaxkit.merge_attention_states` for JAX arrays, differentiable in both."""
    base = _args.lse_base(lse_base)
    outs, lses, ax = _states(outs, lses, axis, empty_lse)
    out, lse = _merge_custom(ax, backend)(outs, lses * LN2 if base == "2" else lses)
    return out, (lse / LN2 if base == "2" else lse)


def merge_attention_vjp(outs: Any, lses: Any, dout: Any, dlse: Any = None, axis: int = 0, *,
                        lse_base: Any = "e", empty_lse: float = -math.inf,
                        backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`softmaxkit.merge_attention_vjp` for JAX arrays (under jit and vmap)."""
    # stacked and checked only; the library converts lse_base and empty_lse itself
    outs, lses, ax = _states(outs, lses, axis, -math.inf)
    spec = (_spec(outs.shape, outs.dtype), _spec(lses.shape, lses.dtype))
    fn = _bind(_merge_vjp_host, axis=ax, lse_base=lse_base, empty_lse=empty_lse,
               backend=backend)
    return _host(fn, spec, outs, lses, jnp.asarray(dout),
                 None if dlse is None else jnp.asarray(dlse))


def _merge_vjp_host(o, s, d, dl, **options: Any) -> Any:
    return _merge_vjp_fn(o, s, d, dl, **options)


# ---------------------------------------------------------------------------------------------
# packed variable-length attention


def _varlen_shapes(q, k, v):
    dtype, acc = _result_dtypes(q, k, v)
    tq, hq = q.shape[0], q.shape[1]
    return _spec((tq, hq, v.shape[-1]), dtype), _spec((tq, hq), acc)


def _packed(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> tuple[jax.Array, jax.Array]:
    """Refuse arrays with leading (vmapped) dimensions, packing being the batch already, and
    validate concrete cumulative lengths here, so their errors are raised as they are (a
    traced one is validated in the host callback)."""
    for name, a in zip(("q", "k", "v"), (q, k, v), strict=True):
        if a.ndim != 3:
            raise ValueError(
                f"{name} must have the packed shape [T, H, D]; got {tuple(a.shape)} (vmap over "
                "varlen_attention is not supported: pack the batch into the token axis)"
            )
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    if not _traced(cu_q, cu_k):
        host = np.empty(0)
        _check_seqlens(_args.namespace(x=host), np.asarray(cu_q), np.asarray(cu_k),
                       q.shape[0], k.shape[0], host)
    return cu_q, cu_k


@functools.lru_cache(maxsize=256)
def _varlen_custom(options: tuple, lse_used: bool) -> Any:
    kw = dict(options)
    return _recomputing_vjp(
        lambda q, k, v, cq, ck: _varlen_fn(q, k, v, cq, ck, return_lse=True, **kw),
        lambda q, k, v, o, s, d, dl, cq, ck: _varlen_vjp_fn(q, k, v, o, s, d, cq, ck, dlse=dl,
                                                            **kw),
        lambda q, k, v, cq, ck: _varlen_shapes(q, k, v), lse_used,
    )


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                     scale: float | None = None, causal: Any = False, window: Any = None,
                     softcap: float | None = None, return_lse: bool = False,
                     lse_base: Any = "e", precision: str = "float32",
                     backend: str | None = None) -> Any:
    """:func:`softmaxkit.varlen_attention` for JAX arrays, differentiable in q, k, v (and its
    lse), under ``jit`` (the cumulative lengths are validated in the host callback); not under
    ``vmap``."""
    base = _args.lse_base(lse_base)
    q, k, v = _operands(q, k, v)
    cu_seqlens_q, cu_seqlens_k = _packed(q, k, v, cu_seqlens_q, cu_seqlens_k)
    options = _options(scale, causal, window, softcap, backend, q.shape[-1], precision)
    out, lse = _varlen_custom(options, bool(return_lse))(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


def varlen_attention_vjp(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
                         cu_seqlens_q: Any, cu_seqlens_k: Any, *, dlse: Any = None,
                         scale: float | None = None, causal: Any = False, window: Any = None,
                         softcap: float | None = None, lse_base: Any = "e",
                         precision: str = "float32", backend: str | None = None,
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`softmaxkit.varlen_attention_vjp` for JAX arrays (under jit, not vmap)."""
    arrays = [jnp.asarray(a) for a in (q, k, v, out, lse, dout)]
    cu_seqlens_q, cu_seqlens_k = _packed(arrays[0], arrays[1], arrays[2], cu_seqlens_q,
                                         cu_seqlens_k)
    spec = tuple(_spec(a.shape, a.dtype) for a in arrays[:3])
    fn = _bind(_varlen_vjp_host, scale=scale, causal=causal, window=window,
               softcap=softcap, lse_base=lse_base, precision=precision, backend=backend)
    return _host(fn, spec, *arrays, None if dlse is None else jnp.asarray(dlse), cu_seqlens_q,
                 cu_seqlens_k)


def _varlen_vjp_host(q, k, v, o, s, d, dl, cq, ck, **options: Any) -> Any:
    return _varlen_vjp_fn(q, k, v, o, s, d, cq, ck, dlse=dl, **options)


# ---------------------------------------------------------------------------------------------
# paged attention


def paged_attention(q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any, *,
                    scale: float | None = None, causal: Any = False, window: Any = None,
                    softcap: float | None = None, return_lse: bool = False,
                    lse_base: Any = "e", precision: str = "float32",
                    check_metadata: bool = True, backend: str | None = None) -> Any:
    """:func:`softmaxkit.paged_attention` for JAX arrays, under ``jit`` too: the call runs on
    host arrays (the backend the registry chooses for numpy arrays), in a callback under
    ``jit``, where traced metadata is concrete and checked (unless ``check_metadata=False``)
    before any kernel runs; not differentiable, not under ``vmap``."""
    arrays = [jnp.asarray(a) for a in (q, k_pages, v_pages, block_table, seqlens)]
    _check_paged_shapes(*arrays)
    b, hq, lq, _ = arrays[0].shape
    dtype, acc = _result_dtypes(*arrays[:3])
    spec = (_spec((b, hq, lq, arrays[2].shape[-1]), dtype), _spec((b, hq, lq), acc))
    fn = _bind(_paged_host, scale=scale, causal=causal, window=window, softcap=softcap,
               lse_base=lse_base, precision=precision, check_metadata=check_metadata,
               backend=backend)
    out, lse = _host(fn, spec, *arrays)
    return (out, lse) if return_lse else out


def _paged_host(q, kp, vp, table, lens, **options: Any) -> Any:
    return _paged_fn(q, kp, vp, table, lens, return_lse=True, **options)
