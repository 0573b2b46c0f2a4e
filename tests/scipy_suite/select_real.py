"""A pytest plugin that keeps the real-valued cases of SciPy's ``test_logsumexp.py``.

softmaxkit defines its operations for real logits only (spec/semantics.md, S3), so the cases
that feed complex numbers are deselected: a parameter that is complex or names a complex
dtype, and the tests of complex results.  ``test_wrap_radians`` checks a private SciPy helper
that is not swapped, so it says nothing about softmaxkit and is left out too.  The selection
is the same with and without the swap, so the two runs count the same cases.
"""

from __future__ import annotations

from typing import Any

COMPLEX_TESTS = {
    "test_logsumexp_complex_sign", "test_gh21610", "test_gh21709_small_imaginary",
}
NOT_SWAPPED = {"test_wrap_radians"}


def _complex(value: Any) -> bool:
    return isinstance(value, complex) or (isinstance(value, str) and "complex" in value)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep, drop = [], []
    for item in items:
        name = item.originalname if hasattr(item, "originalname") else item.name
        params = getattr(getattr(item, "callspec", None), "params", {})
        real = name not in COMPLEX_TESTS | NOT_SWAPPED and not any(
            _complex(v) for v in params.values())
        (keep if real else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
