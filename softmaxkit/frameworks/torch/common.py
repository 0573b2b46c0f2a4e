"""What the PyTorch operators share: their registration and eager calls, their errors for
second derivatives, dtype rules and the conversion of optional tensor arguments."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import array_api_compat
import torch
from torch import Tensor

from ...dtypes import accumulator_dtype
from ...options import applied, captured

LN2 = math.log(2.0)

class DoubleBackwardError(NotImplementedError):
    """A second derivative through a softmaxkit operator was asked for."""


def no_double_backward(name: str):
    def backward(ctx: Any, *grads: Any) -> Any:
        raise DoubleBackwardError(
            f"softmaxkit.{name} has no second derivative: double backward through it "
            "(create_graph=True, then differentiating the gradient) is not supported"
        )
    return backward


def no_setup(ctx: Any, inputs: Any, output: Any) -> None:
    pass


_IMPLEMENTATIONS: dict[Any, tuple[str, Callable[..., Any]]] = {}
"""Each operator's name and implementation, the function :func:`custom_op` made it of."""

_EAGER: dict[Any, type[torch.autograd.Function]] = {}
"""Each operator's autograd formula as a ``torch.autograd.Function``, for :func:`call`."""

_TRANSFORMABLE: dict[Any, type[torch.autograd.Function]] = {}
"""The same formulas as Functions of the form functorch transforms take (a ``setup_context`` of
their own), for :func:`call` under ``torch.func.grad`` and the like."""


def custom_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op("softmaxkit::<name>")`` of the decorated function, which is
    kept as the operator's implementation for :func:`call`'s eager path."""
    def wrap(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(f"softmaxkit::{name}", mutates_args=())(fn)
        _IMPLEMENTATIONS[op] = (name, fn)
        return op
    return wrap


def register_autograd(op: Any, backward: Any, setup_context: Any,
                      eager_forward: Callable[..., Any] | None = None) -> None:
    """``op.register_autograd``, the backward run under the backend options of its forward,
    and the same formula as a ``torch.autograd.Function`` for :func:`call`.

    Autograd runs a CUDA backward on a device thread, where the caller's ``backend_opts``
    context is absent; captured at the forward, the options (and trace) hold for the gradient
    on every device.  ``eager_forward``, where given, is the Function's forward: a function of
    the operator's inputs giving its output and a state the backward finds as ``ctx.state``
    (None on the operator's own path, which may be traced).
    """
    def setup(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.backend_options = captured()
        ctx.eager = False  # the operator's own formula: its backward may be traced
        ctx.state = None
        setup_context(ctx, inputs, output)

    def run(ctx: Any, *grads: Any) -> Any:
        with applied(ctx.backend_options):
            return backward(ctx, *grads)

    op.register_autograd(run, setup_context=setup)
    name, implementation = _IMPLEMENTATIONS[op]

    def forward(ctx: Any, *inputs: Any) -> Any:  # autograd runs it without grad
        if eager_forward is None:
            output, state = implementation(*inputs), None
        else:
            output, state = eager_forward(*inputs)
        setup(ctx, inputs, output)
        ctx.eager, ctx.state = True, state  # its backward calls the vjp Functions too
        return output

    # named at creation: autograd names its graph node ("<name>_eagerBackward") then
    _EAGER[op] = type(f"{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(run)})

    def vmap(info: Any, in_dims: Any, *inputs: Any) -> Any:
        raise NotImplementedError(
            f"softmaxkit.{name} has no vmap rule (torch.func.vmap, jacrev, jacfwd): call it "
            "on the batched tensor itself, whose leading dimensions are batch dimensions"
        )

    _TRANSFORMABLE[op] = type(f"{name}_transformable", (torch.autograd.Function,), {
        # functorch runs the forward on the level below's tensors
        "forward": staticmethod(implementation), "setup_context": staticmethod(setup),
        "backward": staticmethod(run), "vmap": staticmethod(vmap)})


def call(op: Any, *args: Any, eager: bool = True) -> Any:
    """``op(*args)`` as autograd records it.

    The custom operator itself where something traces the call (``torch.compile``,
    ``make_fx`` and other dispatch modes such as fake tensors), or where ``eager`` is false
    (a backward of the operator's own formula, ``ctx.eager`` false: it may be traced); under a
    functorch transform (``torch.func.grad``, ``vjp``), whatever ``eager``, the operator's
    formula as a Function of the form those take (the custom operator's own Function is not);
    otherwise the operator's ``torch.autograd.Function``, the same implementation and formula
    without the operator's own eager dispatch (schema checks, defaults and aliasing checks,
    the compiler's guards: about 100 us of a differentiable call on the CPU), or, where grad
    mode is off (a backward's vjp, inference), the implementation alone.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return op(*args)
    if torch._C._are_functorch_transforms_active() and op in _TRANSFORMABLE:
        return _TRANSFORMABLE[op].apply(*args)
    function = _EAGER.get(op) if eager else None
    if function is None:
        return op(*args)
    if not torch.is_grad_enabled():  # nothing to record: a backward's vjp, inference
        return _IMPLEMENTATIONS[op][1](*args)
    return function.apply(*args)


def axis_list(axis: Any, ndim: int) -> list[int] | None:
    """``axis`` (None, int or ints) as sorted non-negative ints; None means all axes."""
    if axis is None:
        return None
    items = [axis] if not isinstance(axis, Sequence) else list(axis)
    out = []
    for a in items:
        a = int(a)
        out.append(a + ndim if a < 0 else a)
    return sorted(out)


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype for inputs of ``dtype`` (the library's one rule)."""
    return accumulator_dtype(torch, dtype)


def result_like(like: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialized result of ``shape`` and ``dtype`` on ``like``'s device."""
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def tensor_or_none(value: Any, like: Tensor, name: str) -> Tensor | None:
    """``value`` as a tensor on ``like``'s device; Python scalars and sequences convert."""
    if value is None or isinstance(value, Tensor):
        return value
    if array_api_compat.is_array_api_obj(value):
        raise TypeError(
            f"{name} is a {type(value).__module__.split('.')[0]} array while the other "
            "arguments are torch tensors; pass arrays of one library"
        )
    return torch.as_tensor(value, device=like.device)


def expand_reduced(g: Tensor, axes: list[int] | None, ndim: int, keepdims: bool) -> Tensor:
    """Reinsert the reduced axes of a reduction's cotangent as length-one axes."""
    if keepdims:
        return g
    for a in range(ndim) if axes is None else axes:
        g = g.unsqueeze(a)
    return g
