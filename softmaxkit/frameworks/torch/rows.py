"""PyTorch operators of the row operations: softmax, log_softmax, their VJPs, logsumexp and
cross_entropy."""

from typing import Any

import torch
from torch import Tensor

from ... import rows as _rows
from .common import (
    acc_dtype,
    axis_list,
    batch_axes,
    batch_first,
    call,
    custom_op,
    expand_reduced,
    float_dtype,
    no_double_backward,
    no_setup,
    register_autograd,
    result_like,
    tensor_or_none,
)

# ---------------------------------------------------------------------------------------------
# softmax and log_softmax


def _normalize_op(name: str):
    @custom_op(name)
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
        return result_like(x, x.shape, dtype or float_dtype(x.dtype))

    return op


def _vjp_op(name: str):
    @custom_op(name)
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
        return result_like(y, y.shape, torch.promote_types(y.dtype, cotangent.dtype))

    def vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[Tensor, int]:
        # y and the cotangent: an example's shape; where broadcasts against them
        (y, cot, axis, where, backend), ndim = batch_first(
            info, in_dims, inputs, {0: (0, True), 1: (0, True), 3: (0, False)})
        return call(op, y, cot, batch_axes(axis, ndim), where, backend), 0

    register_autograd(op, no_double_backward(name), no_setup, vmap=vmap)
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
        gx = call(vjp, y, grad, ctx.axis, where, ctx.backend, eager=ctx.eager)
        return gx.to(ctx.x_dtype), None, None, None, None, None
    return backward


def _normalize_vmap(op: Any):
    def vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[Tensor, int]:
        (x, axis, where, dtype, masked, backend), ndim = batch_first(
            info, in_dims, inputs, {0: (0, True), 2: (0, False)})
        return call(op, x, batch_axes(axis, ndim), where, dtype, masked, backend), 0
    return vmap


register_autograd(softmax_op, _normalize_backward(softmax_vjp_op), _normalize_setup,
                  vmap=_normalize_vmap(softmax_op))
register_autograd(log_softmax_op, _normalize_backward(log_softmax_vjp_op), _normalize_setup,
                  vmap=_normalize_vmap(log_softmax_op))


def softmax(
    x: Tensor, axis: Any = None, *, where: Any = None, dtype: Any = None,
    masked: str = "zero", backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.softmax` as the differentiable operator ``softmaxkit::softmax``."""
    return call(
        softmax_op, x, axis_list(axis, x.ndim), tensor_or_none(where, x, "where"), dtype, masked,
        backend,
    )


def log_softmax(
    x: Tensor, axis: Any = None, *, where: Any = None, dtype: Any = None,
    masked: str = "zero", backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.log_softmax` as the differentiable operator ``softmaxkit::log_softmax``."""
    return call(
        log_softmax_op, x, axis_list(axis, x.ndim), tensor_or_none(where, x, "where"), dtype,
        masked, backend,
    )


def softmax_vjp(
    probs: Tensor, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.softmax_vjp` as an operator (no second derivative)."""
    return call(
        softmax_vjp_op, probs, tensor_or_none(cotangent, probs, "cotangent"),
        axis_list(axis, probs.ndim), tensor_or_none(where, probs, "where"), backend,
    )


def log_softmax_vjp(
    logprobs: Tensor, cotangent: Any, axis: Any = None, *, where: Any = None,
    backend: str | None = None,
) -> Tensor:
    """:func:`softmaxkit.log_softmax_vjp` as an operator (no second derivative)."""
    return call(
        log_softmax_vjp_op, logprobs, tensor_or_none(cotangent, logprobs, "cotangent"),
        axis_list(axis, logprobs.ndim), tensor_or_none(where, logprobs, "where"), backend,
    )


# ---------------------------------------------------------------------------------------------
# logsumexp


@custom_op("logsumexp")
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
    dtype = float_dtype(a.dtype)
    if b is not None:
        dtype = torch.promote_types(dtype, float_dtype(b.dtype))
    axes = range(len(shape)) if axis is None else axis
    for i in sorted(axes, reverse=True):
        if keepdims:
            shape[i] = 1
        else:
            del shape[i]
    return result_like(a, shape, dtype)


def _logsumexp_setup(ctx: Any, inputs: Any, output: Tensor) -> None:
    a, axis, b, keepdims, where, backend = inputs
    ctx.axis, ctx.keepdims, ctx.backend = axis, keepdims, backend
    ctx.save_for_backward(a, b, where, output)


def _logsumexp_backward(ctx: Any, grad: Tensor) -> tuple:
    a, b, where, lse = ctx.saved_tensors
    g = expand_reduced(grad, ctx.axis, a.ndim, ctx.keepdims)
    if b is None:
        # d lse / d a is the softmax of a over the reduced axes (0 on a fully masked row)
        p = call(softmax_op, a, ctx.axis, where, None, "zero", ctx.backend, eager=ctx.eager)
        return (p * g).to(a.dtype), None, None, None, None, None
    # with weights: d lse / d a = b exp(a - lse), d lse / d b = exp(a - lse); excluded
    # positions (where False, b == 0) and empty rows (lse = -inf) get 0, never NaN
    lse_k = expand_reduced(lse, ctx.axis, a.ndim, ctx.keepdims)
    keep = (b != 0) & torch.isfinite(lse_k)
    if where is not None:
        keep = keep & where
    e = torch.where(keep, torch.exp(a.to(lse.dtype) - lse_k), 0.0) * g
    ga = (b * e).sum_to_size(a.shape).to(a.dtype)
    gb = e.sum_to_size(b.shape).to(b.dtype) if ctx.needs_input_grad[2] else None
    return ga, None, gb, None, None, None


def _logsumexp_vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[Tensor, int]:
    # a and b broadcast (the axes count in their broadcast shape), where against both
    (a, axis, b, keepdims, where, backend), ndim = batch_first(
        info, in_dims, inputs, {0: (0, True), 2: (0, False), 4: (0, False)})
    return call(logsumexp_op, a, batch_axes(axis, ndim), b, keepdims, where, backend), 0


register_autograd(logsumexp_op, _logsumexp_backward, setup_context=_logsumexp_setup,
                  vmap=_logsumexp_vmap)


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
    b = tensor_or_none(b, a, "b")
    ndim = a.ndim if b is None else max(a.ndim, b.ndim)
    return call(
        logsumexp_op, a, axis_list(axis, ndim), b, bool(keepdims),
        tensor_or_none(where, a, "where"), backend,
    )


# ---------------------------------------------------------------------------------------------
# cross_entropy


@custom_op("cross_entropy")
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
    return result_like(logits, shape, logits.dtype), result_like(logits, grad_shape, logits.dtype)


def _cross_entropy_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    ctx.axis, ctx.reduction = inputs[2], inputs[3]
    ctx.save_for_backward(output[1])  # the fused gradient: all the backward needs


def _cross_entropy_backward(ctx: Any, grad_loss: Tensor, grad_grad: Any) -> tuple:
    (dlogits,) = ctx.saved_tensors
    g = grad_loss.unsqueeze(ctx.axis) if ctx.reduction == "none" else grad_loss
    return (dlogits * g).to(dlogits.dtype), None, None, None, None, None, None, None, None


def _cross_entropy_vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[tuple, tuple]:
    """Per-row losses of the whole batch, reduced per example: a mean or sum over the batch
    would mix the examples (a mean's count is each example's own)."""
    index = not inputs[1].dtype.is_floating_point  # class indices: logits' shape less axis
    (logits, target, axis, reduction, ignore_index, smoothing, where, need_grad, backend), _ = (
        batch_first(info, in_dims, inputs,
                    {0: (0, True), 1: (None, True) if index else (0, False), 6: (0, False)}))
    # under grad(vmap(...)) the caller saw a batched tensor, which does not say it requires
    # grad; the level below's tensors do
    need_grad = need_grad or (logits.requires_grad and torch.is_grad_enabled())
    loss, grad = call(cross_entropy_op, logits, target, axis + 1,
                      "none" if reduction in ("mean", "sum") else reduction, ignore_index,
                      smoothing, where, need_grad, backend)
    if reduction in ("mean", "sum"):
        acc, rows = acc_dtype(logits.dtype), loss[0].numel()
        count = torch.full((len(loss),), rows if reduction == "mean" else 1, device=loss.device)
        if reduction == "mean" and index and ignore_index is not None:
            count = (target != ignore_index).reshape(len(loss), rows).sum(1)
        scale = 1.0 / count.clamp(min=1).to(acc)  # none counted: loss 0, gradient 0
        loss = (loss.reshape(len(loss), rows).sum(1, dtype=acc) * scale).to(logits.dtype)
        if need_grad:  # the gradient of the rows' sum, scaled as the mean's
            grad = (grad * scale.view((-1,) + (1,) * (grad.ndim - 1))).to(logits.dtype)
    # without need_grad the second output is an empty placeholder, the same for all examples
    return (loss, grad), (0, 0 if need_grad else None)


register_autograd(cross_entropy_op, _cross_entropy_backward, setup_context=_cross_entropy_setup,
                  vmap=_cross_entropy_vmap)


def cross_entropy(
    logits: Tensor, target: Any, axis: int = -1, *, reduction: str = "mean",
    ignore_index: int | None = None, label_smoothing: float = 0.0, where: Any = None,
    return_grad: bool = False, backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.cross_entropy` as the operator ``softmaxkit::cross_entropy``.

    The forward computes the gradient with respect to ``logits`` in the same fused pass and
    saves only that; the backward scales it by the incoming gradient.
    """
    target = tensor_or_none(target, logits, "target")
    if target.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "softmaxkit.cross_entropy is differentiable with respect to logits only; the "
            "target requires grad (detach it, or use -sum(target * log_softmax(logits)))"
        )
    need_grad = return_grad or (logits.requires_grad and torch.is_grad_enabled())
    ax = int(axis)
    loss, grad = call(
        cross_entropy_op, logits, target, ax + logits.ndim if ax < 0 else ax, reduction,
        None if ignore_index is None else int(ignore_index), float(label_smoothing),
        tensor_or_none(where, logits, "where"), bool(need_grad), backend,
    )
    if return_grad:
        # the returned gradient is a value, not a differentiable function of logits
        return loss, grad.detach()
    return loss
