"""The error bounds of spec/semantics.md ("Error bounds"), as functions a test can call.

Every bound compares a backend's output with a float64 / mpmath reference computed from the
*represented* inputs (the inputs after rounding to the tested dtype).  ``u_D`` is the unit
roundoff of the output dtype, ``u_A`` that of the accumulator (float32, or float64 for
float64), ``tiny_D`` the smallest normal number of the output dtype (results below it may be
flushed to zero) and ``N`` the row length.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import HUGE, TINY, UNIT_ROUNDOFF, accumulator_name


def fit_range(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` (float64) with every value that rounds to an infinity in ``dtype`` set to it.

    A reference result beyond ``dtype``'s range (a log-probability below a 16-bit format's,
    say) is compared as the infinity it rounds to; values up to half an ulp past the largest
    finite number still round to it.
    """
    top = HUGE[dtype]
    edge = top + math.ldexp(UNIT_ROUNDOFF[dtype], math.frexp(top)[1] - 1)  # + half an ulp
    a = np.asarray(a, dtype=np.float64)
    return np.where(a >= edge, np.inf, np.where(a <= -edge, -np.inf, a))

SLACK = 8.0
"""The constant term ``c`` of every bound (a few ulps for exp, log and division)."""

# Generic (relative, absolute) tolerances for short rows (N <= 64) of moderate logits, for
# checks that have no operation-specific bound below.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-14),
    "float32": (2e-6, 1e-7),
    "bfloat16": (1.6e-2, 1e-3),
    "float16": (2e-3, 1e-4),
}


def _u(dtype: str) -> tuple[float, float]:
    return UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[accumulator_name(dtype)]


def softmax_bound(p: np.ndarray, x: np.ndarray, n: int, dtype: str) -> np.ndarray:
    """|p^ - p| <= (2 u_D + u_A (c + N + 2 |x - M|)) p + tiny_D, elementwise.

    ``p`` is the reference, ``x`` the represented logits with ``-inf`` at excluded positions
    (``M`` = row maximum over the last axis), ``n`` the row length.
    """
    u_d, u_a = _u(dtype)
    if x.shape[-1] == 0:
        return np.full(np.shape(p), TINY[dtype])
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        m = np.max(np.where(finite, x, -np.inf), axis=-1, keepdims=True)
        d = np.where(finite & np.isfinite(m), np.abs(x - m), 0.0)
        # a gap beyond float64's range has p = 0 exactly: its bound is tiny_D, not inf * 0
        rel = np.where(p == 0, 0.0, 2 * u_d + u_a * (SLACK + n + 2 * d))
    return rel * np.abs(p) + TINY[dtype]


def log_bound(value: np.ndarray, n: int, dtype: str) -> np.ndarray:
    """|l^ - l| <= 2 u_D |l| + u_A (c + N + 2 |l|) for a log-domain value ``l``.

    Covers log_softmax, logsumexp and (with ``|l|`` the sum of ``|y_i log p_i|`` and ``N``
    the number of summed terms) cross-entropy losses.
    """
    u_d, u_a = _u(dtype)
    mag = np.where(np.isfinite(value), np.abs(value), 0.0)
    return 2 * u_d * mag + u_a * (SLACK + n + 2 * mag)


def normalization_bound(n: int, dtype: str) -> float:
    """|sum p^ - 1| <= 2 u_D + u_A (c + N + 2 log N) + N tiny_D for a regular row."""
    u_d, u_a = _u(dtype)
    return 2 * u_d + u_a * (SLACK + n + 2 * np.log(max(n, 1))) + n * TINY[dtype]


def vjp_bound(g: np.ndarray, scale: np.ndarray | float, n: int, dtype: str) -> np.ndarray:
    """|g^ - g| <= 2 u_D |g| + u_A (c + N) scale + tiny_D for a vector-Jacobian product.

    ``scale`` is the magnitude the gradient is built from, elementwise: for softmax_vjp
    ``p_i (|c_i| + sum_j p_j |c_j|)``, for log_softmax_vjp ``|c_i| + p_i sum_j |c_j|``
    (times ``1 + |log p_i|``), for cross_entropy ``grad_scale (p_i + |y_i|)``.
    """
    u_d, u_a = _u(dtype)
    return 2 * u_d * abs(g) + u_a * (SLACK + n) * scale + TINY[dtype]  # any array library


def assert_within(got: np.ndarray, expected: np.ndarray, bound: np.ndarray | float,
                  what: str) -> None:
    """Assert ``|got - expected| <= bound`` where finite; NaN and infinities must match.

    NaN must be NaN at the same positions, infinities must be equal (same sign), and a
    finite expected value must be matched by a finite value within ``bound``.
    """
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    nan_g, nan_e = np.isnan(got), np.isnan(expected)
    if not np.array_equal(nan_g, nan_e):
        where = np.argwhere(nan_g != nan_e)[:3].tolist()
        raise AssertionError(f"{what}: NaN where not expected or missing, at {where}")
    inf_e = np.isinf(expected)
    if not np.array_equal(got[inf_e], expected[inf_e]):
        raise AssertionError(
            f"{what}: infinities differ: expected {expected[inf_e][:5]}, got {got[inf_e][:5]}"
        )
    fin = ~(nan_e | inf_e)
    if not np.all(np.isfinite(got[fin])):
        raise AssertionError(f"{what}: non-finite value where a finite one is expected")
    err = np.abs(got[fin] - expected[fin])
    limit = np.broadcast_to(np.asarray(bound, dtype=np.float64), expected.shape)[fin]
    if err.size and not np.all(err <= limit):
        worst = int(np.argmax(err - limit))
        raise AssertionError(
            f"{what}: error {err[worst]:.3g} exceeds bound {limit[worst]:.3g} "
            f"(expected {expected[fin][worst]!r}, got {got[fin][worst]!r})"
        )


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """Assert ``got`` matches ``expected`` within the generic :data:`TOLERANCES` of ``dtype``.

    NaN must match NaN and infinities must match exactly (same sign); finite values must lie
    within ``atol + rtol * |expected|``.
    """
    rtol, atol = TOLERANCES[dtype]
    expected = np.asarray(expected, dtype=np.float64)
    assert_within(got, expected, atol + rtol * np.abs(np.nan_to_num(expected)),
                  f"{what} [{dtype}]")
