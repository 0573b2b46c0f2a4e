"""The error bounds of spec/semantics.md ("Tolerances"), as one function per kind of check."""

from __future__ import annotations

import numpy as np

# Per output dtype: (relative tolerance, absolute tolerance) for probabilities and
# log-domain values against a float64 reference of the represented inputs.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-14),
    "float32": (2e-6, 1e-7),
    "bfloat16": (1.6e-2, 1e-3),
    "float16": (2e-3, 1e-4),
}


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """Assert ``got`` matches ``expected`` within the spec's bound for ``dtype``.

    NaN must match NaN and infinities must match exactly (same sign); finite values must lie
    within ``atol + rtol * |expected|``.
    """
    rtol, atol = TOLERANCES[dtype]
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    nan_g, nan_e = np.isnan(got), np.isnan(expected)
    assert np.array_equal(nan_g, nan_e), f"{what}: NaN at different positions"
    inf_e = np.isinf(expected)
    assert np.array_equal(got[inf_e], expected[inf_e]), f"{what}: infinities differ"
    fin = ~(nan_e | inf_e)
    assert np.all(np.isfinite(got[fin])), f"{what}: non-finite value where finite expected"
    err = np.abs(got[fin] - expected[fin])
    bound = atol + rtol * np.abs(expected[fin])
    if err.size and not np.all(err <= bound):
        worst = int(np.argmax(err - bound))
        raise AssertionError(
            f"{what} [{dtype}]: error {err[worst]:.3g} exceeds bound {bound[worst]:.3g} "
            f"(expected {expected[fin][worst]!r}, got {got[fin][worst]!r})"
        )
