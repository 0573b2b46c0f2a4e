"""The conformance kit of softmaxkit, run against the numba-cpu backend on numpy and torch."""

from __future__ import annotations

import pytest
from softmaxkit_numba_cpu.manifest import ATTENTION_OPS, PAGED_OPS, ROW_OPS, VARLEN_OPS

from softmaxkit.testing import Unsupported, cases

BACKEND = "numba-cpu"
TARGETS = ("numpy", "torch-cpu")
ROW_CASES = [c for t in TARGETS for c in cases(target=t, ops=ROW_OPS)]
ATTENTION_CASES = [
    c for t in TARGETS for c in cases(target=t, ops=ATTENTION_OPS)
    if set(c.ops) <= set(ATTENTION_OPS)  # merges are tested with the summary kernels
]
PAGED_CASES = [c for t in TARGETS for c in cases(target=t, ops=PAGED_OPS)]
VARLEN_CASES = [c for t in TARGETS for c in cases(target=t, ops=VARLEN_OPS)]
DECLINED: set[str] = set()
"""Cases this backend declines on purpose (none: every attention option is served)."""


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: f"{c.target.name}-{c}")
def test_row_case(case):
    # every row operation and dtype is served on both targets, so nothing may be declined
    try:
        case.run(BACKEND)
    except Unsupported as exc:  # pragma: no cover - a failure, with the reason
        pytest.fail(f"numba-cpu declined a case it serves: {exc}")


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c.target.name}-{c}")
def test_attention_case(case):
    if case.name in DECLINED:
        with pytest.raises(Unsupported, match="not a boolean mask"):
            case.run(BACKEND)
        return
    try:
        case.run(BACKEND)
    except Unsupported as exc:  # pragma: no cover
        pytest.fail(f"numba-cpu declined a case it serves: {exc}")


@pytest.mark.parametrize("case", PAGED_CASES + VARLEN_CASES,
                         ids=lambda c: f"{c.target.name}-{c}")
def test_packed_and_paged_attention_case(case):
    try:
        case.run(BACKEND)
    except Unsupported as exc:  # pragma: no cover
        pytest.fail(f"numba-cpu declined a case it serves: {exc}")
