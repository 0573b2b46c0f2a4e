"""Extended-precision references of the row operations, by the spec's definitions
(spec/semantics.md), for the conformance cases (:mod:`.rows_random_cases`) and the fuzzer.

Each takes ``[R, N]`` rows with excluded entries already ``-inf`` and computes in
``np.longdouble`` (80-bit on x86; float64 elsewhere), special rows (a NaN, a ``+inf``,
nothing allowed) as the spec defines them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

LD = np.longdouble  # the reference precision (80-bit on x86; float64 elsewhere)


def _rows(a: np.ndarray, axis: Any) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """``a`` viewed as ``[R, N]`` rows along ``axis`` (like the frontend), and the inverse."""
    if axis is None:
        axes = tuple(range(a.ndim))
    elif isinstance(axis, tuple):
        axes = tuple(sorted(i % a.ndim for i in axis))
    else:
        axes = (axis % a.ndim,) if a.ndim else ()
    kept = tuple(i for i in range(a.ndim) if i not in axes)
    perm = kept + axes
    moved = np.transpose(a, perm)
    n = math.prod(moved.shape[len(kept):])
    rows = moved.reshape((math.prod(moved.shape[: len(kept)]), n))

    def back(r: np.ndarray) -> np.ndarray:
        return np.transpose(np.asarray(r).reshape(moved.shape), np.argsort(perm))

    return rows, back


def _classify(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nan, posinf, empty) flags ``[R, 1]`` for rows whose excluded entries are ``-inf``."""
    nan = np.isnan(x).any(-1, keepdims=True)
    posinf = (x == np.inf).any(-1, keepdims=True) & ~nan
    empty = ((x == -np.inf) | (x.shape[-1] == 0)).all(-1, keepdims=True) & ~nan
    return nan, posinf, empty


def _ref_log_softmax_ext(x: np.ndarray, masked: str) -> np.ndarray:
    """Spec log_softmax of ``[R, N]`` rows, kept in extended precision."""
    x = x.astype(LD)
    nan, posinf, empty = _classify(x)
    special = nan | posinf | empty
    clean = np.where(np.isnan(x), -np.inf, x)
    m = np.max(clean, -1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,), LD)
    m = np.where(special, 0, m)
    z = np.where(special, 0, clean - m)
    out = z - np.log(np.exp(z).sum(-1, keepdims=True))
    out = np.where(posinf, np.where(x == np.inf, np.nan, -np.inf), out)
    out = np.where(nan, np.nan, out)
    return np.where(empty, np.nan if masked == "nan" else -np.inf, out)


def ref_log_softmax(x: np.ndarray, masked: str = "zero") -> np.ndarray:
    """Spec log_softmax of ``[R, N]`` rows (excluded entries ``-inf``), rounded to float64."""
    with np.errstate(over="ignore"):  # below float64's range rounds to -inf
        return _ref_log_softmax_ext(x, masked).astype(np.float64)


def ref_softmax(x: np.ndarray, masked: str = "zero") -> np.ndarray:
    """Spec softmax of ``[R, N]`` rows (excluded entries ``-inf``), rounded to float64."""
    nan, posinf, empty = _classify(x)
    p = np.exp(_ref_log_softmax_ext(x, "zero"))
    p = np.where(nan | posinf, np.nan, p)
    return np.where(empty, np.nan if masked == "nan" else 0.0, p).astype(np.float64)


def ref_logsumexp(x: np.ndarray, b: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Spec logsumexp and sign of ``[R, N]`` rows (excluded entries -inf; b = 0 excludes).

    A NaN weight makes its row NaN even on a ``-inf`` logit: the caller sets ``b = 0`` where
    ``where`` excludes a position.
    """
    x = x.astype(LD)
    if b is None:
        b = np.ones_like(x)
    b = b.astype(LD)
    nan_b = np.isnan(b).any(-1, keepdims=True)
    x = np.where(b == 0, -np.inf, x)
    bz = np.where(x == -np.inf, 0, b)
    nan, posinf, empty = _classify(x)
    nan = nan | nan_b
    posinf, empty = posinf & ~nan, empty & ~nan
    at_inf = x == np.inf
    up = (at_inf & (bz > 0)).any(-1, keepdims=True)
    down = (at_inf & (bz < 0)).any(-1, keepdims=True)
    with np.errstate(all="ignore"):
        m = np.where(nan | posinf | empty, 0,
                     np.max(np.where(np.isnan(x), -np.inf, x), -1, keepdims=True)
                     if x.shape[-1] else 0)
        total = (np.where(bz == 0, 0, bz * np.exp(x - m))).sum(-1, keepdims=True)
        lse = np.log(np.abs(total)) + m
    sign = np.sign(total)
    lse = np.where(total == 0, -np.inf, lse)
    lse = np.where(posinf, np.inf, lse)
    sign = np.where(posinf, np.where(down, -1.0, 1.0), sign)
    bad = nan | (posinf & up & down)
    lse, sign = np.where(bad, np.nan, lse), np.where(bad, np.nan, sign)
    return lse[:, 0].astype(np.float64), sign[:, 0].astype(np.float64)


def _ref_cross_entropy(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> tuple[Any, Any]:
    """Per-row loss and p - y for regular rows (x: [R, C], y: [R, C], valid: [R])."""
    lp = _ref_log_softmax_ext(x, "zero")
    with np.errstate(invalid="ignore"):
        loss = -np.where(y != 0, y.astype(LD) * lp, 0).sum(-1)
    grad = np.exp(lp) - y
    return (np.where(valid, loss, 0).astype(np.float64),
            np.where(valid[:, None], grad, 0).astype(np.float64))
