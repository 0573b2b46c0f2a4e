"""The backend's manifest, read by softmaxkit's registry through the entry point.

It imports nothing heavy: the kernels are named as ``"module:qualname"`` strings and imported
(with numba) on first use; compiled code is cached on disk by Numba.
"""

from __future__ import annotations

from typing import Any

ROW_OPS = (
    "softmax",
    "log_softmax",
    "logsumexp",
    "cross_entropy",
    "softmax_vjp",
    "log_softmax_vjp",
)

DTYPES = ("float16", "bfloat16", "float32", "float64")

ATTENTION_OPS = ("attention", "attention_vjp")
ATTENTION_DTYPES = DTYPES

PAGED_OPS = ("paged_attention",)
VARLEN_OPS = ("varlen_attention", "varlen_attention_vjp")  # the attention kernels per sequence

SUMMARY_OPS = ("summarize", "merge", "normalize", "merge_attention", "merge_attention_vjp")

PRIORITY = 50
"""Above the reference backend (-100): chosen by default for CPU arrays it can run."""


def manifest() -> dict[str, Any]:
    """What softmaxkit needs to know to dispatch to this backend, without importing numba.

    Returns
    -------
    dict
        The manifest described in :mod:`softmaxkit.registry`.
    """
    return {
        "name": "numba-cpu",
        "serves": [
            {"ops": list(ROW_OPS), "devices": ["cpu"], "dtypes": list(DTYPES)},
            {"ops": list(ATTENTION_OPS), "devices": ["cpu"], "dtypes": list(ATTENTION_DTYPES)},
            {"ops": list(PAGED_OPS), "devices": ["cpu"], "dtypes": list(ATTENTION_DTYPES)},
            {"ops": list(SUMMARY_OPS), "devices": ["cpu"], "dtypes": list(DTYPES)},
            {"ops": list(VARLEN_OPS), "devices": ["cpu"], "dtypes": list(ATTENTION_DTYPES)},
        ],
        "kernels": {
            **{op: f"softmaxkit_numba_cpu.rows:{op}" for op in ROW_OPS},
            **{op: f"softmaxkit_numba_cpu.attention:{op}" for op in ATTENTION_OPS},
            **{op: f"softmaxkit_numba_cpu.paged:{op}" for op in PAGED_OPS},
            **{op: f"softmaxkit_numba_cpu.summaries:{op}" for op in SUMMARY_OPS},
            **{op: f"softmaxkit_numba_cpu.varlen:{op}" for op in VARLEN_OPS},
        },
        "priority": PRIORITY,
        "install_hint": "pip install softmaxkit-numba-cpu",
        "can_run": "softmaxkit_numba_cpu.adapters:can_run",
        # can_run reads the arrays' types and dtypes, out_dtype and torch's layout flags
        "hook_keys": ["arrays", "out_dtype", "layout"],
    }
