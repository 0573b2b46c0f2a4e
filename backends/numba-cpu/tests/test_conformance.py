"""The conformance kit of softmaxkit, run against the numba-cpu backend on numpy and torch."""

from __future__ import annotations

import pytest
from softmaxkit_numba_cpu.manifest import DTYPES, ROW_OPS

from softmaxkit.testing import Unsupported, cases

BACKEND = "numba-cpu"
ROW_CASES = cases(target="numpy", ops=ROW_OPS) + cases(target="torch-cpu", ops=ROW_OPS)


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: f"{c.target.name}-{c}")
def test_row_case(case):
    # every row operation and dtype is served on both targets, so nothing may be declined
    assert case.dtype in DTYPES
    try:
        case.run(BACKEND)
    except Unsupported as exc:  # pragma: no cover - a failure, with the reason
        pytest.fail(f"numba-cpu declined a case it serves: {exc}")
