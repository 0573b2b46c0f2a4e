"""The reference backend: every operation in plain array-API calls.

It is the executable form of spec/semantics.md, runs on any array library that
array-api-compat supports, and is the oracle every fast backend is tested against.
"""

from __future__ import annotations

from typing import Any

from ..ops import OPERATIONS

_MODULES = {
    "softmax": "rows",
    "log_softmax": "rows",
    "logsumexp": "rows",
    "cross_entropy": "rows",
    "softmax_vjp": "rows",
    "log_softmax_vjp": "rows",
    "summarize": "summary",
    "merge": "summary",
    "normalize": "summary",
    "attention": "attention",
    "attention_vjp": "attention",
    "merge_attention": "attention",
    "merge_attention_vjp": "attention",
    "paged_attention": "paged",
    "varlen_attention": "varlen",
    "varlen_attention_vjp": "varlen",
}


def manifest() -> dict[str, Any]:
    """The reference backend's manifest: every operation, device and dtype, lowest priority."""
    return {
        "name": "reference",
        "serves": [{"ops": ["*"], "devices": ["*"], "dtypes": ["*"]}],
        "kernels": {
            op: f"softmaxkit.reference.{_MODULES[op]}:{op}" for op in OPERATIONS if op in _MODULES
        },
        "priority": -100,
        "install_hint": "part of softmaxkit",
    }
