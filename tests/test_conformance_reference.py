"""The conformance kit run against the reference backend on numpy, array_api_strict and torch
CPU arrays: the reference is the executable spec, so it must pass every case."""

from __future__ import annotations

import pytest

from softmaxkit.testing import Unsupported, cases

TARGETS = ("numpy", "array_api_strict", "torch-cpu")


def all_cases():
    for name in TARGETS:
        for c in cases(name):
            if c.dtype in c.target.dtypes:  # array_api_strict has no 16-bit floats
                yield pytest.param(c, id=f"{name}-{c}")


@pytest.mark.parametrize("case", list(all_cases()))
def test_reference_conforms(case):
    try:
        case.run("reference")
    except Unsupported as exc:
        pytest.skip(str(exc))


def test_kit_covers_every_row_operation():
    from softmaxkit.testing.rows_cases import ROW_OPS

    covered = {op for c in cases("numpy") for op in c.ops}
    assert set(ROW_OPS) <= covered


def test_kit_detects_a_wrong_backend(monkeypatch):
    """A backend that drops the max subtraction must fail the kit (the kit can fail)."""
    import numpy as np

    import softmaxkit.reference.rows as ref
    from softmaxkit.testing import check_backend

    def naive_softmax(xp, *, x, where, masked, out_dtype):
        e = np.exp(np.asarray(x, dtype=np.float64))
        return xp.astype(xp.asarray(e / e.sum(-1, keepdims=True)), out_dtype)

    monkeypatch.setattr(ref, "softmax", naive_softmax)
    import softmaxkit.registry as registry

    if hasattr(registry, "reload"):
        registry.reload()
    try:
        with np.errstate(all="ignore"):
            results = check_backend("reference", target="numpy", ops=["softmax"],
                                    dtypes=["float64"])
    finally:
        monkeypatch.undo()
        if hasattr(registry, "reload"):
            registry.reload()
    assert any(r.status == "failed" for r in results)
