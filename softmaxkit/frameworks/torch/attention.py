"""PyTorch operators of attention: dense attention, the merge of partial states, packed
variable-length attention, and their VJPs."""

import math
from typing import Any

import torch
from torch import Tensor

from ... import arguments as _args
from ...attention import attention_vjp as _attention_vjp_fn
from ...attention import attention_with_gradient as _attention_with_gradient
from ...attention import merge_attention_states as _merge_fn
from ...attention import merge_attention_vjp as _merge_vjp_fn
from ...varlen import varlen_attention_vjp as _varlen_vjp_fn
from ...varlen import varlen_attention_with_gradient as _varlen_with_gradient
from .common import (
    LN2,
    acc_dtype,
    batch_first,
    call,
    custom_op,
    example_shape,
    no_double_backward,
    no_setup,
    no_vmap,
    register_autograd,
    result_like,
    tensor_or_none,
)

# ---------------------------------------------------------------------------------------------
# attention


def _attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: str | None,
    window: list[int], mask: Tensor | None, softcap: float | None, precision: str,
    backend: str | None, lse_used: bool,
) -> tuple[tuple[Tensor, Tensor], Any]:
    """:func:`attention_op`'s computation, ``(out, lse)``, and the call's gradient
    (:class:`softmaxkit.attention.AttentionGradient`), which the eager Function keeps for
    its backward."""
    out, lse, gradient = _attention_with_gradient(
        q, k, v, scale=scale, causal=causal or False, window=(window[0], window[1]), mask=mask,
        softcap=softcap, precision=precision, backend=backend,
    )
    return (out.contiguous(), lse.contiguous()), gradient


@custom_op("attention")
def attention_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: str | None,
    window: list[int], mask: Tensor | None, softcap: float | None, precision: str,
    backend: str | None, lse_used: bool,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return _attention_forward(q, k, v, scale, causal, window, mask, softcap, precision,
                                  backend, lse_used)[0]


def _attention_lead(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple:
    leads = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    if mask is not None and mask.ndim > 3:
        leads.append(mask.shape[:-3])
    return tuple(torch.broadcast_shapes(*leads))


@attention_op.register_fake
def _(q, k, v, scale, causal, window, mask, softcap, precision, backend, lse_used):
    lead = _attention_lead(q, k, v, mask)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    hq, lq = q.shape[-3], q.shape[-2]
    out = result_like(q, lead + (hq, lq, v.shape[-1]), dtype)
    return out, result_like(q, lead + (hq, lq), acc_dtype(dtype))


@custom_op("attention_vjp")
def attention_vjp_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    dlse: Tensor | None, scale: float | None, causal: str | None, window: list[int],
    mask: Tensor | None, softcap: float | None, precision: str, backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        grads = _attention_vjp_fn(
            q, k, v, out, lse, dout, dlse=dlse, scale=scale, causal=causal or False,
            window=(window[0], window[1]), mask=mask, softcap=softcap, precision=precision,
            backend=backend,
        )
    return tuple(g.contiguous() for g in grads)


@attention_vjp_op.register_fake
def _(q, k, v, out, lse, dout, dlse, scale, causal, window, mask, softcap, precision,
      backend):
    return tuple(result_like(a, a.shape, a.dtype) for a in (q, k, v))


def _attention_vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[tuple, tuple]:
    """The vmapped dimension as one more leading dimension of q, k, v and mask (a mask of
    fewer than three dimensions has size-1 ones in front: heads, rows); k, v and mask
    broadcast where unbatched."""
    args, _ = batch_first(info, in_dims, inputs,
                          {0: (3, True), 1: (3, False), 2: (3, False), 6: (3, False)})
    return call(attention_op, *args), (0, 0)


def _attention_vjp_vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[tuple, tuple]:
    """As :func:`_attention_vmap`, every operand but the mask batched (expanded where it is
    not: the VJP sums a gradient over broadcast leading dimensions, which must not mix the
    examples), and each gradient shaped as its input's example."""
    args, _ = batch_first(info, in_dims, inputs, {
        0: (3, True), 1: (3, True), 2: (3, True), 3: (3, True), 4: (2, True), 5: (3, True),
        6: (2, True), 10: (3, False)})
    grads = call(attention_vjp_op, *args)
    return tuple(g.reshape((info.batch_size,) + example_shape(x, d))
                 for g, x, d in zip(grads, inputs[:3], in_dims[:3], strict=True)), (0, 0, 0)


register_autograd(attention_vjp_op, no_double_backward("attention_vjp"), no_setup,
                  vmap=_attention_vjp_vmap)


def _attention_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, scale, causal, window, mask, softcap, precision, backend, lse_used = inputs
    ctx.args = (scale, causal, window)
    ctx.tail = (softcap, precision, backend)
    ctx.lse_used = lse_used  # else the lse's cotangent, zeros, is not passed on
    ctx.set_materialize_grads(False)  # an output the loss does not use: None, not zeros
    ctx.save_for_backward(q, k, v, mask, *output)  # out and lse: the backward recomputes


def _attention_backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    """The VJP from the cotangents autograd gives, not materialized: an unused ``out`` comes
    as None (a zero ``dout``), an unused ``lse`` as None (no ``dlse`` term); a used lse's
    cotangent enters the one row term ``rowsum(dout * out) - dlse`` in float32."""
    q, k, v, mask, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.lse_used else None
    if ctx.state is not None and not torch.is_grad_enabled():
        # an eager forward's checked call, straight to the backend: no second derivative
        # asked for
        dq, dk, dv = ctx.state(q, k, v, mask, out, lse, dout, dlse)
    else:
        dq, dk, dv = call(attention_vjp_op, q, k, v, out, lse, dout, dlse, *ctx.args, mask,
                          *ctx.tail, eager=ctx.eager)
    return dq, dk, dv, None, None, None, None, None, None, None, None


register_autograd(attention_op, _attention_backward, setup_context=_attention_setup,
                  eager_forward=_attention_forward, vmap=_attention_vmap)


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: Any = False,
    window: Any = None, mask: Any = None, softcap: float | None = None,
    return_lse: bool = False, lse_base: Any = "e", precision: str = "float32",
    backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.attention` as the differentiable operator ``softmaxkit::attention``.

    The forward saves ``out`` and ``lse``; the backward recomputes the probabilities from them
    (``attention_vjp``).  The returned ``lse`` is differentiable too.
    """
    base = _args.lse_base(lse_base)
    out, lse = call(
        attention_op, q, k, v,
        None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)),
        tensor_or_none(mask, q, "mask"), _args.softcap(softcap),
        _args.precision(precision, "float32"), backend, bool(return_lse),
    )
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


# ---------------------------------------------------------------------------------------------
# merge of partial attention states


@custom_op("merge_attention")
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
    return (result_like(outs, shape + [outs.shape[-1]], outs.dtype),
            result_like(lses, shape, lses.dtype))


@custom_op("merge_attention_vjp")
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
    return result_like(outs, outs.shape, outs.dtype), result_like(lses, lses.shape, lses.dtype)


def _merge_vmap(op: Any):
    """The vmapped dimension first in every state and cotangent (batched, expanded where it
    is not: their shapes are fixed by one another), ``axis`` shifted past it."""
    def vmap(info: Any, in_dims: Any, *inputs: Any) -> tuple[tuple, tuple]:
        tensors = {i: (None, True) for i, x in enumerate(inputs) if isinstance(x, Tensor)}
        args, _ = batch_first(info, in_dims, inputs, tensors)
        args[-2] = args[-2] + 1  # axis, before backend
        return call(op, *args), (0, 0)
    return vmap


register_autograd(merge_attention_vjp_op, no_double_backward("merge_attention_vjp"), no_setup,
                  vmap=_merge_vmap(merge_attention_vjp_op))


def _merge_setup(ctx: Any, inputs: Any, output: Any) -> None:
    outs, lses, axis, backend = inputs
    ctx.axis, ctx.backend = axis, backend
    ctx.save_for_backward(outs, lses)


def _merge_backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    outs, lses = ctx.saved_tensors
    if dout is None:
        dout = outs.new_zeros(outs.shape[:ctx.axis] + outs.shape[ctx.axis + 1:])
    douts, dlses = call(merge_attention_vjp_op, outs, lses, dout, dlse, ctx.axis, ctx.backend,
                        eager=ctx.eager)
    return douts, dlses, None, None


register_autograd(merge_attention_op, _merge_backward, setup_context=_merge_setup,
                  vmap=_merge_vmap(merge_attention_op))


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
    lses = lses.to(acc_dtype(outs.dtype))
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
    out, lse = call(merge_attention_op, outs, lses, ax, backend)
    return out, (lse / LN2 if base == "2" else lse)


def attention_vjp(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
    dlse: Any = None, scale: float | None = None, causal: Any = False, window: Any = None,
    mask: Any = None, softcap: float | None = None, lse_base: Any = "e",
    precision: str = "float32", backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`softmaxkit.attention_vjp` as an operator (no second derivative)."""
    dlse = tensor_or_none(dlse, q, "dlse")
    if _args.lse_base(lse_base) == "2":
        lse = lse * LN2
        dlse = None if dlse is None else dlse / LN2
    scale = None if scale is None else _args.attention_scale(scale, q.shape[-1])
    return call(
        attention_vjp_op, q, k, v, out, lse, dout, dlse, scale,
        _args.causal(causal), list(_args.window(window)), tensor_or_none(mask, q, "mask"),
        _args.softcap(softcap), _args.precision(precision, "float32"), backend,
    )


def merge_attention_vjp(
    outs: Any, lses: Any, dout: Tensor, dlse: Any = None, axis: int = 0, *,
    lse_base: Any = "e", empty_lse: float = -math.inf, backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`softmaxkit.merge_attention_vjp` as an operator (no second derivative)."""
    base = _args.lse_base(lse_base)
    outs, lses, ax = _states(outs, lses, axis, empty_lse)
    if dlse is not None:
        dlse = torch.as_tensor(tensor_or_none(dlse, outs, "dlse")).to(lses.dtype)
        if base == "2":
            dlse = dlse / LN2  # d/d lse_e of the base-2 lse
    douts, dlses = call(
        merge_attention_vjp_op, outs, lses * LN2 if base == "2" else lses, dout, dlse, ax, backend
    )
    return douts, (dlses * LN2 if base == "2" else dlses)


# ---------------------------------------------------------------------------------------------
# packed variable-length attention


def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    scale: float | None, causal: str | None, window: list[int], softcap: float | None,
    precision: str, backend: str | None, lse_used: bool,
) -> tuple[tuple[Tensor, Tensor], Any]:
    """:func:`varlen_attention_op`'s computation, ``(out, lse)``, and the call's gradient
    (:class:`softmaxkit.varlen.VarlenGradient`: the lengths already read), which the eager
    Function keeps for its backward."""
    out, lse, gradient = _varlen_with_gradient(
        q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal or False,
        window=(window[0], window[1]), softcap=softcap, precision=precision, backend=backend,
    )
    return (out.contiguous(), lse.contiguous()), gradient


@custom_op("varlen_attention")
def varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    scale: float | None, causal: str | None, window: list[int], softcap: float | None,
    precision: str, backend: str | None, lse_used: bool,
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window,
                               softcap, precision, backend, lse_used)[0]


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap, precision, backend,
      lse_used):
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    tq, hq = q.shape[0], q.shape[1]
    return (result_like(q, (tq, hq, v.shape[-1]), dtype),
            result_like(q, (tq, hq), acc_dtype(dtype)))


@custom_op("varlen_attention_vjp")
def varlen_attention_vjp_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    dlse: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float | None,
    causal: str | None, window: list[int], softcap: float | None, precision: str,
    backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        grads = _varlen_vjp_fn(
            q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, dlse=dlse, scale=scale,
            causal=causal or False, window=(window[0], window[1]), softcap=softcap,
            precision=precision, backend=backend,
        )
    return tuple(g.contiguous() for g in grads)


@varlen_attention_vjp_op.register_fake
def _(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, scale, causal, window,
      softcap, precision, backend):
    return tuple(result_like(a, a.shape, a.dtype) for a in (q, k, v))


_VARLEN_NO_VMAP = (
    "the packed sequences are a batch already; pack the examples' sequences into one call "
    "(concatenated, with their cumulative lengths) instead of vmapping"
)

register_autograd(varlen_attention_vjp_op, no_double_backward("varlen_attention_vjp"), no_setup,
                  vmap=no_vmap("varlen_attention_vjp", _VARLEN_NO_VMAP))


def _varlen_setup(ctx: Any, inputs: Any, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, scale, causal, window, softcap, precision, backend, lse_used = inputs
    ctx.args = (scale, causal, window, softcap, precision, backend)
    ctx.lse_used = lse_used
    ctx.set_materialize_grads(False)  # as for attention: unused outputs give None
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)  # out and lse: the backward recomputes


def _varlen_backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    """As :func:`_attention_backward`: cotangents not materialized, a used lse's as dlse."""
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.lse_used else None
    if ctx.state is not None and not torch.is_grad_enabled():
        # as for attention, and the lengths are not read from the device again
        dq, dk, dv = ctx.state(q, k, v, cu_q, cu_k, out, lse, dout, dlse)
    else:
        dq, dk, dv = call(varlen_attention_vjp_op, q, k, v, out, lse, dout, dlse, cu_q, cu_k,
                          *ctx.args, eager=ctx.eager)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


register_autograd(varlen_attention_op, _varlen_backward, setup_context=_varlen_setup,
                  eager_forward=_varlen_forward,
                  vmap=no_vmap("varlen_attention", _VARLEN_NO_VMAP))


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
    precision: str = "float32", backend: str | None = None,
) -> Any:
    """:func:`softmaxkit.varlen_attention` as the differentiable operator
    ``softmaxkit::varlen_attention``; the backward recomputes from the saved ``out`` and
    ``lse`` (``varlen_attention_vjp``), and the returned ``lse`` is differentiable too."""
    base = _args.lse_base(lse_base)
    out, lse = call(
        varlen_attention_op, q, k, v, _seqlens(cu_seqlens_q, q, "cu_seqlens_q"),
        _seqlens(cu_seqlens_k, q, "cu_seqlens_k"),
        None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)), _args.softcap(softcap),
        _args.precision(precision, "float32"), backend, bool(return_lse),
    )
    if not return_lse:
        return out
    return out, (lse / LN2 if base == "2" else lse)


def varlen_attention_vjp(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    cu_seqlens_q: Any, cu_seqlens_k: Any, *, dlse: Any = None, scale: float | None = None,
    causal: Any = False, window: Any = None, softcap: float | None = None,
    lse_base: Any = "e", precision: str = "float32", backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`softmaxkit.varlen_attention_vjp` as an operator (no second derivative)."""
    dlse = tensor_or_none(dlse, q, "dlse")
    if _args.lse_base(lse_base) == "2":
        lse = lse * LN2
        dlse = None if dlse is None else dlse / LN2
    return call(
        varlen_attention_vjp_op, q, k, v, out, lse, dout, dlse,
        _seqlens(cu_seqlens_q, q, "cu_seqlens_q"), _seqlens(cu_seqlens_k, q, "cu_seqlens_k"),
        None if scale is None else _args.attention_scale(scale, q.shape[-1]),
        _args.causal(causal), list(_args.window(window)), _args.softcap(softcap),
        _args.precision(precision, "float32"), backend,
    )
