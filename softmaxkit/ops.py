"""The operations a backend can serve, and the call a kernel receives.

A kernel is a plain function called with keyword arguments only: ``xp`` (the caller's array
namespace, through array-api-compat) followed by the operation's parameters listed in
:data:`OPERATIONS`.  The frontend has already validated every argument, applied the dtype and
policy rules of spec/semantics.md and moved the reduced axis last, so a kernel always works
along the last axis of ``[..., N]`` arrays.  docs/backends.md describes each parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPERATIONS: dict[str, tuple[str, ...]] = {
    # row operations; x is [..., N]; where is None or a boolean [..., N] (False excludes)
    "softmax": ("x", "where", "masked", "out_dtype"),
    "log_softmax": ("x", "where", "masked", "out_dtype"),
    "logsumexp": ("x", "b", "where", "return_sign", "out_dtype"),
    "cross_entropy": (
        "logits", "index", "probs", "where", "ignore_index", "label_smoothing",
        "grad_scale", "out_dtype",
    ),
    "softmax_vjp": ("probs", "cotangent", "where", "out_dtype"),
    "log_softmax_vjp": ("logprobs", "cotangent", "where", "out_dtype"),
    # online summaries
    "summarize": ("x", "where", "values"),
    "merge": ("summaries",),
    # attention
    "attention": (
        "q", "k", "v", "scale", "causal", "window", "mask", "softcap", "return_lse",
    ),
    "attention_vjp": (
        "q", "k", "v", "out", "lse", "dout", "scale", "causal", "window", "mask", "softcap",
    ),
    "merge_attention": ("outs", "lses"),
}
"""Operation name -> the keyword parameters its kernel takes after ``xp``."""


@dataclass
class Call:
    """One call of an operation, as a backend's ``can_run`` / ``should_run`` hooks see it.

    Attributes
    ----------
    op
        The operation name, a key of :data:`OPERATIONS`.
    xp
        The caller's array namespace.
    device
        The device type: ``"cpu"``, ``"cuda"``, ... (see :func:`softmaxkit.registry.device_type`).
    dtype
        The name of the input's floating dtype (``"float32"``, ``"bfloat16"``, ...).
    args
        The keyword arguments the kernel will receive (after ``xp``).
    """

    op: str
    xp: Any
    device: str
    dtype: str
    args: dict[str, Any] = field(default_factory=dict)
