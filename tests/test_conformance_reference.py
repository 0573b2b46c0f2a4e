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
    from softmaxkit.testing.row_checks import ROW_OPS

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


# a backend that serves attention only at D == Dv in {64, 128}, as tensor-core kernels often do
NARROW_DIMS = (64, 128)
NARROW_OPS = ("attention", "attention_vjp", "merge_attention")
NARROW = {
    "name": "narrow-heads",
    "serves": [{"ops": list(NARROW_OPS), "devices": ["cpu"]}],
    "kernels": {op: f"softmaxkit.reference.attention:{op}" for op in NARROW_OPS},
    "can_run": f"{__name__}:narrow_can_run",
}


def narrow_can_run(call):
    if call.op == "merge_attention":  # merges take any value dimension
        return True
    d, dv = call.args["q"].shape[-1], call.args["v"].shape[-1]
    return (d == dv and d in NARROW_DIMS) or f"head dimensions {(d, dv)}"


@pytest.fixture
def narrow():
    from softmaxkit import registry

    registry.register(NARROW)
    yield NARROW["name"]
    registry.unregister(NARROW["name"])


def test_kit_runs_every_attention_case_at_a_backends_head_dims(narrow):
    from softmaxkit.testing import check_backend

    dims = tuple((d, d) for d in NARROW_DIMS)
    results = check_backend(narrow, ops=NARROW_OPS, dtypes=["float32"], head_dims=dims)
    names = {r.case for r in results}
    assert {"attention_head_dims", "attention_vjp", "merge_attention_states_split_kv"} <= names
    left = [f"{r.case}: {r.status} {r.message[:200]}" for r in results if r.status != "passed"]
    assert not left, "\n".join(left)
    # at the kit's default head dimensions the same backend declines every attention case
    # (the merges, of any value dimension, still run)
    results = check_backend(narrow, ops=NARROW_OPS, dtypes=["float32"])
    assert {r.status for r in results if "merge_attention" not in r.ops} == {"unsupported"}
    assert {r.status for r in results if "merge_attention" in r.ops} == {"passed"}


def test_head_dims_reach_the_cases_through_the_target():
    from softmaxkit.testing.kit import HEAD_DIMS

    assert {c.target.head_dims for c in cases("numpy", ops=["attention"])} == {HEAD_DIMS}
    chosen = cases("numpy", ops=["attention"], head_dims=[[64, 32], (128, 128)])
    assert {c.target.head_dims for c in chosen} == {((64, 32), (128, 128))}


@pytest.mark.parametrize(
    ("head_dims", "error"),
    [((), ValueError), (((64, 0),), ValueError), ((64, 64), TypeError),
     (((64.0, 64),), TypeError)],
)
def test_bad_head_dims_are_rejected(head_dims, error):
    with pytest.raises(error, match="head_dims"):
        cases("numpy", ops=["attention"], head_dims=head_dims)
