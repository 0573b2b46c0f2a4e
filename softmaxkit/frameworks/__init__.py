"""Training integration: the routes from the public functions to framework-aware operators.

A public function asks :func:`route` whether its arrays need a framework's own operator:

- a PyTorch tensor that autograd could record (grad mode on and some input requiring grad),
  or any PyTorch tensor while ``torch.compile`` traces or a ``torch.func`` transform runs,
  goes to the custom operators of :mod:`softmaxkit.frameworks.torch`, whose backward is the
  library's own VJP;
- a JAX array (concrete or traced) goes to the ``jax.custom_vjp`` wrappers of
  :mod:`softmaxkit.frameworks.jax`;
- everything else takes the plain path, paying only this check.

Neither framework is imported here: a framework that is not yet imported by the caller cannot
own the caller's arrays.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

_IMPORTED: dict[str, ModuleType] = {}
"""The frameworks found imported, kept: code that ``torch.compile`` traces then reads this
small dict instead of ``sys.modules``, which tracing would wrap whole (thousands of entries,
and an import during the wrapping breaks it)."""


def imported(name: str) -> ModuleType | None:
    """The module ``name`` (``"torch"`` or ``"jax"``) if the caller has imported it."""
    module = _IMPORTED.get(name)
    if module is None:
        module = sys.modules.get(name)
        if module is not None:
            _IMPORTED[name] = module
    return module


def _torch_module() -> ModuleType:
    from . import torch as module  # a plain import: torch.compile traces it

    return module


def _jax_module() -> ModuleType:
    from . import jax as module

    return module


_PLAIN: set[type] = {type(None)}
"""Types whose values never need a framework: neither a torch tensor, nor a JAX array, nor
a list or tuple that may hold one.  A type is added when first seen to be neither; a type of
JAX or PyTorch cannot be seen before its framework is imported, and once imported a
framework makes no existing type its own."""


_TENSORS: set[type] = set()
"""Types seen to be torch tensors: a call on tensors that do not require grad goes to the
operators only while ``torch.compile`` traces, which is asked without the checks below."""


def route(*arrays: Any) -> ModuleType | None:
    """The framework module that must run a call on ``arrays``, or None for the plain path.

    Parameters
    ----------
    *arrays
        The call's array arguments (None, scalars and lists of arrays allowed).

    Returns
    -------
    module or None
        :mod:`softmaxkit.frameworks.torch` when autograd or ``torch.compile`` could record the
        call, :mod:`softmaxkit.frameworks.jax` for JAX arrays, otherwise None.
    """
    tensors = False
    for a in arrays:
        kind = type(a)
        if kind in _PLAIN:
            continue
        if kind in _TENSORS and not a.requires_grad:
            tensors = True
            continue
        break
    else:  # the common call: one set lookup for each plain value or tensor
        if tensors and (_IMPORTED["torch"].compiler.is_compiling()
                        or _IMPORTED["torch"]._C._are_functorch_transforms_active()):
            return _torch_module()  # a trace, or a transform's wrapped tensors (vmap)
        return None
    torch = imported("torch")
    if torch is not None and torch.compiler.is_compiling():
        jax = _IMPORTED.get("jax")  # a trace reads no sys.modules (see _IMPORTED)
    else:
        jax = imported("jax")
    if torch is None and jax is None:
        return None
    tensor = torch.Tensor if torch is not None else ()
    array = jax.Array if jax is not None else ()
    seen = grad = False
    for a in arrays:
        for b in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(b, tensor):
                seen = True
                grad = grad or b.requires_grad
                if b is a:
                    _TENSORS.add(type(a))
            elif isinstance(b, array):
                return _jax_module()
            elif b is a:  # not a list or tuple: its type never routes
                _PLAIN.add(type(a))
    if not seen or torch is None:
        return None
    if ((grad and torch.is_grad_enabled()) or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        return _torch_module()
    return None


def on_host(fn: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """For an operation without JAX wrappers: ``(True, result)`` when its arguments hold
    concrete JAX arrays, ``fn`` having run on host views of them (the backend the registry
    chooses for numpy arrays, not the array-API reference op by op); ``(False, None)`` when
    they hold none, or a traced one (under ``jit``, ``grad`` or ``vmap`` the plain path is
    traced instead, and JAX follows it).

    Parameters
    ----------
    fn : callable
        The public function, called again with the converted arguments.
    *args, **kwargs
        Its arguments (lists, tuples and summaries of arrays included).
    """
    if imported("jax") is None:
        return False, None
    return _jax_module().on_host(fn, args, kwargs)


def refuse_gradient(op: str, *arrays: Any) -> None:
    """Raise when PyTorch autograd would record a call of ``op``, which has no gradient.

    Parameters
    ----------
    op : str
        The public operation's name, for the message.
    *arrays
        The call's array arguments (None and lists of arrays allowed).

    Raises
    ------
    NotImplementedError
        Some torch tensor among ``arrays`` requires grad and grad mode is on: the result would
        otherwise come back without a gradient, silently.
    """
    torch = imported("torch")
    if torch is None or not torch.is_grad_enabled():
        return
    for a in arrays:
        for b in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(b, torch.Tensor) and b.requires_grad:
                raise NotImplementedError(
                    f"softmaxkit.{op} is not differentiable and an input requires grad; detach "
                    "the inputs or call it under torch.no_grad() (docs/training.md lists the "
                    "differentiable operations)"
                )


for _name in ("torch", "jax"):  # frameworks imported before softmaxkit
    imported(_name)
