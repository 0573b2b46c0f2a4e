"""Kernels that hand numpy rows to softmaxkit's reference math (the executable spec)."""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as npx

from softmaxkit.reference import rows


def softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis, as the reference computes it."""
    return rows.softmax(npx, x=x, where=where, masked=masked, out_dtype=out_dtype)


def log_softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Log-softmax along the last axis, as the reference computes it."""
    return rows.log_softmax(npx, x=x, where=where, masked=masked, out_dtype=out_dtype)


def logsumexp(
    *, xp: Any, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """Logsumexp along the last axis, as the reference computes it."""
    return rows.logsumexp(npx, x=x, b=b, where=where, return_sign=return_sign,
                          out_dtype=out_dtype)
