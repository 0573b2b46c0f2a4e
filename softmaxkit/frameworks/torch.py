"""PyTorch custom operators for the differentiable operations, with the library's VJPs.

Each operation is one ``torch.library.custom_op`` (namespace ``softmaxkit``) with a fake
implementation for ``torch.compile`` and an autograd formula, so autograd, ``torch.compile``
and CUDA graphs see one opaque operator.  An operator's implementation calls the public
function's plain path (dispatch through the registry, unchanged); its backward calls the
library's own VJP operators on the same backend:

- softmax, log_softmax: ``softmax_vjp`` / ``log_softmax_vjp`` from the saved output;
- logsumexp: the softmax of the input (with weights ``b``: ``b * exp(a - lse)``);
- cross_entropy: the gradient the fused forward computed in the same pass, and nothing else
  (on a GPU its implementation reads nothing back to the host: the mean's count stays on the
  device and labels are not range-checked there, so it can be captured in a CUDA graph);
- attention: ``attention_vjp`` recomputing from the saved ``out`` and ``lse``;
- merge_attention_states: ``merge_attention_vjp``;
- varlen_attention: ``varlen_attention_vjp`` recomputing from the saved ``out`` and ``lse``.

Second derivatives are not implemented: differentiating a backward raises an error that names
the operation.  Arguments that have no gradient formula (for example probabilities as
cross-entropy targets that require grad) raise at the call, never drop the gradient.

The functions below take the public signatures; the public functions hand a call here when
:func:`softmaxkit.frameworks.route` says autograd or ``torch.compile`` could record it.
"""

import math
from collections.abc import Sequence
from typing import Any

import array_api_compat
import torch
from torch import Tensor

from .. import arguments as _args
from .. import rows as _rows
from ..attention import attention as _attention_fn
from ..attention import attention_vjp as _attention_vjp_fn
from ..attention import merge_attention_states as _merge_fn
from ..attention import merge_attention_vjp as _merge_vjp_fn
from ..varlen import varlen_attention as _varlen_fn
from ..varlen import varlen_attention_vjp as _varlen_vjp_fn

LN2 = math.log(2.0)


class DoubleBackwardError(NotImplementedError):
    """A second derivative through a softmaxkit operator was asked for."""


def _no_double_backward(name: str):
    def backward(ctx: Any, *grads: Any) -> Any:
        raise DoubleBackwardError(
            f"softmaxkit.{name} has no second derivative: double backward through it "
            "(create_graph=True, then differentiating the gradient) is not supported"
        )
    return backward


def _no_setup(ctx: Any, inputs: Any, output: Any) -> None:
    pass


def _axes(axis: Any, ndim: int) -> list[int] | None:
    """``axis`` (None, int or ints) as sorted non-negative ints; None means all axes."""
    if axis is None:
        return None
    items = [axis] if not isinstance(axis, Sequence) else list(axis)
    out = []
    for a in items:
        a = int(a)
        out.append(a + ndim if a < 0 else a)
    return sorted(out)


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(like: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _tensor_or_none(value: Any, like: Tensor, name: str) -> Tensor | None:
    """``value`` as a tensor on ``like``'s device; Python scalars and sequences convert."""
    if value is None or isinstance(value, Tensor):
        return value
    if array_api_compat.is_array_api_obj(value):
        raise TypeError(
            f"{name} is a {type(value).__module__.split('.')[0]} array while the other "
            "arguments are torch tensors; pass arrays of one library"
        )
    return torch.as_tensor(value, device=like.device)


def _expand_reduced(g: Tensor, axes: list[int] | None, ndim: int, keepdims: bool) -> Tensor:
    """Reinsert the reduced axes of a reduction's cotangent as length-one axes."""
    if keepdims:
        return g
    for a in range(ndim) if axes is None else axes:
        g = g.unsqueeze(a)
    return g


# ---------------------------------------------------------------------------------------------
# softmax and log_softmax


def _normalize_op(name: str):
    @torch.library.custom_op(f"softmaxkit::{name}", mutates_args=())
    def op(
        x: Tensor, axis: list[int] | None, where: Tensor | None,
        dtype: torch.dtype | None, masked: str, backend: str | None,
    ) -> Tensor:
        fn = getattr(_rows, name)
        ax = None if axis is None else tuple(axis)
        with torch.no_grad():
            y = fn(x, ax, where=where, dtype=dtype, masked=masked, backend=backend)
        return y.contiguous()

    @op.register_fake
    def _(x, axis, where, dtype, masked, backend):
        return _empty(x, x.shape, dtype or _float_dtype(x.dtype))

    return op


def _vjp_op(name: str):
    @torch.library.custom_op(f"softmaxkit::{name}", mutates_args=())
    def op(
        y: Tensor, cotangent: Tensor, axis: list[int] | None, where: Tensor | None,
        backend: str | None,
    ) -> Tensor:
        fn = getattr(_rows, name)
        ax = None if axis is None else tuple(axis)
        with torch.no_grad():
            return fn(y, cotangent, ax, where=where, backend=backend).contiguous()

    @op.register_fake
    def _(y, cotangent, axis, where, backend):
        return _empty(y, y.shape, torch.promote_types(y.dtype, cotangent.dtype))

    op.register_autograd(_no_double_backward(name), setup_context=_no_setup)
    return op


softmax_op = _normalize_op("softmax")
log_softmax_op = _normalize_op("log_softmax")
softmax_vjp_op = _vjp_op("softmax_vjp")
log_softmax_vjp_op = _vjp_op("log_softmax_vjp")


def _normalize_setup(ctx: Any, inputs: Any, output: Tensor) -> None:
    x, axis, where, _, _, backend = inputs
    ctx.axis, ctx.backend, ctx.x_dtype = axis, backend, x.dtype
    ctx.save_for_backward(output, where)


def _normalize_backward(vjp: Any):
    def backward(ctx: Any, grad: Tensor) -> tuple:
        y, where = ctx.saved_tensors
        gx = vjp(y, grad, ctx.axis, where, ctx.backend)
        return gx.to(ctx.x_dtype), None, None, None, None, None
    return backward


softmax_op.register_autograd(_normalize_backward(softmax_vjp_op), setup_context=_normalize_setup)
log_softmax_op.register_autograd(
    _normalize_backward(log_softmax_vjp_op), setup_context=_normalize_setup
)


def softmax(
    x: Tensor, axis: Any = None, *, where: Any = None, dtype: Any = None,
    masked: str = "zero", backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.softmax` as the differentiable operator ``softmaxkit::softmax``."""
    return softmax_op(
        x, _axes(axis, x.ndim), _tensor_or_none(where, x, "where"), dtype, masked, backend
    )


def log_softmax(
    x: Tensor, axis: Any = None, *, where: Any = None, dtype: Any = None,
    masked: str = "zero", backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.log_softmax` as the differentiable operator ``softmaxkit::log_softmax``."""
    return log_softmax_op(
        x, _axes(axis, x.ndim), _tensor_or_none(where, x, "where"), dtype, masked, backend
    )


def softmax_vjp(
    probs: Tensor, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.softmax_vjp` as an operator (no second derivative)."""
    return softmax_vjp_op(
        probs, _tensor_or_none(cotangent, probs, "cotangent"), _axes(axis, probs.ndim),
        _tensor_or_none(where, probs, "where"), backend,
    )


def log_softmax_vjp(
    logprobs: Tensor, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.log_softmax_vjp` as an operator (no second derivative)."""
    return log_softmax_vjp_op(
        logprobs, _tensor_or_none(cotangent, logprobs, "cotangent"), _axes(axis, logprobs.ndim),
        _tensor_or_none(where, logprobs, "where"), backend,
    )


# ---------------------------------------------------------------------------------------------
# logsumexp


@torch.library.custom_op("softmaxkit::logsumexp", mutates_args=())
def logsumexp_op(
    a: Tensor, axis: list[int] | None, b: Tensor | None, keepdims: bool,
    where: Tensor | None, backend: str | None,
) -> Tensor:
    ax = None if axis is None else tuple(axis)
    with torch.no_grad():
        out = _rows.logsumexp(a, ax, b, keepdims, where=where, backend=backend)
    return out.contiguous()


@logsumexp_op.register_fake
def _(a, axis, b, keepdims, where, backend):
    shape = list(a.shape if b is None else torch.broadcast_shapes(a.shape, b.shape))
    dtype = _float_dtype(a.dtype)
    if b is not None:
        dtype = torch.promote_types(dtype, _float_dtype(b.dtype))
    axes = range(len(shape)) if axis is None else axis
    for i in sorted(axes, reverse=True):
        if keepdims:
            shape[i] = 1
        else:
            del shape[i]
    return _empty(a, shape, dtype)


def _logsumexp_setup(ctx: Any, inputs: Any, output: Tensor) -> None:
    a, axis, b, keepdims, where, backend = inputs
    ctx.axis, ctx.keepdims, ctx.backend = axis, keepdims, backend
    ctx.save_for_backward(a, b, where, output)


def _logsumexp_backward(ctx: Any, grad: Tensor) -> tuple:
    a, b, where, lse = ctx.saved_tensors
    g = _expand_reduced(grad, ctx.axis, a.ndim, ctx.keepdims)
    if b is None:
        # d lse / d a is the softmax of a over the reduced axes (0 on a fully masked row)
        p = softmax_op(a, ctx.axis, where, None, "zero", ctx.backend)
        return (p * g).to(a.dtype), None, None, None, None, None
    # with weights: d lse / d a = b exp(a - lse), d lse / d b = exp(a - lse); excluded
    # positions (where False, b == 0) and empty rows (lse = -inf) get 0, never NaN
    lse_k = _expand_reduced(lse, ctx.axis, a.ndim, ctx.keepdims)
    keep = (b != 0) & torch.isfinite(lse_k)
    if where is not None:
        keep = keep & where
    e = torch.where(keep, torch.exp(a.to(lse.dtype) - lse_k), 0.0) * g
    ga = (b * e).sum_to_size(a.shape).to(a.dtype)
    gb = e.sum_to_size(b.shape).to(b.dtype) if ctx.needs_input_grad[2] else None
    return ga, None, gb, None, None, None


logsumexp_op.register_autograd(_logsumexp_backward, setup_context=_logsumexp_setup)


def logsumexp(
    a: Tensor, axis: Any = None, b: Any = None, keepdims: bool = False,
    return_sign: bool = False, *, where: Any = None, backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.logsumexp` as the differentiable operator ``softmaxkit::logsumexp``."""
    if return_sign:
        raise NotImplementedError(
            "softmaxkit.logsumexp with return_sign=True has no gradient formula and no "
            "torch.compile operator; call it on detached tensors outside torch.compile, or "
            "without return_sign"
        )
    b = _tensor_or_none(b, a, "b")
    ndim = a.ndim if b is None else max(a.ndim, b.ndim)
    return logsumexp_op(
        a, _axes(axis, ndim), b, bool(keepdims), _tensor_or_none(where, a, "where"), backend
    )


# ---------------------------------------------------------------------------------------------
# cross_entropy


@torch.library.custom_op("softmaxkit::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: Tensor, target: Tensor, axis: int, reduction: str, ignore_index: int | None,
    label_smoothing: float, where: Tensor | None, need_grad: bool, backend: str | None,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        result = _rows.cross_entropy(
            logits, target, axis, reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, where=where, return_grad=need_grad,
            backend=backend,
        )
    if need_grad:
        loss, grad = result
        return loss.contiguous(), grad.contiguous()
    return result.contiguous(), logits.new_empty(0)


@cross_entropy_op.register_fake
def _(logits, target, axis, reduction, ignore_index, label_smoothing, where, need_grad,
      backend):
    if reduction == "none":
        shape = list(logits.shape)
        del shape[axis]
    else:
        shape = []
    grad_shape = logits.shape if need_grad else (0,)
    return _empty(logits, shape, logits.dtype), _empty(logits, grad_shape, logits.dtype)


def _cross_entropy_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    ctx.axis, ctx.reduction = inputs[2], inputs[3]
    ctx.save_for_backward(output[1])  # the fused gradient: all the backward needs


def _cross_entropy_backward(ctx: Any, grad_loss: Tensor, grad_grad: Any) -> tuple:
    (dlogits,) = ctx.saved_tensors
    g = grad_loss.unsqueeze(ctx.axis) if ctx.reduction == "none" else grad_loss
    return (dlogits * g).to(dlogits.dtype), None, None, None, None, None, None, None, None


cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


def cross_entropy(
    logits: Tensor, target: Any, axis: int = -1, *, reduction: str = "mean",
    ignore_index: int | None = None, label_smoothing: float = 0.0, where: Any = None,
    return_grad: bool = False, backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.cross_entropy` as the operator ``softmaxkit::cross_entropy``.

    The forward computes the gradient with respect to ``logits`` in the same fused pass and
    saves only that; the backward scales it by the incoming gradient.
    """
    target = _tensor_or_none(target, logits, "target")
    if target.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "softmaxkit.cross_entropy is differentiable with respect to logits only; the "
            "target requires grad (detach it, or use -sum(target * log_softmax(logits)))"
        )
    need_grad = return_grad or (logits.requires_grad and torch.is_grad_enabled())
    ax = int(axis)
    loss, grad = cross_entropy_op(
        logits, target, ax + logits.ndim if ax < 0 else ax, reduction,
        None if ignore_index is None else int(ignore_index), float(label_smoothing),
        _tensor_or_none(where, logits, "where"), bool(need_grad), backend,
    )
    if return_grad:
        # the returned gradient is a value, not a differentiable function of logits
        return loss, grad.detach()
    return loss


# ---------------------------------------------------------------------------------------------
# attention


@torch.library.custom_op("softmaxkit::attention", mutates_args=())
def attention_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: str | None,
    window: list[int], mask: Tensor | None, softcap: float | None, backend: str | None,
    lse_used: bool,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        out, lse = _attention_fn(
            q, k, v, scale=scale, causal=causal or False, window=(window[0], window[1]), mask=mask,
            softcap=softcap, return_lse=True, backend=backend,
        )
    return out.contiguous(), lse.contiguous()


def _attention_lead(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple:
    leads = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    if mask is not None and mask.ndim > 3:
        leads.append(mask.shape[:-3])
    return tuple(torch.broadcast_shapes(*leads))


@attention_op.register_fake
def _(q, k, v, scale, causal, window, mask, softcap, backend, lse_used):
    lead = _attention_lead(q, k, v, mask)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    hq, lq = q.shape[-3], q.shape[-2]
    out = _empty(q, lead + (hq, lq, v.shape[-1]), dtype)
    return out, _empty(q, lead + (hq, lq), _acc(dtype))


@torch.library.custom_op("softmaxkit::attention_vjp", mutates_args=())
def attention_vjp_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    scale: float | None, causal: str | None, window: list[int], mask: Tensor | None,
    softcap: float | None, backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        grads = _attention_vjp_fn(
            q, k, v, out, lse, dout, scale=scale, causal=causal or False,
            window=(window[0], window[1]), mask=mask, softcap=softcap, backend=backend,
        )
    return tuple(g.contiguous() for g in grads)


@attention_vjp_op.register_fake
def _(q, k, v, out, lse, dout, scale, causal, window, mask, softcap, backend):
    return tuple(_empty(a, a.shape, a.dtype) for a in (q, k, v))


attention_vjp_op.register_autograd(
    _no_double_backward("attention_vjp"), setup_context=_no_setup
)


def _attention_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, scale, causal, window, mask, softcap, backend, lse_used = inputs
    ctx.args = (scale, causal, window)
    ctx.tail = (softcap, backend)
    ctx.lse_used = lse_used  # else the lse's (zero) cotangent is not worth a wider backward
    ctx.save_for_backward(q, k, v, mask, *output)  # out and lse: the backward recomputes


def _widen_for_lse(
    v: Tensor, out: Tensor, dout: Tensor, dlse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(v, out, dout)`` widened by one column so that the unchanged attention VJP also
    carries the lse's cotangent ``dlse``.

    The lse's gradient enters as ``D_i = <dout_i, out_i> - dlse_i``: a zero value column, an
    output column of ``-dlse`` and an upstream column of ones give exactly that; the caller
    drops the extra column of ``dv``.
    """
    v = torch.cat([v, v.new_zeros(v.shape[:-1] + (1,))], dim=-1)
    out = torch.cat([out, (-dlse).to(out.dtype).unsqueeze(-1)], dim=-1)
    dout = torch.cat([dout, dout.new_ones(dout.shape[:-1] + (1,))], dim=-1)
    return v, out, dout


def _attention_backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple:
    q, k, v, mask, out, lse = ctx.saved_tensors
    dv_width = v.shape[-1]
    widen = ctx.lse_used and dlse is not None
    if widen:
        assert dlse is not None  # widen says so; for the type checker
        v, out, dout = _widen_for_lse(v, out, dout, dlse)
    dq, dk, dv = attention_vjp_op(q, k, v, out, lse, dout, *ctx.args, mask, *ctx.tail)
    if widen:
        dv = dv[..., :dv_width]
    return dq, dk, dv, None, None, None, None, None, None, None


attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: Any = False,
    window: Any = None, mask: Any = None, softcap: float | None = None,
    return_lse: bool = False, lse_base: Any = "e", backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.attention` as the differentiable operator ``softmaxkit::attention``.

    The forward saves ``out`` and ``lse``; the backward recomputes the probabilities from them
    (``attention_vjp``).  The returned ``lse`` is differentiable too.
    """
    base = _args.lse_base(lse_base)
    out, lse = attention_op(
        q, k, v, None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)),
        _tensor_or_none(mask, q, "mask"), _args.softcap(softcap), backend, bool(return_lse),
    )
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


# ---------------------------------------------------------------------------------------------
# merge of partial attention states


@torch.library.custom_op("softmaxkit::merge_attention", mutates_args=())
def merge_attention_op(
    outs: Tensor, lses: Tensor, axis: int, backend: str | None
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        out, lse = _merge_fn(outs, lses, axis, backend=backend)
    return out.contiguous(), lse.contiguous()


@merge_attention_op.register_fake
def _(outs, lses, axis, backend):
    shape = list(lses.shape)
    del shape[axis]
    return (_empty(outs, shape + [outs.shape[-1]], outs.dtype), _empty(lses, shape, lses.dtype))


@torch.library.custom_op("softmaxkit::merge_attention_vjp", mutates_args=())
def merge_attention_vjp_op(
    outs: Tensor, lses: Tensor, dout: Tensor, dlse: Tensor | None, axis: int,
    backend: str | None,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        douts, dlses = _merge_vjp_fn(outs, lses, dout, dlse, axis,
                                                      backend=backend)
    return douts.contiguous(), dlses.contiguous()


@merge_attention_vjp_op.register_fake
def _(outs, lses, dout, dlse, axis, backend):
    return _empty(outs, outs.shape, outs.dtype), _empty(lses, lses.shape, lses.dtype)


merge_attention_vjp_op.register_autograd(
    _no_double_backward("merge_attention_vjp"), setup_context=_no_setup
)


def _merge_setup(ctx: Any, inputs: Any, output: Any) -> None:
    outs, lses, axis, backend = inputs
    ctx.axis, ctx.backend = axis, backend
    ctx.save_for_backward(outs, lses)


def _merge_backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    outs, lses = ctx.saved_tensors
    if dout is None:
        dout = outs.new_zeros(outs.shape[:ctx.axis] + outs.shape[ctx.axis + 1:])
    douts, dlses = merge_attention_vjp_op(outs, lses, dout, dlse, ctx.axis, ctx.backend)
    return douts, dlses, None, None


merge_attention_op.register_autograd(_merge_backward, setup_context=_merge_setup)


def _states(outs: Any, lses: Any, axis: int, empty_lse: float) -> tuple[Tensor, Tensor, int]:
    """Partial states stacked and checked, lses in the accumulator dtype with -inf for empty.

    Torch operations, so gradients flow through the conversions.
    """
    empty = _args.empty_lse(empty_lse)
    if isinstance(outs, (list, tuple)):
        outs = torch.stack(list(outs), dim=axis)
    if isinstance(lses, (list, tuple)):
        lses = torch.stack(list(lses), dim=axis)
    if lses.ndim < 1 or tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(
            f"outs of shape {tuple(outs.shape)} must be lses' shape {tuple(lses.shape)} plus a "
            "trailing value dimension"
        )
    ax = int(axis) + lses.ndim if int(axis) < 0 else int(axis)
    if not 0 <= ax < lses.ndim:
        raise ValueError(f"axis={axis} is out of range for lses with {lses.ndim} dimension(s)")
    lses = lses.to(_acc(outs.dtype))
    if empty == math.inf:
        lses = torch.where(lses == math.inf, -math.inf, lses)
    return outs, lses, ax


def merge_attention_states(
    outs: Any, lses: Any, axis: int = 0, *, lse_base: Any = "e", empty_lse: float = -math.inf,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`softmaxkit.merge_attention_states` as the operator ``softmaxkit::merge_attention``.

    The conversions of ``lse_base`` and ``empty_lse`` are torch operations around the
    operator, so gradients flow through them; the operator sees natural logs, ``-inf`` empty.
    """
    base = _args.lse_base(lse_base)
    outs, lses, ax = _states(outs, lses, axis, empty_lse)
    if base == "2":
        lses = lses * LN2
    out, lse = merge_attention_op(outs, lses, ax, backend)
    return out, (lse / LN2 if base == "2" else lse)


def attention_vjp(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
    scale: float | None = None, causal: Any = False, window: Any = None, mask: Any = None,
    softcap: float | None = None, lse_base: Any = "e", backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`softmaxkit.attention_vjp` as an operator (no second derivative)."""
    if _args.lse_base(lse_base) == "2":
        lse = lse * LN2
    scale = None if scale is None else _args.attention_scale(scale, q.shape[-1])
    return attention_vjp_op(
        q, k, v, out, lse, dout, scale,
        _args.causal(causal), list(_args.window(window)), _tensor_or_none(mask, q, "mask"),
        _args.softcap(softcap), backend,
    )


def merge_attention_vjp(
    outs: Any, lses: Any, dout: Tensor, dlse: Any = None, axis: int = 0, *,
    lse_base: Any = "e", empty_lse: float = -math.inf, backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`softmaxkit.merge_attention_vjp` as an operator (no second derivative)."""
    base = _args.lse_base(lse_base)
    outs, lses, ax = _states(outs, lses, axis, empty_lse)
    if dlse is not None:
        dlse = torch.as_tensor(_tensor_or_none(dlse, outs, "dlse")).to(lses.dtype)
        if base == "2":
            dlse = dlse / LN2  # d/d lse_e of the base-2 lse
    douts, dlses = merge_attention_vjp_op(
        outs, lses * LN2 if base == "2" else lses, dout, dlse, ax, backend
    )
    return douts, (dlses * LN2 if base == "2" else dlses)


# ---------------------------------------------------------------------------------------------
# packed variable-length attention


@torch.library.custom_op("softmaxkit::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    scale: float | None, causal: str | None, window: list[int], softcap: float | None,
    backend: str | None, lse_used: bool,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        out, lse = _varlen_fn(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal or False,
            window=(window[0], window[1]), softcap=softcap, return_lse=True, backend=backend,
        )
    return out.contiguous(), lse.contiguous()


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap, backend, lse_used):
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    tq, hq = q.shape[0], q.shape[1]
    return _empty(q, (tq, hq, v.shape[-1]), dtype), _empty(q, (tq, hq), _acc(dtype))


@torch.library.custom_op("softmaxkit::varlen_attention_vjp", mutates_args=())
def varlen_attention_vjp_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float | None, causal: str | None,
    window: list[int], softcap: float | None, backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        grads = _varlen_vjp_fn(
            q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, scale=scale,
            causal=causal or False, window=(window[0], window[1]), softcap=softcap,
            backend=backend,
        )
    return tuple(g.contiguous() for g in grads)


@varlen_attention_vjp_op.register_fake
def _(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap,
      backend):
    return tuple(_empty(a, a.shape, a.dtype) for a in (q, k, v))


varlen_attention_vjp_op.register_autograd(
    _no_double_backward("varlen_attention_vjp"), setup_context=_no_setup
)


def _varlen_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, scale, causal, window, softcap, backend, lse_used = inputs
    ctx.args = (scale, causal, window, softcap, backend)
    ctx.lse_used = lse_used
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)  # out and lse: the backward recomputes


def _varlen_backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple:
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    dv_width = v.shape[-1]
    widen = ctx.lse_used and dlse is not None
    if widen:
        assert dlse is not None  # widen says so; for the type checker
        v, out, dout = _widen_for_lse(v, out, dout, dlse)
    dq, dk, dv = varlen_attention_vjp_op(q, k, v, out, lse, dout, cu_q, cu_k, *ctx.args)
    if widen:
        dv = dv[..., :dv_width]
    return dq, dk, dv, None, None, None, None, None, None, None, None


varlen_attention_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def _seqlens(value: Any, like: Tensor, name: str) -> Tensor:
    """Cumulative lengths as a tensor on ``like``'s device (the frontend validates them)."""
    if isinstance(value, Tensor):
        if value.requires_grad:
            raise TypeError(f"{name} holds cumulative lengths and cannot require grad")
        return value
    return torch.as_tensor(value, device=like.device)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
    scale: float | None = None, causal: Any = False, window: Any = None,
    softcap: float | None = None, return_lse: bool = False, lse_base: Any = "e",
    backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.varlen_attention` as the differentiable operator
    ``softmaxkit::varlen_attention``; the backward recomputes from the saved ``out`` and
    ``lse`` (``varlen_attention_vjp``), and the returned ``lse`` is differentiable too."""
    base = _args.lse_base(lse_base)
    out, lse = varlen_attention_op(
        q, k, v, _seqlens(cu_seqlens_q, q, "cu_seqlens_q"),
        _seqlens(cu_seqlens_k, q, "cu_seqlens_k"),
        None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)), _args.softcap(softcap), backend,
        bool(return_lse),
    )
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


def varlen_attention_vjp(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    cu_seqlens_q: Any, cu_seqlens_k: Any, *, scale: float | None = None, causal: Any = False,
    window: Any = None, softcap: float | None = None, lse_base: Any = "e",
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`softmaxkit.varlen_attention_vjp` as an operator (no second derivative)."""
    if _args.lse_base(lse_base) == "2":
        lse = lse * LN2
    return varlen_attention_vjp_op(
        q, k, v, out, lse, dout, _seqlens(cu_seqlens_q, q, "cu_seqlens_q"),
        _seqlens(cu_seqlens_k, q, "cu_seqlens_k"),
        None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)), _args.softcap(softcap), backend,
    )
