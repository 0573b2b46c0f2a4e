"""The conformance kit: the spec's cases, runnable against any installed backend.

A backend proves itself with one call (or ``softmaxkit verify --backend NAME``)::

    from softmaxkit.testing import check_backend
    results = check_backend("mybackend", target="numpy")
    assert all(r.passed for r in results)
    assert any(r.status == "passed" for r in results)  # something ran

or, in its own pytest suite, by parametrizing over :func:`cases`::

    @pytest.mark.parametrize("case", cases(target="numpy"), ids=str)
    def test_conformance(case):
        try:
            case.run("mybackend")
        except Unsupported as exc:  # RanNothing included
            pytest.skip(str(exc))

Each case counts its checks (calls of the backend whose results it compared with the spec); a
case with none is ``"ran nothing"`` (:class:`RanNothing`), never ``"passed"``.  A backend
whose kernel or hook fails to import fails every case that reaches it.

A backend whose attention kernels serve only some head dimensions runs the attention cases at
those: ``check_backend("mybackend", target="torch-cuda", head_dims=((64, 64), (128, 128)))``.
"""

from .kit import (
    STATUSES,
    CaseResult,
    RanNothing,
    Target,
    Unsupported,
    case,
    cases,
    check_backend,
    run_cases,
    target,
)

__all__ = ["STATUSES", "CaseResult", "RanNothing", "Target", "Unsupported", "case", "cases",
           "check_backend", "run_cases", "target"]
