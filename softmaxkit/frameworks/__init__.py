"""Training integration: the routes from the public functions to framework-aware operators.

A public function asks :func:`route` whether its arrays need a framework's own operator:

- a PyTorch tensor that autograd could record (grad mode on and some input requiring grad),
  or any PyTorch tensor while ``torch.compile`` traces, goes to the custom operators of
  :mod:`softmaxkit.frameworks.torch`, whose backward is the library's own VJP;
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


def _flat(arrays: tuple[Any, ...]) -> list[Any]:
    # merge_attention_states accepts lists of partial states
    flat = []
    for a in arrays:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def route(*arrays: Any) -> ModuleType | None:
    """The framework module that must run a call on ``arrays``, or None for the plain path.

    Parameters
    ----------
    *arrays
        The call's array arguments (None, scalars and sequences of arrays allowed).

    Returns
    -------
    module or None
        :mod:`softmaxkit.frameworks.torch` when autograd or ``torch.compile`` could record the
        call, :mod:`softmaxkit.frameworks.jax` for JAX arrays, otherwise None.
    """
    modules = sys.modules
    torch = modules.get("torch")
    if torch is not None:
        tensors = [a for a in _flat(arrays) if isinstance(a, torch.Tensor)]
        if tensors:
            if torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            ):
                from . import torch as module  # a plain import: torch.compile traces it
                return module
            return None
    jax = modules.get("jax")
    if jax is not None and any(isinstance(a, jax.Array) for a in _flat(arrays)):
        from . import jax as module
        return module
    return None
