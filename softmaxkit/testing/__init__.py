"""The conformance kit: the spec's cases, runnable against any installed backend.

A backend proves itself with one call (or ``softmaxkit verify --backend NAME``)::

    from softmaxkit.testing import check_backend
    results = check_backend("mybackend", target="numpy")
    assert all(r.passed for r in results)

or, in its own pytest suite, by parametrizing over :func:`cases`::

    @pytest.mark.parametrize("case", cases(target="numpy"), ids=str)
    def test_conformance(case):
        case.run("mybackend")

A backend whose attention kernels serve only some head dimensions runs the attention cases at
those: ``check_backend("mybackend", target="torch-cuda", head_dims=((64, 64), (128, 128)))``.
"""

from .kit import CaseResult, Target, Unsupported, case, cases, check_backend, target

__all__ = ["CaseResult", "Target", "Unsupported", "case", "cases", "check_backend", "target"]
