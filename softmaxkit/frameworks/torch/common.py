"""What the PyTorch operators share: their registration and eager calls, their errors for
second derivatives, dtype rules and the conversion of optional tensor arguments."""

import math
from collections.abc import Callable, Mapping, Sequence
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
                      eager_forward: Callable[..., Any] | None = None, *,
                      vmap: Callable[..., Any]) -> None:
    """``op.register_autograd``, the backward run under the backend options of its forward,
    and the same formula as a ``torch.autograd.Function`` for :func:`call`.

    Autograd runs a CUDA backward on a device thread, where the caller's ``backend_opts``
    context is absent; captured at the forward, the options (and trace) hold for the gradient
    on every device.  ``eager_forward``, where given, is the Function's forward: a function of
    the operator's inputs giving its output and a state the backward finds as ``ctx.state``
    (None on the operator's own path, which may be traced).  ``vmap`` is the operator's rule
    for ``torch.func.vmap`` (and so ``jacrev``, whose backward runs vmapped):
    ``vmap(info, in_dims, *inputs) -> (outputs, out_dims)``, most often a call of the operator
    on the inputs :func:`batch_first` made.  Forward mode (``jvp``, ``jacfwd``) raises.
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
    # the same rule for the operator itself, which runs where a compiled graph holds a vmap
    op.register_vmap(vmap)
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

    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(
            f"softmaxkit.{name} has no forward-mode derivative (torch.func.jvp, jacfwd): use "
            "reverse mode (torch.func.grad, vjp, jacrev)"
        )

    _TRANSFORMABLE[op] = type(f"{name}_transformable", (torch.autograd.Function,), {
        # functorch runs the forward on the level below's tensors
        "forward": staticmethod(implementation), "setup_context": staticmethod(setup),
        "backward": staticmethod(run), "vmap": staticmethod(vmap), "jvp": staticmethod(jvp)})


def no_vmap(name: str, why: str) -> Callable[..., Any]:
    """A vmap rule that raises, naming the operation and saying ``why`` it has none."""
    def vmap(info: Any, in_dims: Any, *inputs: Any) -> Any:
        raise NotImplementedError(
            f"softmaxkit.{name} has no vmap rule (torch.func.vmap, jacrev): {why}"
        )
    return vmap


def batch_first(info: Any, in_dims: Sequence[int | None], inputs: Sequence[Any],
                tensors: Mapping[int, tuple[int | None, bool]]) -> tuple[list[Any], int]:
    """A vmap rule's inputs with the vmapped dimension as the first leading dimension of each.

    Every operation here batches or broadcasts over leading dimensions, so a vmap rule is a
    call with one more leading dimension in front.  ``tensors`` maps the position of each
    tensor input (or None) to ``(core, expand)``:

    - ``core``: how many of its trailing dimensions are not leading ones (3 for attention's
      ``q``; 0 for an operand that broadcasts against the others from the right, such as a
      ``where`` mask); inputs are padded with size-1 dimensions after the vmapped one to the
      most leading dimensions of any input, as broadcasting would pad an example's, so the
      vmapped dimensions line up.  None: the shape is fixed by the others (class-index
      targets, merge states), no padding;
    - ``expand``: whether an unbatched input becomes batched, as a stride-0 view expanded to
      the batch size.  A result shaped like that input needs it, and so does a VJP's gradient
      of it: the VJP sums over broadcast leading dimensions, so a size-1 one would sum the
      vmapped examples' gradients.  An unbatched input not expanded stays as it is (it
      broadcasts from the right).

    Returns the inputs and the number of leading dimensions of one example (with ``core`` 0
    for all: an example's number of dimensions), by which an axis counted from the start
    that follows them shifts by one.
    """
    given = [(i, inputs[i], in_dims[i], core, expand)
             for i, (core, expand) in tensors.items() if inputs[i] is not None]
    lead = max((x.ndim - (dim is not None) - core for _, x, dim, core, _ in given
                if core is not None), default=0)
    out = list(inputs)
    for i, x, dim, core, expand in given:
        rank = x.ndim - (dim is not None) if core is None else lead + core
        if dim is not None:
            x = x.movedim(dim, 0)
            out[i] = x[(slice(None),) + (None,) * (rank + 1 - x.ndim)]
        elif expand:
            out[i] = x.expand(info.batch_size, *(1,) * (rank - x.ndim), *x.shape)
    return out, lead


def example_shape(x: Tensor, dim: int | None) -> tuple[int, ...]:
    """The shape of one example of ``x``, vmapped along ``dim`` (None: unbatched)."""
    return tuple(n for i, n in enumerate(x.shape) if dim is None or i != dim % x.ndim)


def batch_axes(axis: list[int] | None, ndim: int) -> list[int]:
    """Sorted non-negative axes of an example of ``ndim`` dimensions (None: all) shifted past
    a vmapped dimension put in front."""
    return [a + 1 for a in (range(ndim) if axis is None else axis)]


def call(op: Any, *args: Any, eager: bool = True) -> Any:
    """``op(*args)`` as autograd records it.

    The custom operator itself where something traces the call (``torch.compile``,
    ``make_fx`` and other dispatch modes such as fake tensors), or where ``eager`` is false
    (a backward of the operator's own formula, ``ctx.eager`` false: it may be traced); under a
    functorch transform (``torch.func.grad``, ``vjp``, ``vmap``), whatever ``eager``, the
    operator's formula as a Function of the form those take (the custom operator's own
    Function is not);
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
